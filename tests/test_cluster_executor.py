"""Executor against real processes: SPMD jobs get resized by SIGTERM -> checkpoint -> restart on a new
device count and resume from their checkpoints; PS jobs get resized in place (same process, same
trajectory); measured speeds and losses reach the models."""
import json

import numpy as np
import pytest

from omnijax.cluster.executor import Executor, ExecJob, ToyRunner
from omnijax.cluster.schedulers import FittedModel
from omnijax.errors import UserError


class _ByProgress(FittedModel):
    """Job a holds 3 devices until it has trained 100 steps, then 2; b holds 1 throughout. The resize is decided by
    progress, not by how fast this machine runs the jobs."""
    def allocate(self, now, jobs, cluster):
        return {j.name: (2 if j.progress >= 100 else 3) if j.name == "a" else 1 for j in jobs}


def test_executor_resizes_real_jobs_and_feeds_models(tmp_path):
    # each step takes >= 3 ms: a's 1400 steps after the resize point last >= 4 s, many 0.3 s slots, on any machine
    ex = Executor(_ByProgress(), ToyRunner(work=4000, checkpoint_every=5, min_step_s=0.003), devices=4,
                  run_root=tmp_path, backend="local", slot_s=0.3, log=lambda s: None)
    result = ex.run([ExecJob("a", steps=1500, arrival_s=0.0), ExecJob("b", steps=300, arrival_s=0.0)])
    by = {j["name"]: j for j in result.jobs}
    assert by["a"]["steps"] == 1500 and by["b"]["steps"] == 300
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


class _Scripted(FittedModel):
    """Device count by the job's progress: 2 -> 4 -> 1 (so 2 -> 4 -> 1 workers, 1 -> 2 -> 1 servers)."""
    def allocate(self, now, jobs, cluster):
        return {j.name: min(cluster.gpus, 2 if j.progress < 40 else 4 if j.progress < 100 else 1) for j in jobs}


def _reference_chunk_losses(steps, chunk, lr=3e-3):
    """The same training as one process: full-batch Adam on the digits MLP (what sync PS computes for any
    worker count, since the workers' equal shards average to the full-batch gradient)."""
    import jax
    import optax
    from flax import nnx

    from omnijax.cluster.ps_job import DIGITS_BATCH, SplitBatches
    from omnijax.models.classifier import ClassifierConfig, build_classifier, classifier_loss
    from omnijax.data.digits import digits_split

    (x, y), _ = digits_split()
    batches = SplitBatches(x, y, DIGITS_BATCH, seed=0)
    graphdef, params, rest = nnx.split(build_classifier(ClassifierConfig(in_dim=64, hidden=[64, 64], num_classes=10), 0),
                                       nnx.Param, ...)
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, g = jax.value_and_grad(lambda p: classifier_loss(nnx.merge(graphdef, p, rest), batch))(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    losses = []
    for s in range(steps):
        params, state, loss = step(params, state, batches(s, 0, 1))
        losses.append(float(loss))
    return [float(sum(losses[i:i + chunk]) / chunk) for i in range(0, steps, chunk)]


@pytest.mark.slow
def test_executor_resizes_a_ps_job_in_place(tmp_path):
    """A PS job changes 2 -> 4 -> 1 workers (1 -> 2 -> 1 servers) inside one process: no stop, no second
    start, every step once, and the loss follows the undisturbed full-batch trajectory step for step."""
    from omnijax.cluster.executor import PSRunner

    steps, chunk = 160, 5
    # lockstep: the job waits at each chunk for the executor to read it, so the resizes land at the chunks the
    # script names however loaded the machine is
    ex = Executor(_Scripted(), PSRunner(max_servers=2, chunk=chunk, lockstep=True), devices=4, run_root=tmp_path,
                  backend="local", slot_s=0.05, log=lambda s: None)
    result = ex.run([ExecJob("ps", steps=steps)])
    kinds = [e["event"] for e in result.events]
    assert kinds.count("start") == 1 and "stop" not in kinds and result.jobs[0]["restarts"] == 0
    resizes = [e for e in result.events if e["event"] == "resize"]
    assert result.in_place_resizes == len(resizes) >= 2 and all(e["in_place"] for e in resizes)
    rows = [json.loads(r) for r in (tmp_path / "ps" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(chunk, steps + 1, chunk))   # step count continues
    assert len({r["pid"] for r in rows}) == 1                                  # one process throughout
    shapes = [(r["devices"], r["servers"]) for r in rows]
    # the decision at step s applies from the chunk after s: exactly the script's boundaries
    assert shapes == [(2, 1)] * (40 // chunk) + [(4, 2)] * (60 // chunk) + [(1, 1)] * ((steps - 100) // chunk), shapes
    applied = [json.loads(r) for r in (tmp_path / "ps" / "resizes.jsonl").read_text().splitlines()]
    assert len(applied) >= 2 and {a["pid"] for a in applied} == {rows[0]["pid"]}
    # loss keeps its trajectory: per-chunk losses equal the one-process reference (float reassociation only)
    ref = _reference_chunk_losses(steps, chunk)
    np.testing.assert_allclose([r["loss"] for r in rows], ref, rtol=2e-3, atol=1e-4)
    assert rows[-1]["loss"] < 0.3 * rows[0]["loss"]


def test_a_row_being_written_is_not_read_and_a_torn_row_is_dropped_on_resume(tmp_path, monkeypatch):
    """The executor reads metrics.jsonl while the job appends to it: a last line without its newline is half a
    row (a CI run once parsed one). A job killed mid-row resumes with that row gone and its file parseable."""
    from omnijax.cluster import toy_job
    from omnijax.train.metrics import read_metrics
    from omnijax.utils import read_jsonl
    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path))
    monkeypatch.setattr(toy_job.signal, "signal", lambda *a: None)   # leave pytest's SIGTERM handler alone
    assert toy_job.main(["trainer.steps=4", "trainer.run_name=t", "trainer.checkpoint_every=2", "toy.work=64"]) == 0
    metrics = tmp_path / "t" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 5, "loss": 0.1, "step_ti')
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]
    assert toy_job.main(["trainer.steps=6", "trainer.run_name=t", "trainer.checkpoint_every=2", "toy.work=64"]) == 0
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]
    assert metrics.read_text().endswith("\n")
    metrics.write_text(whole.replace('"step": 2', '"step": 2,,'))   # a damaged row inside the file: named, not skipped
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not a JSON row"):
        read_jsonl(metrics)
