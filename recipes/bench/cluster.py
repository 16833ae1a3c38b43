"""Cluster schedulers side by side in the trace-driven simulator on the Pollux workloads."""
from __future__ import annotations

import time
from typing import Iterator

DESCRIPTION = ("cluster scheduling: avg JCT, makespan, utilisation of FIFO/DRF/Tiresias/fitted/learned per workload set, "
               "with an oracle-length fitted variant and lower bounds (no queueing; LP and Lagrangian relaxations; a "
               "slot-exact MILP for small workloads)")


def _progress(items, desc: str):
    """A bar on stderr per workload set while its bounds solve (minutes per file at the defaults)."""
    import sys

    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="file", file=sys.stderr, leave=False, mininterval=1.0)


def run(overrides: list[str]) -> Iterator[dict]:
    """Overrides: schedulers=[...], workloads=[sets, CSV files or folders of them], files=N (workload-1..N of
    each bundled set, the first N CSV files of a folder; 0: all), limit=N jobs,
    applications=[...] (only those jobs: for decomposing the average, or with `limit` for small workloads),
    lp_interval_s=S (0: no LP bound), milp_time_s=S (the slot-exact bound, small workloads only), seeds=N (runs
    per file at sim.seed, sim.seed + 1, ...), plus any ClusterConfig key (sim.* such as sim.families=[stepdecay],
    learned.*). Each row averages the set's files and seeds; `per_file` lists the files (mean over seeds)."""
    from dataclasses import replace

    import numpy as np

    from omnijax.cluster.config import SCHEDULERS, BenchConfig, ClusterConfig, validate
    from omnijax.cluster.registry import make_scheduler
    from omnijax.cluster.bounds import alone_bound, lagrangian_bound, lp_bound
    from omnijax.cluster.slot_bound import slot_bound
    from omnijax.cluster.simulator import jobs_from_specs, run_workload
    from omnijax.cluster.traces import APPLICATIONS, load_workload, workload_files
    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(BenchConfig, None, overrides, check=None)
    bad = [s for s in cfg.schedulers if s not in SCHEDULERS]
    if bad or cfg.files < 0:
        raise ConfigError(f"schedulers must be among {', '.join(SCHEDULERS)} (got {bad}); files must be >= 0 (0: all)")
    if cfg.lp_interval_s < 0:
        raise ConfigError(f"lp_interval_s={cfg.lp_interval_s}: must be > 0 (or 0 to skip the LP bound)")
    if cfg.lagrange_interval_s < 0 or cfg.lagrange_iterations < 1:
        raise ConfigError(f"lagrange_interval_s={cfg.lagrange_interval_s}, lagrange_iterations={cfg.lagrange_iterations}: "
                          f"need an interval > 0 (or 0 to skip the Lagrangian bound) and at least one iteration")
    if cfg.seeds < 1:
        raise ConfigError(f"seeds={cfg.seeds}: must be >= 1")
    if cfg.milp_time_s < 0:
        raise ConfigError(f"milp_time_s={cfg.milp_time_s}: must be > 0 (or 0 to skip the slot-exact bound)")
    if any(a not in APPLICATIONS for a in cfg.applications):
        raise ConfigError(f"applications={cfg.applications}: each must be one of {', '.join(APPLICATIONS)}")
    ccfg = validate(ClusterConfig(sim=cfg.sim, learned=cfg.learned, limit=cfg.limit))
    schedulers = {}
    for name in cfg.schedulers:   # train the learned policy once, reuse it on every workload
        t0 = time.perf_counter()
        schedulers[name] = (make_scheduler(name, ccfg), time.perf_counter() - t0)
    for wset in cfg.workloads:
        rows, per_file, runs = {}, {}, {}
        names = workload_files(wset, cfg.files)
        specs = {}
        for i, name in enumerate(names):    # the first `limit` jobs of the chosen applications
            chosen = [s for s in load_workload(name) if not cfg.applications or s.application in cfg.applications]
            specs[i] = chosen[:cfg.limit] if cfg.limit else chosen
        nfiles = len(names)
        truth = {i: jobs_from_specs(specs[i], cfg.sim) for i in specs}     # the bounds read the true lengths
        bound = float(np.mean([alone_bound(*truth[i], cfg.sim.cluster) for i in specs]))
        sims = [replace(cfg.sim, seed=cfg.sim.seed + k) for k in range(cfg.seeds)]
        for name in cfg.schedulers:
            proto, train_s = schedulers[name]
            t0 = time.perf_counter()
            results = [run_workload(specs[i], proto.fresh(), sim) for i in specs for sim in sims]   # file-major
            jct = np.array([r.avg_jct_s for r in results]).reshape(nfiles, cfg.seeds)
            rows[name] = {
                "variant": name, "workload": wset, "files": nfiles, "jobs": len(specs[0]),
                "avg_jct_s": round(float(np.mean([r.avg_jct_s for r in results])), 1),
                "makespan_s": round(float(np.mean([r.makespan_s for r in results])), 1),
                "utilization": round(float(np.mean([r.utilization for r in results])), 4),
                "restarts_per_job": round(float(np.mean([np.mean([j["restarts"] for j in r.jobs]) for r in results])), 2),
                "sim_s": round(time.perf_counter() - t0, 1),
                "per_file": [round(float(v), 1) for v in jct.mean(1)]}
            if cfg.seeds > 1:
                rows[name]["seeds"] = cfg.seeds
                rows[name]["per_seed"] = [[round(float(v), 1) for v in row] for row in jct]
            if cfg.sim.families:
                rows[name]["families"] = list(cfg.sim.families)
            per_file[name] = list(jct.mean(1))
            runs[name] = jct
            if train_s > 1:
                rows[name]["train_s"] = round(train_s, 1)
            base = "drf" if name not in ("learned", "fitted_aware") or "fitted" not in rows else "fitted"
            if name != "drf" and base in rows:
                rows[name]["vs"] = base
                rows[name]["jct_ratio"] = round(rows[name]["avg_jct_s"] / rows[base]["avg_jct_s"], 4)
                if base == "fitted":   # paired (same file, same seed): the spread of the per-run ratio
                    ratios = (runs[name] / runs["fitted"]).ravel()
                    rows[name]["ratio_per_run_mean"] = round(float(ratios.mean()), 4)
                    rows[name]["ratio_per_run_range"] = [round(float(ratios.min()), 4), round(float(ratios.max()), 4)]
            if name == "learned" and "fitted_aware" in rows:
                rows[name]["vs_fitted_aware"] = round(rows[name]["avg_jct_s"] / rows["fitted_aware"]["avg_jct_s"], 4)
            if name == "learned" and hasattr(proto, "accepted"):
                rows[name]["policy_accepted"] = bool(proto.accepted)
                rows[name]["policy_kept"] = getattr(proto, "kept", "trained policy" if proto.accepted else "fitted")
                rows[name]["policy_validation_vs_fitted"] = round(float(proto.validation_vs_fitted), 4)
            if name == "fitted_oracle":
                rows[name]["note"] = "not online: told the true job lengths (a bound for the fitted allocation)"
            yield rows[name]
        row = {"variant": "bound_alone", "workload": wset, "files": nfiles, "avg_jct_s": round(bound, 1),
               "note": "every job alone on its fastest size from arrival (ignores that jobs share the cluster)"}
        if "drf" in rows:
            row["vs"], row["jct_ratio"] = "drf", round(bound / rows["drf"]["avg_jct_s"], 4)
        yield row
        best: dict[int, float] = {}      # per file the highest bound so far

        def bound(variant: str, values: list[float], keep: bool = True, **fields) -> dict:
            """A bound's row (its mean over the files and each file's figure, then `fields`), compared with the
            schedulers; `keep`: it also raises `best`."""
            if keep:
                best.update({i: max(best.get(i, 0.0), v) for i, v in zip(specs, values)})
            row = {"variant": variant, "workload": wset, "files": len(values),
                   "avg_jct_s": round(float(np.mean(values)), 1), "per_file": [round(v, 1) for v in values], **fields}
            return _vs(row, rows, per_file)

        if cfg.lp_interval_s > 0:
            lps = [lp_bound(*truth[i], cfg.sim, interval_s=cfg.lp_interval_s)
                   for i in _progress(specs, f"bound_lp {wset}")]
            yield bound("bound_lp", [b.avg_jct_s for b in lps], interval_s=cfg.lp_interval_s,
                        solve_s=round(sum(b.solve_s for b in lps), 1),
                        note="time-indexed LP relaxation (capacity, release, speed-up envelope): no scheduler can be lower")
        if cfg.lagrange_interval_s > 0:
            lgs = [lagrangian_bound(*truth[i], cfg.sim, interval_s=cfg.lagrange_interval_s,
                                    iterations=cfg.lagrange_iterations,
                                    lp=lps[i] if cfg.lp_interval_s == cfg.lagrange_interval_s else None)
                   for i in _progress(specs, f"bound_lagrange {wset}")]
            yield bound("bound_lagrange", [b.avg_jct_s for b in lgs],
                        lp_same_interval_s=round(float(np.mean([b.lp_avg_jct_s for b in lgs])), 1),
                        master_s=round(float(np.mean([b.master_avg_jct_s for b in lgs])), 1),
                        iterations=int(max(b.iterations for b in lgs)), interval_s=cfg.lagrange_interval_s,
                        solve_s=round(sum(b.solve_s for b in lgs), 1),
                        note="Lagrangian relaxation of capacity with each job's true completion time (column "
                             "generation from the LP's prices): no scheduler can be lower; master_s: the restricted "
                             "master LP (its gap to avg_jct_s: how far the column generation is from converged)")
        if cfg.milp_time_s > 0:
            sbs = [slot_bound(*truth[i], cfg.sim, time_limit_s=cfg.milp_time_s,
                              floor=best.get(i)) for i in _progress(specs, f"bound_slot {wset}")]
            yield bound("bound_slot", [b.avg_jct_s for b in sbs], optimal_files=sum(b.optimal for b in sbs),
                        incumbent_per_file=[round(b.incumbent_avg_jct_s, 1) for b in sbs],
                        slots=int(max(b.slots for b in sbs)), integers=int(max(b.integers for b in sbs)),
                        solve_s=round(sum(b.solve_s for b in sbs), 1),
                        note="slot-exact mixed-integer program (whole devices per slot, a restart per change, "
                             "devices held to the end of the finishing slot), HiGHS's dual bound: no scheduler can be "
                             "lower; exact where optimal_files counts the file; small workloads only (milp_time_s per file)")
        if best:
            yield bound("bound_best", [best[i] for i in specs], keep=False, note="per file the highest of the bounds above")


def _vs(row: dict, rows: dict, per_file: dict | None = None) -> dict:
    """A bound row with its ratio to DRF and the fitted and learned schedulers' ratios to it (with
    `per_file` schedulers' results and the row's own `per_file`: also the ratio file by file)."""
    if "drf" in rows:
        row["vs"], row["jct_ratio"] = "drf", round(row["avg_jct_s"] / rows["drf"]["avg_jct_s"], 4)
    for name in ("fitted", "fitted_oracle", "learned"):
        if name in rows:
            row[f"{name}_over_bound"] = round(rows[name]["avg_jct_s"] / row["avg_jct_s"], 4)
            if per_file and name in per_file and "per_file" in row:
                row[f"{name}_over_bound_per_file"] = [round(a / b, 4) for a, b in zip(per_file[name], row["per_file"])]
    return row
