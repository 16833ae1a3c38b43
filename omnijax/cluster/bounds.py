"""Lower bounds on the average JCT any scheduler can reach in the simulator.

Three bounds, all computed from the hidden truth (job lengths and measured step times), so they are
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
    """One job's best schedule when devices and CPUs cost given prices per second in each interval.

    A schedule picks the interval K it completes in and buys work in intervals up to K along its
    speed-up envelope f (segment s of f turns device-seconds into work at slope a_s, at most width_s ×
    the seconds the job may run there per interval). Its completion is at least the start of K (or the
    release) plus the time u it runs in K. Work W done in K with D device-seconds there obeys
    W ≤ u·f(D/u) ≤ a·D + b·u for every line (a, b) above f (f is concave), so u ≥ (W − a·D)/b for each
    line with b > 0; the flat line (0, ρ) gives u ≥ W/ρ. For one line and one K the cheapest schedule
    is a fractional knapsack: buy the offers of intervals before K at price/a_s per unit of work and
    those of K at price/a_s + (1 − a/a_s)/b, cheapest first, until the work is done (and every offer of
    negative cost: a relaxation that may over-cover, so that a true schedule's image is always in it). Since
    min over schedules of the max over lines ≥ the max over lines of each line's minimum, the job's
    value is min over K of max over lines of those knapsacks: a lower bound on its exact minimum, which
    is all the Lagrangian bound needs. Completing after the horizon costs at least its end."""

    def __init__(self, rates: np.ndarray, cpus: float, release: float, starts: np.ndarray, dt: float):
        hull = envelope_vertices(rates)
        widths = np.diff(hull).astype(float)
        slopes = np.diff(rates[hull]) / widths
        keep = slopes > 0
        widths, slopes = widths[keep], slopes[keep]
        self.cpus, self.rho, self.release, self.ns = cpus, float(rates.max()), release, len(slopes)
        self.lines = [(a, b) for a, b in concave_cuts(rates) if b > 1e-15 * self.rho]   # includes (0, ρ)
        run = np.clip(starts + dt - release, 0.0, dt)
        self.ks = np.nonzero(run > 0)[0]                       # intervals the job may run in
        self.t0 = np.maximum(starts[self.ks], release)         # completion in interval K is after this
        self.pos = np.repeat(np.arange(len(self.ks)), self.ns)   # offers: interval position x segment
        self.cap = (slopes * widths * run[self.ks][:, None]).ravel()   # work each offer can buy
        self.dpw = np.tile(1.0 / slopes, len(self.ks))        # device-seconds per unit of work
        self.tail = max(starts[-1] + dt, release + 1.0 / self.rho)   # completing after the horizon

    def _knapsack(self, unit: np.ndarray, timed: np.ndarray, k0: int, k1: int, O: int):
        """Per completion interval K in [k0, k1): the cheapest cover of the work with offers of intervals
        before K at `unit` and of K at `unit + timed`; returns (values, and what rebuilds a solution)."""
        units = np.concatenate([unit[:O], unit[:O] + timed[:O]])
        order = np.argsort(units, kind="stable")
        units, final = units[order], order >= O
        caps, pos = np.tile(self.cap[:O], 2)[order], np.tile(self.pos[:O], 2)[order]
        K = np.arange(k0, k1)[:, None]
        w = caps[None, :] * np.where(final[None, :], pos[None, :] == K, pos[None, :] < K)
        cum = np.cumsum(w, axis=1)
        idx = np.argmax(cum >= 1.0 - 1e-12, axis=1)
        w_at = np.take_along_axis(w, idx[:, None], 1)[:, 0]
        before = np.take_along_axis(cum, idx[:, None], 1)[:, 0] - w_at
        cost = np.take_along_axis(np.cumsum(w * units[None, :], axis=1), idx[:, None], 1)[:, 0] - w_at * units[idx]
        cost = cost + units[idx] * (1.0 - before)
        # offers of negative cost (time charges of lines steeper than their segment) are all worth taking,
        # even past the work needed: the relaxation may over-cover, so stopping at 1 would not be a minimum
        neg = units < 0
        over = (w[:, neg].sum(axis=1) >= 1.0) & np.any(neg)
        cost = np.where(over, (w[:, neg] * units[neg][None, :]).sum(axis=1), cost)
        val = np.where(cum[:, -1] >= 1.0 - 1e-12, self.t0[k0:k1] + cost, np.inf)
        return val, (w, cum, order, final, pos)

    def price(self, lam: np.ndarray, mu: np.ndarray, chunk: int = 16) -> tuple[float, float, np.ndarray | None]:
        """(a lower bound on min over schedules of C + priced device and CPU seconds, a schedule's C, its
        device-seconds per interval in `ks` (None: completes after the horizon)). Completion intervals
        are tried in time order, in chunks, until their start alone exceeds the best value found."""
        unit = ((lam + mu * self.cpus)[self.ks])[self.pos] * self.dpw
        best_v, best = self.tail, None
        nk = len(self.ks)
        for k0 in range(0, nk, chunk):
            if self.t0[k0] >= best_v:
                break
            k1 = min(nk, k0 + chunk)
            O = k1 * self.ns                                   # only offers of intervals < k1 can help
            per_line = [self._knapsack(unit, (1.0 - a * self.dpw) / b, k0, k1, O) for a, b in self.lines]
            vals = np.array([v for v, _ in per_line])
            line = np.argmax(vals, axis=0)
            val = vals[line, np.arange(k1 - k0)]
            b = int(np.argmin(val))
            if val[b] < best_v:
                w, cum, order, final, pos = per_line[line[b]][1]
                take = np.minimum(w[b], np.maximum(0.0, 1.0 - (cum[b] - w[b])))
                dpw = np.tile(self.dpw[:O], 2)[order]
                dev = np.zeros(nk)
                np.add.at(dev, pos, take * dpw)
                work, devs = float(np.sum(take * final)), float(np.sum(take * final * dpw))
                c = self.t0[k0 + b] + max(max((work - a * devs) / bb for a, bb in self.lines), 0.0)
                best_v, best = float(val[b]), (float(c), dev)
        return (best_v, self.tail, None) if best is None else (best_v, *best)


@dataclass
class LagrangianBound:
    avg_jct_s: float          # the bound: the best L(prices) found
    lp_avg_jct_s: float       # the LP bound on the same intervals (its prices start the search)
    master_avg_jct_s: float   # the last restricted master LP (its gap to the bound: how far from converged)
    iterations: int
    interval_s: float
    solve_s: float


def lagrangian_bound(jobs: Sequence[Job], step_time: StepTimeFn, cfg: SimConfig, interval_s: float = 300.0,
                     iterations: int = 20, tolerance: float = 2e-3, smoothing: float = 0.9,
                     lp: LPBound | None = None) -> LagrangianBound:
    """Average-JCT lower bound that charges every job its true completion time, not its mean progress time.

    The LP relaxation (`lp_bound`) bounds C_j by M_j + p_j/2, which is loose for a job that runs slower than
    its fastest: run on 8 devices for 40000 s, its mean progress is only halfway. Here the capacity rows
    (devices and CPUs per interval) are priced instead (Lagrangian relaxation): for prices λ ≥ 0,

        L(λ) = Σ_j min over job j's own schedules of [C_j + λ · its device and CPU seconds] − λ · capacity

    is below Σ_j C_j of every schedule the simulator can run (each job's part of it is one of its own
    schedules, and it stays within capacity), whatever λ. Each job's minimum is `_JobPricer`: exact
    completion accounting, the speed-up envelope for speed. The prices start at the LP's optimal duals
    on the same intervals and are improved by column generation: a master LP over the schedules priced
    so far (convex combinations per job within capacity) proposes prices, smoothed towards the best
    ones so far; it stops when the master is within `tolerance` of the best L or after `iterations`.
    The bound is the best L found (valid at any stopping point), or the LP bound where that is higher.
    """
    import time

    import scipy.sparse as sp
    from scipy.optimize import linprog

    t0 = time.perf_counter()
    if lp is None or lp.interval_s != interval_s:
        lp = lp_bound(jobs, step_time, cfg, interval_s=interval_s)
    cluster, dt, starts = cfg.cluster, interval_s, lp.starts
    nk, J = len(starts), len(jobs)
    release = [math.ceil(j.arrival / cfg.slot_s) * cfg.slot_s + cfg.restart_s for j in jobs]
    pricers = [_JobPricer(speedup_rates(j, step_time, cluster), j.cpus_per_replica, r, starts, dt)
               for j, r in zip(jobs, release)]
    cpu = np.array([j.cpus_per_replica for j in jobs], float)
    arrivals = float(sum(j.arrival for j in jobs))
    cap = np.concatenate([np.full(nk, cluster.gpus * dt), np.full(nk, cluster.cpus * dt)])
    # columns: every job may complete after the horizon without using any capacity (keeps the master feasible)
    col_job, col_c, col_dev = list(range(J)), [p.tail for p in pricers], [np.zeros(nk) for _ in pricers]
    lam, mu = lp.prices[0] / dt, lp.prices[1] / dt           # per device-second and CPU-second
    best, best_lam, best_mu, master, it = -np.inf, lam, mu, np.inf, 0
    for it in range(1, iterations + 1):
        total = 0.0
        for j, p in enumerate(pricers):
            v, c, dev = p.price(lam, mu)
            total += v
            full = np.zeros(nk)
            if dev is not None:
                full[p.ks] = dev
            col_job.append(j), col_c.append(c), col_dev.append(full)
        L = total - float(np.sum(lam * cap[:nk]) + np.sum(mu * cap[nk:]))
        if L > best:
            best, best_lam, best_mu = L, lam, mu
        D = sp.csc_matrix(np.array(col_dev).T)
        A_ub = sp.vstack([D, D @ sp.diags(cpu[col_job])]).tocsr()
        A_eq = sp.csr_matrix((np.ones(len(col_job)), (col_job, np.arange(len(col_job)))), shape=(J, len(col_job)))
        res = linprog(np.array(col_c), A_ub=A_ub, b_ub=cap, A_eq=A_eq, b_eq=np.ones(J), bounds=(0, None), method="highs")
        if res.status != 0:
            raise RuntimeError(f"lagrangian_bound: HiGHS failed on the master: {res.message}")
        master = float(res.fun)
        if master - best <= tolerance * abs(master):
            break
        duals = -res.ineqlin.marginals
        lam = smoothing * best_lam + (1 - smoothing) * duals[:nk]
        mu = smoothing * best_mu + (1 - smoothing) * duals[nk:]
    return LagrangianBound(avg_jct_s=(max(best, lp.avg_jct_s * J + arrivals) - arrivals) / J,
                           lp_avg_jct_s=lp.avg_jct_s, master_avg_jct_s=(master - arrivals) / J, iterations=it,
                           interval_s=dt, solve_s=time.perf_counter() - t0)
