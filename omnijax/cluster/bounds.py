"""Lower bounds on the average JCT any scheduler can reach in the simulator.

Two bounds, both computed from the hidden truth (job lengths and measured step times), so they are
references for the bench, never inputs to a scheduler:

- `alone_bound`: every job alone on its fastest size from its arrival. Loose when the cluster is
  overloaded, because it ignores that jobs share 64 devices.
- `lp_bound`: a time-indexed linear relaxation that keeps the capacity (devices and CPUs), each job's
  release time (the simulator starts a job at a slot boundary and charges a restart before its first
  step) and its speed-up curve, and relaxes everything else (fractional devices, free resizing,
  no placement). Its optimum is below the average JCT of every schedule the simulator can run.

Why the LP is a valid bound. Let F_j(t) be job j's completed fraction. Its mean progress time
M_j = ∫ t dF_j satisfies C_j ≥ M_j + p_j/2, where p_j is its fastest running time alone: F_j rises at
most at rate 1/p_j, so ∫ F_j dt over [r_j, C_j] is at least p_j/2 (the Goemans bound for preemptive
scheduling). Cutting time into intervals [t_k, t_k+1) and writing y_jk for the fraction done in
interval k, M_j ≥ Σ_k y_jk · max(t_k, r_j). With x_jk the average devices job j holds in interval k,
its progress there is at most the time it may run there times its concave speed-up envelope at
those devices (time-sharing between sizes cannot beat the envelope), a set of linear cuts. Inside an
interval the work done at most at rate 1/p_j sits at least y_jk·p_j/2 after the interval's start on
average (a parabola, linearised by tangents). The relaxation lets jobs that share an interval all
claim its start, and a job released inside an interval use devices from before its release, which
costs it up to about one interval per job: shorter intervals are tighter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from omnijax.cluster.jobs import Cluster, Job
from omnijax.cluster.simulator import SimConfig, StepTimeFn


def fastest_step_time(job: Job, n: int, step_time: StepTimeFn, cluster: Cluster) -> float:
    """Seconds per step on n devices under the best node count the cluster allows."""
    lo = max(1, math.ceil(n / cluster.gpus_per_node))
    return min(step_time(job, n, m) for m in range(lo, min(n, cluster.num_nodes) + 1))


def speedup_rates(job: Job, step_time: StepTimeFn, cluster: Cluster) -> np.ndarray:
    """Fraction of the job finished per second on 0..cap devices (index = devices; rate[0] = 0)."""
    cap = max(1, min(job.max_replicas, cluster.gpus))
    rates = [0.0] + [1.0 / (job.total_steps * fastest_step_time(job, n, step_time, cluster)) for n in range(1, cap + 1)]
    return np.maximum.accumulate(np.array(rates))      # holding more devices may idle the extra ones


def concave_cuts(rates: np.ndarray) -> list[tuple[float, float]]:
    """The upper concave envelope of points (n, rates[n]), n = 0.., as lines (slope, intercept) whose
    minimum is the envelope on [0, len − 1]."""
    hull: list[int] = []
    for n in range(len(rates)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b if it lies on or below the chord a–n
            if (rates[b] - rates[a]) * (n - a) <= (rates[n] - rates[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(n)
    cuts = []
    for a, b in zip(hull, hull[1:]):
        slope = (rates[b] - rates[a]) / (b - a)
        cuts.append((slope, rates[a] - slope * a))
    cuts.append((0.0, float(rates[hull[-1]])))
    return cuts


def alone_bound(jobs: Sequence[Job], step_time: StepTimeFn, cluster: Cluster) -> float:
    """Average JCT if every job ran alone from its arrival on its fastest size (no queueing, no slot
    wait, no restart)."""
    return float(np.mean([1.0 / speedup_rates(j, step_time, cluster).max() for j in jobs]))


@dataclass
class LPBound:
    avg_jct_s: float          # the bound
    intervals: int
    interval_s: float
    solve_s: float


def lp_bound(jobs: Sequence[Job], step_time: StepTimeFn, cfg: SimConfig, interval_s: float = 300.0) -> LPBound:
    """Average-JCT lower bound from the time-indexed relaxation (module docstring); HiGHS solves it.

    Valid for every schedule the simulator runs with `cfg` in which no job holds more than its
    `max_replicas` (every scheduler here respects that); any `interval_s` gives a valid bound, shorter
    ones a tighter and slower one.
    """
    import time

    import scipy.sparse as sp
    from scipy.optimize import linprog

    if interval_s <= 0:
        raise ValueError(f"interval_s={interval_s}: must be > 0")
    if not jobs:
        raise ValueError("lp_bound needs at least one job")
    cluster = cfg.cluster
    # earliest first progress in the simulator: the next slot boundary, then one restart
    release = np.array([math.ceil(j.arrival / cfg.slot_s) * cfg.slot_s + cfg.restart_s for j in jobs])
    rates = [speedup_rates(j, step_time, cluster) for j in jobs]
    fastest = np.array([1.0 / r.max() for r in rates])
    one_dev = np.array([1.0 / r[1] for r in rates])
    # first guess: every job one after another on one device each, after the last release
    span = release.max() + one_dev.sum() / cluster.gpus + fastest.max() + interval_s - release.min()
    t0 = time.perf_counter()
    while True:
        starts = release.min() // interval_s * interval_s + interval_s * np.arange(math.ceil(span / interval_s) + 1)
        res = _solve(jobs, rates, release, starts, interval_s, cluster, sp, linprog)
        # the horizon is long enough once the optimum leaves the last interval empty
        if res is not None and not res[1]:
            break
        span *= 2
    total = res[0] + float(np.sum(fastest / 2.0 - np.array([j.arrival for j in jobs])))
    return LPBound(avg_jct_s=total / len(jobs), intervals=len(starts), interval_s=interval_s,
                   solve_s=time.perf_counter() - t0)


def _solve(jobs, rates, release, starts, dt, cluster, sp, linprog) -> tuple[float, bool] | None:
    """min Σ_j Σ_k [y_jk·s_jk + w_jk] over the relaxation, s_jk = max(t_k, r_j) and w_jk ≥ y_jk²/(2ρ_j)
    (work done at most at rate ρ_j cannot all happen at s_jk; tangent cuts of the parabola);
    returns (optimum, whether the last interval is used), None if the horizon is infeasible."""
    cols_j, cols_k, eff = [], [], []
    for j, r in enumerate(release):
        run = np.clip(starts + dt - r, 0.0, dt)     # seconds of interval k the job may run
        ks = np.nonzero(run > 0)[0]
        cols_j.append(np.full(len(ks), j))
        cols_k.append(ks)
        eff.append(run[ks])
    cj, ck, ce = np.concatenate(cols_j), np.concatenate(cols_k), np.concatenate(eff)
    V = len(cj)                      # one (x, y, w) triple per (job, interval) where the job may run
    x, y, w = np.arange(V), V + np.arange(V), 2 * V + np.arange(V)
    rho = np.array([rt.max() for rt in rates])[cj]
    cost = np.concatenate([np.zeros(V), np.maximum(starts[ck], release[cj]), np.ones(V)])
    blocks = []                      # (row ids, col ids, values) triplets; rhs alongside
    rhs = []
    nrow = 0

    def add(cols_vals: list[tuple[np.ndarray, np.ndarray]], b: np.ndarray) -> None:
        nonlocal nrow
        rid = nrow + np.arange(len(b))
        for c, v in cols_vals:
            blocks.append((rid, c, np.broadcast_to(v, rid.shape)))
        rhs.append(b)
        nrow += len(b)

    cuts = [concave_cuts(rt) for rt in rates]
    for j in range(len(jobs)):       # y ≤ slope·x·dt + intercept·eff for every envelope line
        sel = np.nonzero(cj == j)[0]
        for slope, icpt in cuts[j]:
            add([(y[sel], 1.0), (x[sel], -slope * dt)], icpt * ce[sel])
    for f in (0.125, 0.375, 0.625, 0.875):   # w ≥ (y0/ρ)·y − y0²/(2ρ) at y0 = f·(most y can be)
        y0 = f * ce * rho
        add([(y, y0 / rho), (w, -1.0)], y0 ** 2 / (2 * rho))
    cpu = np.array([j.cpus_per_replica for j in jobs], dtype=float)
    order = np.argsort(ck, kind="stable")     # devices and CPUs per interval
    ks, first = np.unique(ck[order], return_index=True)
    grp = np.searchsorted(ks, ck)
    blocks.append((nrow + grp, x, np.ones(V)))
    blocks.append((nrow + len(ks) + grp, x, cpu[cj]))
    rhs += [np.full(len(ks), float(cluster.gpus)), np.full(len(ks), float(cluster.cpus))]
    nrow += 2 * len(ks)
    rows = np.concatenate([b[0] for b in blocks])
    cols = np.concatenate([b[1] for b in blocks])
    vals = np.concatenate([b[2] for b in blocks]).astype(float)
    A_ub = sp.csr_matrix((vals, (rows, cols)), shape=(nrow, 3 * V))
    A_eq = sp.csr_matrix((np.ones(V), (cj, y)), shape=(len(jobs), 3 * V))
    res = linprog(cost, A_ub=A_ub, b_ub=np.concatenate(rhs), A_eq=A_eq, b_eq=np.ones(len(jobs)),
                  bounds=(0, None), method="highs")
    if res.status == 2:              # infeasible: the horizon is too short
        return None
    if res.status != 0:
        raise RuntimeError(f"lp_bound: HiGHS failed: {res.message}")
    last = ck == len(starts) - 1
    return float(res.fun), bool(np.any(res.x[y[last]] > 1e-9))
