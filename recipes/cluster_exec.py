"""Run real training jobs under a scheduler on a local Ray instance, resizing them by checkpoint-restart."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

DESCRIPTION = "cluster executor: N real tiny_lm jobs under a scheduler on local Ray, resized via checkpoint/restart"


def main(argv: list[str]) -> int:
    from omnijax.cluster.config import SCHEDULERS, ExecConfig
    from omnijax.cluster.executor import Executor, ExecJob, TinyLMRunner, ToyRunner
    from omnijax.cluster.registry import make_scheduler
    from omnijax.cluster.schedulers import FittedModel
    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(ExecConfig, None, argv, check=None)
    if cfg.scheduler not in SCHEDULERS or cfg.scheduler == "learned":
        raise ConfigError(f"scheduler={cfg.scheduler!r}: the executor takes one of {', '.join(SCHEDULERS[:-1])}")
    if cfg.runner not in ("tiny_lm", "toy"):
        raise ConfigError(f"runner={cfg.runner!r}: must be 'tiny_lm' or 'toy'")
    if len(cfg.steps) < cfg.jobs or len(cfg.arrivals_s) < cfg.jobs or cfg.jobs < 1:
        raise ConfigError(f"jobs={cfg.jobs}: steps and arrivals_s need at least one entry per job")
    root = Path(os.environ.get("OMNIJAX_RUNS", "runs"))
    out = root / cfg.run_name
    if (out / "jobs").exists():   # a fresh run: jobs must not resume from an earlier run's checkpoints
        shutil.rmtree(out / "jobs")
    out.mkdir(parents=True, exist_ok=True)
    scheduler = (FittedModel(resize_penalty_s=cfg.resize_penalty_s) if cfg.scheduler == "fitted"
                 else make_scheduler(cfg.scheduler))
    runner = TinyLMRunner() if cfg.runner == "tiny_lm" else ToyRunner()
    specs = [ExecJob(f"{cfg.run_name}-job{i}", cfg.steps[i], cfg.arrivals_s[i]) for i in range(cfg.jobs)]
    ex = Executor(scheduler, runner, cfg.devices, run_root=out / "jobs", backend=cfg.backend, slot_s=cfg.slot_s)
    result = ex.run(specs)
    report = {"avg_jct_s": round(result.avg_jct_s, 1), "makespan_s": round(result.makespan_s, 1),
              "resizes": result.resizes, "speed_model_error": result.speed_errors, "jobs": result.jobs,
              "events": result.events}
    (out / "executor.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("avg_jct_s", "makespan_s", "resizes")}))
    if cfg.plot:
        from omnijax.cluster.simulator import SimResult, plot_result
        plot_result(SimResult(cfg.scheduler, result.avg_jct_s, result.makespan_s, float("nan"), result.jobs, [],
                              float("nan"), float("nan")), out / "timeline.png")
    print(f"wrote {out / 'executor.json'}")
    return 0
