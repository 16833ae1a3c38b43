"""Run the trace-driven cluster simulator for one scheduler and workload; report + PNG to runs/<run_name>/."""
from __future__ import annotations

import json
import os
from pathlib import Path

DESCRIPTION = ("cluster simulator: one scheduler on one workload (a bundled Pollux name or workload=PATH.csv) -> "
               "runs/<run_name>/report.json + timeline.png")


def main(argv: list[str]) -> int:
    from omnijax.cluster.config import ClusterConfig, validate
    from omnijax.cluster.registry import make_scheduler
    from omnijax.cluster.simulator import run_workload
    from omnijax.cluster.traces import load_workload
    from omnijax.config import build

    cfg = build(ClusterConfig, None, argv, check=validate)
    specs = load_workload(cfg.workload, cfg.limit)
    scheduler = make_scheduler(cfg.scheduler, cfg)
    result = run_workload(specs, scheduler, cfg.sim)
    folder = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / cfg.run_name
    paths = result.write(folder, plot=cfg.plot)
    print(json.dumps({**result.summary(), "workload": cfg.workload}))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
