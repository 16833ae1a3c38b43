"""Run real training jobs under a scheduler on a local Ray instance: SPMD jobs resized by checkpoint-restart,
PS jobs (runner/runners=ps) in place."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

DESCRIPTION = ("cluster executor: real tiny_lm (checkpoint/restart resizes) and PS (in-place resizes) jobs under a "
               "scheduler on local Ray")


def main(argv: list[str]) -> int:
    from omnijax.cluster.config import SCHEDULERS, ExecConfig
    from omnijax.cluster.executor import Executor, ExecJob, PSRunner, TinyLMRunner, ToyRunner
    from omnijax.cluster.registry import make_scheduler
    from omnijax.cluster.schedulers import FittedModel
    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(ExecConfig, None, argv, check=None)
    if cfg.scheduler not in SCHEDULERS[:-1]:
        raise ConfigError(f"scheduler={cfg.scheduler!r}: the executor takes one of {', '.join(SCHEDULERS[:-1])}")
    if cfg.scheduler == "learned" and not cfg.policy:
        raise ConfigError("scheduler=learned: the executor needs policy=PATH, a policy that "
                          "`bench cluster learned.save=PATH` wrote (it does not train one)")
    kinds = {"tiny_lm": TinyLMRunner, "toy": ToyRunner, "ps": PSRunner}
    bad = [r for r in [cfg.runner, *cfg.runners] if r not in kinds]
    if bad:
        raise ConfigError(f"runner/runners {bad}: each must be one of {', '.join(kinds)}")
    if len(cfg.steps) < cfg.jobs or len(cfg.arrivals_s) < cfg.jobs or cfg.jobs < 1:
        raise ConfigError(f"jobs={cfg.jobs}: steps and arrivals_s need at least one entry per job")
    root = Path(os.environ.get("OMNIJAX_RUNS", "runs"))
    out = root / cfg.run_name
    if (out / "jobs").exists():   # a fresh run: jobs must not resume from an earlier run's checkpoints
        shutil.rmtree(out / "jobs")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.scheduler == "fitted":
        scheduler = FittedModel(resize_penalty_s=cfg.resize_penalty_s)
    elif cfg.scheduler == "learned":
        from omnijax.cluster.residual.store import load_policy
        scheduler = load_policy(cfg.policy)
        scheduler.resize_penalty_s = cfg.resize_penalty_s   # the same resize cost as `fitted` here
    else:
        scheduler = make_scheduler(cfg.scheduler)
    runner = kinds[cfg.runner]()
    if any(not a or not isinstance(a, str) for a in cfg.applications):
        raise ConfigError(f"applications={cfg.applications}: each must be a non-empty name")
    if any(m < 1 for m in cfg.max_devices):
        raise ConfigError(f"max_devices={cfg.max_devices}: each must be >= 1")
    specs = [ExecJob(f"{cfg.run_name}-job{i}", cfg.steps[i], cfg.arrivals_s[i],
                     max_devices=cfg.max_devices[i] if i < len(cfg.max_devices) else 1 << 30,
                     runner=kinds[cfg.runners[i]]() if i < len(cfg.runners) else None,
                     application=cfg.applications[i] if i < len(cfg.applications) else "omnijax")
             for i in range(cfg.jobs)]
    ex = Executor(scheduler, runner, cfg.devices, run_root=out / "jobs", backend=cfg.backend, slot_s=cfg.slot_s)
    result = ex.run(specs)
    report = {"avg_jct_s": round(result.avg_jct_s, 1), "makespan_s": round(result.makespan_s, 1),
              "resizes": result.resizes, "in_place_resizes": result.in_place_resizes, "speed_model_error": result.speed_errors, "jobs": result.jobs,
              "events": result.events}
    (out / "executor.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"scheduler": cfg.scheduler, **{k: report[k] for k in ("avg_jct_s", "makespan_s", "resizes",
                                                                          "in_place_resizes")}}))
    if cfg.plot:
        from omnijax.cluster.simulator import SimResult, plot_result
        plot_result(SimResult(cfg.scheduler, result.avg_jct_s, result.makespan_s, float("nan"), result.jobs, [],
                              float("nan"), float("nan")), out / "timeline.png")
    print(f"wrote {out / 'executor.json'}")
    return 0
