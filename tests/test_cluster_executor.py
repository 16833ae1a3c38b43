"""Executor against real processes: jobs start, get resized by SIGTERM -> checkpoint -> restart on a new
device count, resume from their checkpoints, and feed measured speeds and losses into their models."""
import json

import pytest

from omnijax.cluster.executor import Executor, ExecJob, ToyRunner
from omnijax.cluster.schedulers import FittedModel
from omnijax.errors import UserError


def test_executor_resizes_real_jobs_and_feeds_models(tmp_path):
    sched = FittedModel(resize_penalty_s=5.0)
    ex = Executor(sched, ToyRunner(work=4000, checkpoint_every=5), devices=4, run_root=tmp_path, backend="local",
                  slot_s=0.5, log=lambda s: None)
    result = ex.run([ExecJob("a", steps=400, arrival_s=0.0), ExecJob("b", steps=150, arrival_s=1.0)])
    by = {j["name"]: j for j in result.jobs}
    assert by["a"]["steps"] == 400 and by["b"]["steps"] == 150
    kinds = [(e["event"], e["job"]) for e in result.events]
    assert ("finish", "a") in kinds and ("finish", "b") in kinds
    stops = [e for e in result.events if e["event"] == "stop" and e["reason"] == "resize"]
    assert result.resizes >= 1 and stops and all(e["rc"] in (0, -15) for e in stops)   # -15: stopped before it trained
    # the resized job resumed from its checkpoint: its metrics cover every step exactly once
    name = stops[0]["job"]
    rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, by[name]["steps"] + 1))
    assert len({r["devices"] for r in rows}) >= 2
    # measured step times reached the speed model at more than one device count; losses the loss model
    assert len(by[name]["speed_points"]) >= 2 and by[name]["last_loss"] < rows[0]["loss"]


def test_executor_rejects_bad_backend(tmp_path):
    with pytest.raises(UserError, match="backend"):
        Executor(FittedModel(), ToyRunner(), devices=2, run_root=tmp_path, backend="k8s")
