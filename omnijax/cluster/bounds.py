"""Lower bounds on the average JCT any scheduler can reach in the simulator.

The bounds, all computed from the hidden truth (job lengths and measured step times), so they are
references for the bench, never inputs to a scheduler:

- `alone_bound`: every job alone on its fastest size from its arrival. Loose when the cluster is
  overloaded, because it ignores that jobs share 64 devices.
- `lp_bound`: a time-indexed linear relaxation that keeps the capacity (devices and CPUs), each job's
  release time (the simulator starts a job at a slot boundary and charges a restart before its first
  step) and its speed-up curve, and relaxes everything else (fractional devices, free resizing,
  no placement). Its optimum is below the average JCT of every schedule the simulator can run.
- `lagrangian_bound`: prices the same capacity instead of enforcing it and charges each job its true
  completion time rather than its mean progress time (its docstring; `_JobPricer`). Tighter where jobs
  run slower than their fastest, which is where the LP is loose.
- `slot_bound.slot_bound` (its own module): a mixed-integer program over the simulator's slots that keeps
  what both relax (whole devices per slot, a restart per change, devices held to the end of the slot a
  job finishes in); for small workloads, where it measures how loose the two relaxations are.

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
from omnijax.cluster.simulator import SimConfig, StepTimeFn, first_slot


def fastest_step_time(job: Job, n: int, step_time: StepTimeFn, cluster: Cluster) -> float:
    """Seconds per step on n devices under the best node count the cluster allows."""
    lo = max(1, math.ceil(n / cluster.gpus_per_node))
    return min(step_time(job, n, m) for m in range(lo, min(n, cluster.num_nodes) + 1))


def speedup_rates(job: Job, step_time: StepTimeFn, cluster: Cluster) -> np.ndarray:
    """Fraction of the job finished per second on 0..cap devices (index = devices; rate[0] = 0)."""
    cap = max(1, min(job.max_replicas, cluster.gpus))
    rates = [0.0] + [1.0 / (job.total_steps * fastest_step_time(job, n, step_time, cluster)) for n in range(1, cap + 1)]
    return np.maximum.accumulate(np.array(rates))      # holding more devices may idle the extra ones


def envelope_vertices(rates: np.ndarray) -> list[int]:
    """Indices n of the points (n, rates[n]) on their upper concave envelope, in order."""
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
    return hull


def concave_cuts(rates: np.ndarray) -> list[tuple[float, float]]:
    """The upper concave envelope of points (n, rates[n]), n = 0.., as lines (slope, intercept) whose
    minimum is the envelope on [0, len − 1]."""
    hull = envelope_vertices(rates)
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
    starts: np.ndarray | None = None   # interval starts
    prices: tuple[np.ndarray, np.ndarray] | None = None   # optimal duals of the device and CPU rows per interval


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
    release = np.array([first_slot(j.arrival, cfg.slot_s) * cfg.slot_s + cfg.restart_s for j in jobs])
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
                   solve_s=time.perf_counter() - t0, starts=starts, prices=(res[2], res[3]))


def _solve(jobs, rates, release, starts, dt, cluster, sp, linprog) -> tuple[float, bool, np.ndarray, np.ndarray] | None:
    """min Σ_j Σ_k [y_jk·s_jk + w_jk] over the relaxation, s_jk = max(t_k, r_j) and w_jk ≥ y_jk²/(2ρ_j)
    (work done at most at rate ρ_j cannot all happen at s_jk; tangent cuts of the parabola);
    returns (optimum, whether the last interval is used, device and CPU prices per interval), None if the
    horizon is infeasible."""
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
    # capacity prices per interval (per device, per CPU held on average over the interval); 0 where no row
    duals = -res.ineqlin.marginals[nrow - 2 * len(ks):]
    lam, mu = np.zeros(len(starts)), np.zeros(len(starts))
    lam[ks], mu[ks] = duals[:len(ks)], duals[len(ks):]
    return float(res.fun), bool(np.any(res.x[y[last]] > 1e-9)), lam, mu


# ----------------------------------------------------------------------------- Lagrangian bound
class _JobPricer:
    """One job's best schedule when devices and CPUs cost given prices per second in each interval: exact.

    A schedule picks the interval K it completes in. Before K, the job holds D_k device-seconds in interval
    k, where it may run r_k seconds; its work there is at most r_k·f(D_k/r_k) (f: the concave speed-up
    envelope, f(0) = 0; Jensen over time, and τ·f(D/τ) grows with τ, so idling part of the interval never
    helps). In K it runs u ≤ r_K seconds with D_K device-seconds: work at most u·f(D_K/u), and it completes
    no earlier than t0_K + u (t0_K: the start of K, or the release). So its value C + priced seconds is at
    least t0_K plus the minimum of a separable convex problem with total work 1:
    - interval k < K: work W costs p_k·r_k·f⁻¹(W/r_k); along the envelope's segments s (slope a_s) that is
      offers of r_k·a_s·width_s work at p_k/a_s each, in increasing order (a_s falls);
    - interval K: at x devices, work W costs W·(1 + p_K·x)/f(x) (u = W/f(x)), least at a vertex x* of the
      envelope (a ratio of linear functions is monotone on each segment), while u = W/f(x*) ≤ r_K; past
      that, u = r_K and more work costs only devices: the segments above x* at p_K/a_s, which is at least
      (1 + p_K·x*)/f(x*) (x*'s optimality). So: one offer of r_K·f(x*) at (1 + p_K·x*)/f(x*), then those.
    Every cost is convex and piecewise linear with the offers in increasing order, so taking the cheapest
    offers first (a fractional knapsack) solves it exactly, and the minimum over K is the job's exact
    minimum over its relaxed schedules: the Lagrangian bound's per-job term. The schedule returned (its C
    and device-seconds per interval) costs exactly that value, so column generation converges to the
    Lagrangian dual. Completing after the horizon costs at least its end."""

    def __init__(self, rates: np.ndarray, cpus: float, release: float, starts: np.ndarray, dt: float):
        hull = envelope_vertices(rates)
        widths = np.diff(hull).astype(float)
        slopes = np.diff(rates[hull]) / widths
        ns = int(np.sum(slopes > 0))                  # slopes fall along the envelope: the rising ones first
        self.slopes, self.widths, self.ns = slopes[:ns], widths[:ns], ns
        self.vx = np.asarray(hull[1:ns + 1], float)  # vertices above 0 (segment s ends at vertex s)
        self.vf = rates[hull][1:ns + 1]
        self.cpus, self.rho, self.release = cpus, float(rates.max()), release
        run = np.clip(starts + dt - release, 0.0, dt)
        self.ks = np.nonzero(run > 0)[0]                       # intervals the job may run in
        self.run = run[self.ks]
        self.t0 = np.maximum(starts[self.ks], release)         # completion in interval K is after this
        self.tail = max(starts[-1] + dt, release + 1.0 / self.rho)   # completing after the horizon

    def price(self, lam: np.ndarray, mu: np.ndarray, chunk: int = 32) -> tuple[float, float, np.ndarray | None]:
        """(min over schedules of C + priced device and CPU seconds, that schedule's C, its device-seconds
        per interval in `ks` (None: completes after the horizon)). Completion intervals are tried in time
        order, in chunks, until their start alone exceeds the best value found."""
        ns, nk = self.ns, len(self.ks)
        p = np.maximum((lam + mu * self.cpus)[self.ks], 0.0)
        # offers of intervals before K: segment s of interval q
        b_unit = (p[:, None] / self.slopes[None, :]).ravel()
        b_cap = (self.run[:, None] * (self.slopes * self.widths)[None, :]).ravel()
        b_dpw = np.tile(1.0 / self.slopes, nk)                # device-seconds per unit of work
        b_pos = np.repeat(np.arange(nk), ns)
        # offers of K: at the best vertex x* until u = r_K, then the segments above x*
        ratio = (1.0 + p[:, None] * self.vx[None, :]) / self.vf[None, :]
        star = np.argmin(ratio, axis=1)
        above = np.arange(ns)[None, :] > star[:, None]
        k_unit = np.concatenate([ratio[np.arange(nk), star][:, None], b_unit.reshape(nk, ns)], axis=1).ravel()
        k_cap = np.concatenate([(self.run * self.vf[star])[:, None],
                                np.where(above, b_cap.reshape(nk, ns), 0.0)], axis=1).ravel()
        k_dpw = np.concatenate([(self.vx[star] / self.vf[star])[:, None], b_dpw.reshape(nk, ns)], axis=1).ravel()
        k_time = np.concatenate([(1.0 / self.vf[star])[:, None], np.zeros((nk, ns))], axis=1).ravel()   # u per work
        k_pos = np.repeat(np.arange(nk), ns + 1)
        best_v, best = self.tail, None
        for k0 in range(0, nk, chunk):
            if self.t0[k0] >= best_v:
                break
            k1 = min(nk, k0 + chunk)
            Ob, Ok = k1 * ns, k1 * (ns + 1)                     # only offers of intervals < k1 can help
            # stable: K's vertex offer sorts before an equally priced segment above it
            offered = np.concatenate([b_unit[:Ob], k_unit[:Ok]])
            order = np.argsort(offered, kind="stable")
            units = offered[order]
            caps = np.concatenate([b_cap[:Ob], k_cap[:Ok]])[order]
            pos = np.concatenate([b_pos[:Ob], k_pos[:Ok]])[order]
            final = order >= Ob
            K = np.arange(k0, k1)[:, None]
            w = caps[None, :] * np.where(final[None, :], pos[None, :] == K, pos[None, :] < K)
            cum = np.cumsum(w, axis=1)
            take = np.minimum(w, np.maximum(0.0, 1.0 - (cum - w)))
            val = np.where(cum[:, -1] >= 1.0 - 1e-12, self.t0[k0:k1] + take @ units, np.inf)
            b = int(np.argmin(val))
            if val[b] < best_v:
                dpw = np.concatenate([b_dpw[:Ob], k_dpw[:Ok]])[order]
                per_work = np.concatenate([np.zeros(Ob), k_time[:Ok]])[order]
                dev = np.zeros(nk)
                np.add.at(dev, pos, take[b] * dpw)
                best_v, best = float(val[b]), (float(self.t0[k0 + b] + take[b] @ per_work), dev)
        return (best_v, self.tail, None) if best is None else (best_v, *best)


@dataclass
class LagrangianBound:
    avg_jct_s: float          # the bound: the best L(prices) found
    lp_avg_jct_s: float       # the LP bound on the same intervals (its prices start the search; with `warm`: the warm one's)
    master_avg_jct_s: float   # the last restricted master LP (its gap to the bound: how far from converged)
    iterations: int
    interval_s: float
    solve_s: float
    starts: np.ndarray | None = None   # interval starts
    prices: tuple[np.ndarray, np.ndarray] | None = None   # the best prices found, per device- and CPU-second
    master_completion: np.ndarray | None = None   # each job's expected completion in the last master LP
                                                  # (where the relaxation's schedule finishes it: a diagnostic)


def lagrangian_bound(jobs: Sequence[Job], step_time: StepTimeFn, cfg: SimConfig, interval_s: float = 300.0,
                     iterations: int = 200, tolerance: float = 2e-3, smoothing: float = 0.8,
                     lp: LPBound | None = None, warm: LagrangianBound | None = None) -> LagrangianBound:
    """Average-JCT lower bound that charges every job its true completion time, not its mean progress time.

    The LP relaxation (`lp_bound`) bounds C_j by M_j + p_j/2, which is loose for a job that runs slower than
    its fastest: run on 8 devices for 40000 s, its mean progress is only halfway. Here the capacity rows
    (devices and CPUs per interval) are priced instead (Lagrangian relaxation): for prices λ ≥ 0,

        L(λ) = Σ_j min over job j's own schedules of [C_j + λ · its device and CPU seconds] − λ · capacity

    is below Σ_j C_j of every schedule the simulator can run (each job's part of it is one of its own
    schedules, and it stays within capacity), whatever λ. Each job's minimum is `_JobPricer`: exact
    completion accounting, the speed-up envelope for speed, solved exactly. The prices start at the LP's
    optimal duals on the same intervals and are improved by column generation: a master LP over the
    schedules priced so far (convex combinations per job within capacity) proposes prices, smoothed
    towards the best ones so far (Wentges); it stops when the master's average JCT is within `tolerance`
    (relative) of the bound's, or after `iterations`. Because the pricing is exact, the best L rises
    towards the master as it converges (the master alone is no bound: it only has some columns). The
    bound is the best L found (valid at any stopping point), or the LP bound where that is higher.

    `warm`: a bound on coarser intervals (a multiple of `interval_s`) to start from instead of the LP: its
    horizon and its best prices, each fine interval taking its coarse interval's price per second. On the
    finer grid every job's minimum at those prices is at least the coarse one (a fine schedule, merged, is a
    coarse one: Jensen for the work, and its completion is no earlier than the coarse accounting says),
    so the search starts at or above the warm bound, which also stands in for the LP as the floor.
    """
    import time

    import scipy.sparse as sp
    from scipy.optimize import linprog

    t0 = time.perf_counter()
    if warm is not None:
        ratio = warm.interval_s / interval_s
        if warm.starts is None or warm.prices is None or abs(ratio - round(ratio)) > 1e-9 or ratio < 1:
            raise ValueError(f"warm start on {warm.interval_s} s intervals: needs its prices and a multiple of "
                             f"interval_s={interval_s}")
        starts = warm.starts[0] + interval_s * np.arange(round(len(warm.starts) * ratio))
        coarse = np.searchsorted(warm.starts, starts, side="right") - 1
        floor, lp_avg = warm.avg_jct_s, warm.lp_avg_jct_s
        lam, mu = warm.prices[0][coarse], warm.prices[1][coarse]
    else:
        if lp is None or lp.interval_s != interval_s:
            lp = lp_bound(jobs, step_time, cfg, interval_s=interval_s)
        starts, floor, lp_avg = lp.starts, lp.avg_jct_s, lp.avg_jct_s
        lam, mu = lp.prices[0] / interval_s, lp.prices[1] / interval_s   # per device-second and CPU-second
    cluster, dt = cfg.cluster, interval_s
    nk, J = len(starts), len(jobs)
    release = [first_slot(j.arrival, cfg.slot_s) * cfg.slot_s + cfg.restart_s for j in jobs]
    pricers = [_JobPricer(speedup_rates(j, step_time, cluster), j.cpus_per_replica, r, starts, dt)
               for j, r in zip(jobs, release)]
    cpu = np.array([j.cpus_per_replica for j in jobs], float)
    arrivals = float(sum(j.arrival for j in jobs))
    cap = np.concatenate([np.full(nk, cluster.gpus * dt), np.full(nk, cluster.cpus * dt)])
    # columns: every job may complete after the horizon without using any capacity (keeps the master feasible)
    col_job, col_c = list(range(J)), [p.tail for p in pricers]
    rows: list[np.ndarray] = [np.zeros(0, int)] * J       # device-seconds per interval of each column (sparse)
    vals: list[np.ndarray] = [np.zeros(0)] * J
    best, best_lam, best_mu, master, it, completion = -np.inf, lam, mu, np.inf, 0, None
    for it in range(1, iterations + 1):
        total = 0.0
        for j, p in enumerate(pricers):
            v, c, dev = p.price(lam, mu)
            total += v
            nz = np.zeros(0, int) if dev is None else np.nonzero(dev)[0]
            col_job.append(j), col_c.append(c), rows.append(p.ks[nz]), vals.append(dev[nz] if len(nz) else np.zeros(0))
        L = total - float(np.sum(lam * cap[:nk]) + np.sum(mu * cap[nk:]))
        if L > best:
            best, best_lam, best_mu = L, lam, mu
        counts = [len(r) for r in rows]
        D = sp.csc_matrix((np.concatenate(vals), np.concatenate(rows), np.concatenate([[0], np.cumsum(counts)])),
                          shape=(nk, len(col_job)))
        A_ub = sp.vstack([D, D @ sp.diags(cpu[col_job])]).tocsr()
        A_eq = sp.csr_matrix((np.ones(len(col_job)), (col_job, np.arange(len(col_job)))), shape=(J, len(col_job)))
        res = linprog(np.array(col_c), A_ub=A_ub, b_ub=cap, A_eq=A_eq, b_eq=np.ones(J), bounds=(0, None), method="highs")
        if res.status != 0:
            raise RuntimeError(f"lagrangian_bound: HiGHS failed on the master: {res.message}")
        master = float(res.fun)
        completion = np.bincount(col_job, weights=res.x * np.array(col_c), minlength=J)
        if master - best <= tolerance * (master - arrivals):
            break
        duals = -res.ineqlin.marginals
        lam = smoothing * best_lam + (1 - smoothing) * duals[:nk]
        mu = smoothing * best_mu + (1 - smoothing) * duals[nk:]
    return LagrangianBound(avg_jct_s=(max(best, floor * J + arrivals) - arrivals) / J,
                           lp_avg_jct_s=lp_avg, master_avg_jct_s=(master - arrivals) / J, iterations=it,
                           interval_s=dt, solve_s=time.perf_counter() - t0, starts=starts, prices=(best_lam, best_mu),
                           master_completion=completion)
