"""Convert a Philly cluster trace (JSON cluster_job_log, or CSV of job id, submit time, GPUs, duration) into a
workload CSV for `cluster_sim workload=PATH.csv` and `bench cluster workloads=[PATH]`."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

DESCRIPTION = "Philly trace (job id, submit time, GPU count, duration) -> cluster_sim workload CSV (jobs mapped onto the six profiled applications by GPU-time)"


@dataclass
class PhillyConfig:
    input: str = ""                # cluster_job_log (JSON) or a CSV: job id, submit time, GPU count, duration
    output: str = ""               # workload CSV to write
    start_hours: float = 0.0       # window start, in hours after the trace's first submission
    hours: float = 8.0             # window length
    jobs: int = 0                  # sample this many jobs of the window (0 = all)
    seed: int = 0                  # sampling and the cifar10/ncf, deepspeech2/bert choices
    max_gpus: int = 64             # requested GPUs are capped here (the simulated cluster's size)


def main(argv: list[str]) -> int:
    from omnijax.cluster.philly import read_philly, to_workload, write_workload
    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(PhillyConfig, None, argv, check=None)
    if not cfg.input or not cfg.output:
        raise ConfigError("input=PATH and output=PATH.csv are required (a Philly trace in, a workload CSV out)")
    if not cfg.output.endswith(".csv"):
        raise ConfigError(f"output={cfg.output!r}: must end in .csv (cluster_sim reads workload paths by that suffix)")
    if cfg.start_hours < 0:
        raise ConfigError(f"start_hours={cfg.start_hours}: must be >= 0")
    jobs, skipped = read_philly(cfg.input)
    start = min(j.submit_s for j in jobs) + 3600.0 * cfg.start_hours if jobs else None
    specs = to_workload(jobs, start_s=start, hours=cfg.hours, count=cfg.jobs, seed=cfg.seed, max_gpus=cfg.max_gpus)
    path = write_workload(specs, cfg.output)
    print(json.dumps({"read": len(jobs), "skipped_never_ran": skipped, "written": len(specs),
                      "applications": dict(sorted(Counter(s.application for s in specs).items())),
                      "span_s": specs[-1].time - specs[0].time, "output": str(path)}))
    return 0
