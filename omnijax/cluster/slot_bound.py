"""A lower bound on the average JCT that keeps what the LP and Lagrangian bounds relax: whole devices per
slot, a restart for every (re)start and resize, and devices held to the end of the slot a job finishes in.

A mixed-integer program over the simulator's own slots (HiGHS branch and bound). For small workloads
only: its size grows with jobs × slots × sizes, so `bench cluster` runs it where `milp_time_s` asks, on
the few-job, few-node instances (`limit`, `applications`, `sim.num_nodes`) where it measures how much of
a scheduler's gap to the relaxations is the relaxations' own.

Why it is a bound. Take any schedule the simulator runs. Per slot t a job holds an integer count n (the
variable z[j,t,n], one size a slot) for the whole slot, and Σ n over jobs is within the cluster's devices
and CPUs. A job whose count changed since the previous slot (or that starts or resumes) was re-placed, so
it paid `restart_s` of no progress (the c variables: c ≥ z − z_prev per size); a job whose count did not
change may still have been moved, which only costs more. Running w ≤ L seconds of the slot, its progress
there is at most (w − restart)·ρ_n, ρ_n its fraction per second on n devices on the fastest node count
the cluster allows. It holds devices only while active (u[j,t] = 1 from its first slot until the slot it
completes in, monotone). It completes at L·f + τ, f the final slot: τ, the time into that slot, is at
least the seconds it ran there, and at least the work left at the slot's start over its fastest rate.
A job still active at the horizon T completes no earlier than L·T plus its work left over its fastest
rate (u[j,T], a virtual slot with no capacity row), so the horizon only loosens the bound, never
invalidates it. Sizes that are no faster than a smaller size are dropped: replacing them by the smaller
one keeps every job's progress and frees devices. Two more rows hold for every schedule and only cut
the relaxation HiGHS branches on: a job with work left after slot t is active in t + 1, and none
completes before its first slot's start + restart + its time alone at its fastest. Every schedule's
values satisfy every row, so the program's optimum is at most its average JCT; HiGHS's dual bound, valid
at any time limit, is at most the optimum, and that is what `avg_jct_s` reports.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from omnijax.cluster.bounds import speedup_rates
from omnijax.cluster.jobs import Job
from omnijax.cluster.simulator import SimConfig, StepTimeFn, first_slot


@dataclass
class SlotBound:
    avg_jct_s: float               # the bound: HiGHS's dual bound (valid whether or not it proved optimality)
    incumbent_avg_jct_s: float     # the best schedule of the program found (not a simulator run: no placement)
    optimal: bool                  # the gap closed within HiGHS's tolerance
    gap: float                     # relative gap between incumbent and bound (0 when optimal)
    slots: int                     # horizon in slots
    variables: int
    integers: int
    solve_s: float
    nodes: int                     # branch-and-bound nodes explored


def useful_sizes(rates: np.ndarray) -> list[int]:
    """Device counts that are faster than every smaller count (`rates` indexed by devices, rates[0] = 0)."""
    out, best = [], 0.0
    for n in range(1, len(rates)):
        if rates[n] > best * (1 + 1e-12):
            out.append(n)
            best = rates[n]
    return out


def slot_bound(jobs: Sequence[Job], step_time: StepTimeFn, cfg: SimConfig, horizon_s: float | None = None,
               time_limit_s: float = 60.0, rel_gap: float = 1e-4, floor: float | None = None,
               node_limit: int | None = None) -> SlotBound:
    """Average-JCT lower bound from the slot-exact mixed-integer program (module docstring).

    `horizon_s`: seconds after the first arrival's slot that the program schedules in slot by slot (default:
    every job one after another at its fastest size, after the last arrival; jobs still running then are
    charged their work left at their fastest rate). `time_limit_s`: HiGHS's limit; the bound is valid
    whenever it stops, tighter the longer it runs. `node_limit`: a cap on branch-and-bound nodes instead, which
    (with `time_limit_s=math.inf`) makes the result the same on any machine under any load. `floor`: an average JCT already known to bound every schedule
    (the Lagrangian bound, say), added as a row on the objective: it prunes the search, and cuts off no
    schedule's values (a schedule's τ may be raised to meet its own JCT, which is at least the floor)."""
    import scipy.sparse as sp
    from scipy.optimize import Bounds, LinearConstraint, milp

    if not jobs:
        raise ValueError("slot_bound needs at least one job")
    L, R = float(cfg.slot_s), float(cfg.restart_s)
    if R > L:
        raise ValueError(f"slot_bound needs restart_s <= slot_s (got {R} > {L})")
    if cfg.resize_restart_s is not None and cfg.resize_restart_s != R:
        raise ValueError("slot_bound charges restart_s to every restart: leave sim.resize_restart_s unset")
    cluster = cfg.cluster
    t0 = time.perf_counter()
    first = np.array([first_slot(j.arrival, L) for j in jobs])          # first slot each job may run in
    rates = [speedup_rates(j, step_time, cluster) for j in jobs]
    rho = np.array([r.max() for r in rates])
    if horizon_s is None:
        horizon_s = (first.max() - first.min()) * L + float(np.sum(1.0 / rho)) + L
    base = int(first.min())
    T = base + max(1, math.ceil(horizon_s / L))                          # slots base..T-1 are scheduled
    if np.any(first >= T):
        raise ValueError(f"horizon_s={horizon_s}: ends before a job's first slot")

    lo, hi, integ, cost = [], [], [], []       # per column

    def var(lb, ub, integer, c=0.0) -> int:
        lo.append(lb), hi.append(ub), integ.append(1 if integer else 0), cost.append(c)
        return len(lo) - 1

    rows, cols, vals, rlo, rhi = [], [], [], [], []
    nrow = 0

    def row(entries, lb, ub) -> None:
        nonlocal nrow
        for col, v in entries:
            rows.append(nrow), cols.append(col), vals.append(v)
        rlo.append(lb), rhi.append(ub)
        nrow += 1

    held: dict[int, list[tuple[int, float, float]]] = {}     # slot -> (z column, devices, cpus)
    objective: list[tuple[list[int], int]] = []              # per job: its u columns and τ
    const = 0.0
    for j, job in enumerate(jobs):
        sizes = useful_sizes(rates[j])
        a = int(first[j])
        u = [var(1.0 if t == a else 0.0, 1.0, True, L) for t in range(a, T + 1)]
        tau = var(0.0, np.inf, False, 1.0)
        const += L * (a - 1) - job.arrival          # C_j = L·(a + Σu − 1) + τ
        g_all, q_all = [], []
        prev = {n: None for n in sizes}
        for i, t in enumerate(range(a, T)):
            z = {n: var(0.0, 1.0, True) for n in sizes}
            c = {n: var(0.0, 1.0, False) for n in sizes}
            w = {n: var(0.0, L, False) for n in sizes}        # seconds held in the slot
            g = var(0.0, np.inf, False)
            q = var(0.0, np.inf, False)
            g_all.append(g), q_all.append(q)
            row([(z[n], 1.0) for n in sizes] + [(u[i], -1.0)], -np.inf, 0.0)        # devices only while active
            for n in sizes:                                                         # restart on a change
                row([(c[n], 1.0), (z[n], -1.0)] + ([(prev[n], 1.0)] if prev[n] is not None else []), 0.0, np.inf)
                held.setdefault(t, []).append((z[n], float(n), float(n * job.cpus_per_replica)))
            for n in sizes:
                row([(w[n], 1.0), (z[n], -L)], -np.inf, 0.0)
            row([(g, 1.0)] + [(w[n], -rates[j][n]) for n in sizes] + [(c[n], rates[j][n] * R) for n in sizes],
                -np.inf, 0.0)                                                       # progress of the slot
            # in the final slot (u[t] − u[t+1] = 1), τ covers the seconds the job ran there
            row([(tau, 1.0)] + [(w[n], -1.0) for n in sizes] + [(u[i], -L), (u[i + 1], L)], -L, np.inf)
            row([(q, 1.0), (g, -1.0)], -np.inf, 0.0)                                # q: work before the final slot
            row([(q, 1.0), (u[i + 1], -rho[j] * L)], -np.inf, 0.0)
            row([(u[i + 1], 1.0), (u[i], -1.0)], -np.inf, 0.0)                      # active is monotone
            row([(u[i + 1], 1.0)] + [(gg, 1.0) for gg in g_all], 1.0, np.inf)        # work left: still active
            prev = z
        row([(g, 1.0) for g in g_all] + [(u[-1], 1.0)], 1.0, np.inf)               # done, or active past T
        row([(tau, rho[j])] + [(q, 1.0) for q in q_all], 1.0, np.inf)               # τ ≥ (1 − W_before)/ρ
        # alone from its first slot: C_j ≥ L·a + restart + 1/ρ (implied by integral solutions; cuts the relaxation)
        row([(x, L) for x in u] + [(tau, 1.0)], L + R + 1.0 / rho[j], np.inf)
        objective.append((u, tau))
    for t, entries in held.items():
        row([(z, d) for z, d, _ in entries], -np.inf, float(cluster.gpus))
        row([(z, c) for z, _, c in entries], -np.inf, float(cluster.cpus))

    if floor is not None:        # Σ_j C_j ≥ J·(floor + mean arrival): a bound known to hold (see the docstring)
        row([(x, L) for us, tau in objective for x in us] + [(tau, 1.0) for _, tau in objective],
            len(jobs) * floor - const, np.inf)
    A = sp.csr_matrix((vals, (rows, cols)), shape=(nrow, len(lo)))
    J = len(jobs)
    res = milp(np.array(cost) / J, integrality=np.array(integ), bounds=Bounds(np.array(lo), np.array(hi)),
               constraints=LinearConstraint(A, np.array(rlo), np.array(rhi)),
               options={"time_limit": time_limit_s, "mip_rel_gap": rel_gap, "disp": False,
                        **({"node_limit": int(node_limit)} if node_limit is not None else {})})
    if res.status not in (0, 1) or getattr(res, "mip_dual_bound", None) is None:
        raise RuntimeError(f"slot_bound: HiGHS failed: {res.message}")
    bound = float(res.mip_dual_bound) + const / J
    incumbent = float(res.fun) + const / J if res.x is not None else math.inf
    return SlotBound(avg_jct_s=bound, incumbent_avg_jct_s=incumbent, optimal=res.status == 0,
                     gap=float(res.mip_gap) if res.x is not None else math.inf, slots=T - base,
                     variables=len(lo), integers=int(sum(integ)), solve_s=time.perf_counter() - t0,
                     nodes=int(getattr(res, "mip_node_count", 0) or 0))
