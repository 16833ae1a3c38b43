"""Schedulers: each decides, every slot, how many devices every active job gets.

One interface: `allocate(now, jobs, cluster) -> {job name: devices}` (pure with respect to the jobs it is
given; the simulator or executor applies it) and a `pack` flag choosing the placement policy.
Baselines honour the user's requested size (FIFO, DRF, Tiresias); the fitted-model scheduler resizes
jobs from their fitted loss and speed models.
"""
from __future__ import annotations

import copy
import heapq
import math
from typing import Sequence

import numpy as np

from omnijax.cluster.jobs import Cluster, Job, cap_for, nodes_for, place, place_one


class Scheduler:
    name = "base"
    pack = False      # placement: pack each job on few nodes (True) or first fit in node order

    def allocate(self, now: float, jobs: Sequence[Job], cluster: Cluster) -> dict[str, int]:
        raise NotImplementedError

    def job_finished(self, job: Job) -> None:
        """Hook: a job completed (schedulers may learn priors from it)."""

    def reset(self) -> None:
        """Forget per-run state (learned priors, plan times); keep configuration and trained weights."""

    def fresh(self) -> "Scheduler":
        """An independent copy ready for a new run."""
        other = copy.deepcopy(self)
        other.reset()
        return other


def _requested(job: Job, cluster: Cluster) -> int:
    return max(1, min(job.requested, cluster.gpus, job.max_replicas))


class FIFO(Scheduler):
    """Arrival order, each job gets exactly what it asked for; strict (no backfilling, no preemption)."""
    name = "fifo"

    def allocate(self, now, jobs, cluster):
        alloc = {j.name: 0 for j in jobs}
        gpus, cpus = cluster.gpus, cluster.cpus
        for j in sorted(jobs, key=lambda j: (j.allocation == 0, j.arrival, j.name)):
            n = j.allocation or _requested(j, cluster)
            if n > gpus or n * j.cpus_per_replica > cpus:
                if j.allocation == 0:
                    break      # head of line blocks everyone behind it
                continue
            alloc[j.name] = n
            gpus -= n
            cpus -= n * j.cpus_per_replica
        return alloc


class DRF(Scheduler):
    """Dominant resource fairness over (GPU, CPU) by progressive filling, capped at each job's request.

    Preemptive: shares are recomputed every slot. A job's replicas are handed out one at a time to the
    job with the lowest dominant share (ties: earlier arrival).
    """
    name = "drf"

    def allocate(self, now, jobs, cluster):
        alloc = {j.name: 0 for j in jobs}
        gpus, cpus = cluster.gpus, cluster.cpus
        heap = [(0.0, j.arrival, j.name, j) for j in jobs]
        heapq.heapify(heap)
        while heap and gpus > 0:
            share, arr, name, j = heapq.heappop(heap)
            if alloc[name] >= _requested(j, cluster) or j.cpus_per_replica > cpus:
                continue
            alloc[name] += 1
            gpus -= 1
            cpus -= j.cpus_per_replica
            dom = max(alloc[name] / cluster.gpus, alloc[name] * j.cpus_per_replica / cluster.cpus)
            heapq.heappush(heap, (dom, arr, name, j))
        return alloc


class Tiresias(Scheduler):
    """Discretised two-dimensional least-attained-service (Tiresias 2D-LAS), gang-scheduled at request.

    Jobs sit in priority queues by attained device-seconds (thresholds `queues_s`); higher queues first,
    FIFO inside a queue; lower-priority jobs are preempted. A job that waited longer than `promote` times
    its last run is moved back to the top queue (starvation guard). Jobs that do not fit are skipped
    (backfilling), as in Tiresias.
    """
    name = "tiresias"

    def __init__(self, queues_s: Sequence[float] = (3600.0, 36000.0), promote: float = 8.0):
        self.queues_s = tuple(queues_s)
        self.promote = promote

    def queue(self, j: Job, now: float) -> int:
        if j.allocation == 0 and j.last_run > 0 and now - j.waiting_since > self.promote * j.last_run:
            return 0
        return sum(j.attained_service >= t for t in self.queues_s)

    def allocate(self, now, jobs, cluster):
        alloc = {j.name: 0 for j in jobs}
        gpus, cpus = cluster.gpus, cluster.cpus
        for j in sorted(jobs, key=lambda j: (self.queue(j, now), j.arrival, j.name)):
            n = _requested(j, cluster)
            if n <= gpus and n * j.cpus_per_replica <= cpus:
                alloc[j.name] = n
                gpus -= n
                cpus -= n * j.cpus_per_replica
        return alloc


def shadow_cost(remaining_s: np.ndarray, sizes: np.ndarray, behind: float, capacity: int,
                beta: float = 1.0) -> np.ndarray:
    """Cost of finishing a job at each size: its own remaining time R(n) plus the delay its device-seconds
    n·R(n) impose on the `behind` capacity-bound jobs ranked after it (each waits n·R(n)/capacity longer
    when the cluster is saturated), weighted by `beta`: R(n)·(1 + beta·behind·n/capacity)."""
    return remaining_s * (1.0 + beta * behind * np.asarray(sizes, dtype=float) / capacity)


class FittedModel(Scheduler):
    """Allocation from fitted models: shortest remaining work first, each job at the size that balances its
    own speed against the device-seconds it takes from the jobs behind it; with packing placement.

    Remaining time of job j on n devices: R_j(n) = remaining steps (from its fitted loss curve, or a
    prior before the curve has enough points) × step time at n devices on the nodes a packed placement
    spans (for the size it holds now: on the nodes it actually spans), plus `resize_penalty_s` if n differs
    from what the job holds now, so a resize has to pay for its checkpoint-restart and the re-placement churn
    it causes (a job may carry its own cost, `Job.resize_penalty_s`: PS jobs resized in place pay far less).
    Step times come from the job's NNLS speed model, or from the measurement itself where that configuration
    was measured (`measured`); sizes beyond `explore_factor` × the largest measured size are not offered
    (the fit extrapolates badly far out: the cross-node sync cost it cannot see yet makes it predict 2x too
    fast at 4x the profiled size), so a job grows by at most that factor per measurement.

    Objective "shadow_price" (default). Average JCT is the sum of completion times over the job count, and
    on a saturated cluster a device-second one job uses is a device-second every job that is still waiting
    for capacity gets later. So: rank jobs by remaining work min_n n·R_j(n), smallest first (SRPT on work; a
    running job is ranked `hysteresis` × its resize cost × its size ahead, so two near-equal jobs do not
    swap every slot), then in that order give each job the free size minimising
    R_j(n)·(1 + beta·K_j·n/C) (`shadow_cost`), K_j = the jobs ranked after j that are capacity-bound (did
    not get the size they would pick on an empty cluster), C = the cluster's devices. The last-ranked job
    (K = 0) runs as fast as it can on what is left; with many jobs bound behind it, a job takes an efficient
    size. K depends on the allocation, so the pass repeats (up to `shadow_iters`) from "every job behind is
    bound" until the bound set stops changing. Devices still free then go by the largest completion-rate
    gain (below). This is heSRPT's structure (Berg, Vesilo, Harchol-Balter 2020: SRPT order, shares that
    shrink with the number of jobs behind) for heterogeneous, measured speed-ups.
    Placement: the simulator packs each resized job on the fewest nodes it can, but kept jobs keep their
    nodes, so free devices fragment and a 2-device job may land on two nodes (for small-batch jobs slower than
    one device). The allocation is therefore run through `jobs.place`; a job it would spread over more nodes
    than needed is offered its sizes that pack on what is free (and its spread placement, at the step time
    measured or predicted for that many nodes) and takes the cheapest (`repair_placement` rounds); devices
    left free go to waiting jobs, one each, in rank order.

    Objective "completion_rate": devices go to the job with the largest gain per device 1/R_j(n') − 1/R_j(n),
    the increase of the rate at which jobs complete (by Little's law, average JCT = average jobs in system /
    arrival rate). A job may jump over sizes (the step to n' is the best average gain over all larger sizes),
    so a speed curve with a dip (one node fast, two nodes slow) does not trap it. Two passes: first only
    growth steps whose marginal efficiency (R(n)/R(n') − 1)/(n'/n − 1) is at least `min_efficiency`, then,
    with what is left, any positive gain (work conservation).

    Objective "remaining_time": gain = R_j(n) − R_j(n+1), the plain reduction of remaining time (every
    job first gets one device, shortest R_j(1) first), level by level.

    Prior before a loss fit exists (`prior`): "service" (default) — the geometric mean GPU-seconds
    finished jobs received, over the job's measured 1-device step time; "steps" — the geometric mean
    step count of finished jobs. With `prior_by_app` (default) a job whose application already has finished
    jobs takes the geometric mean step count of those instead: jobs of one application are far more alike
    than the whole mix (chosen on workloads-{0.5,1.5,2.0}: 2.2% lower average JCT on five of their files, lower
    on every one). All use only completed jobs, never the trace's lengths. An early fit is
    trusted up to `cap_factor` × the progress so far (None: 100 for "shadow_price", whose order needs the
    fitted lengths early, and 10, the older value, for the other objectives).

    A running job's rank key is at most `rank_freeze` × its key when it was last (re)placed (0: off). While an
    early fit is capped (`cap_factor` × progress), a job's estimated length grows a hundred times faster than
    it runs, so a running job soon looks longer than a similar one that waits; without the limit the two
    take turns, each turn a restart (two imagenet jobs on workloads/workload-6 swapped 32 devices every slot
    for half an hour). 2 was chosen on workloads-{0.5,1.5,2.0} (24 files; every value from 1.3 to 5 was within
    ±0.4% of no limit there).

    Hyper-parameters of "shadow_price" (`beta`, `cap_factor`, `hysteresis`) were chosen on
    workloads/workload-2..8 and workloads-realistic/workload-2..8; the bench reports workload-1 (held out).
    Those of "completion_rate" (`resize_penalty_s`, `min_efficiency`, `explore_factor`, `prior`) were chosen on
    workloads-{0.5,1.5,2.0}/workload-7. Running jobs are resized only every `replan_s` seconds; between
    re-plans, free devices go to waiting jobs and running jobs keep what they hold.
    """
    name = "fitted"
    pack = True

    def __init__(self, objective: str = "shadow_price", prior_steps: float = 3000.0,
                 resize_penalty_s: float = 300.0, min_gain: float = 0.0, replan_s: float = 0.0,
                 node_sizes: bool = True, measured: bool = True, explore_factor: float = 2.0,
                 min_efficiency: float = 0.35, prior: str = "service", prior_service_s: float = 3600.0,
                 beta: float = 2.0, cap_factor: float | None = None, hysteresis: float = 0.0,
                 shadow_iters: int = 4, repair_placement: int = 3, prior_by_app: bool = True,
                 rank_freeze: float = 2.0):
        if objective not in ("shadow_price", "completion_rate", "remaining_time"):
            raise ValueError(f"objective={objective!r}: must be 'shadow_price', 'completion_rate' or 'remaining_time'")
        if prior not in ("service", "steps"):
            raise ValueError(f"prior={prior!r}: must be 'service' or 'steps'")
        self.objective = objective
        self.prior_steps = prior_steps
        self.resize_penalty_s = resize_penalty_s
        self.min_gain = min_gain
        self.replan_s = replan_s
        self.node_sizes = node_sizes
        self.measured = measured
        self.explore_factor = explore_factor
        self.min_efficiency = min_efficiency
        self.prior = prior
        self.prior_service_s = prior_service_s
        self.beta = beta
        self.cap_factor = (100.0 if objective == "shadow_price" else 10.0) if cap_factor is None else cap_factor
        self.hysteresis = hysteresis
        self.shadow_iters = shadow_iters
        self.repair_placement = repair_placement
        self.prior_by_app = prior_by_app
        self.rank_freeze = rank_freeze
        self._placed_key: dict[str, tuple[float, float]] = {}
        self._last_plan = -math.inf
        self._finished_steps: list[float] = []
        self._finished_service: list[float] = []
        self._finished_by_app: dict[str, list[float]] = {}
        if objective == "remaining_time":
            self.name = "fitted_rt"

    def job_finished(self, job):
        self._finished_steps.append(job.progress)
        self._finished_service.append(job.attained_service)
        self._finished_by_app.setdefault(job.application, []).append(job.progress)
        self._placed_key.pop(job.name, None)

    def reset(self):
        self._finished_steps = []
        self._finished_service = []
        self._finished_by_app = {}
        self._last_plan = -math.inf
        self._placed_key = {}

    def _prior_total(self, j: Job) -> float:
        same = self._finished_by_app.get(j.application) if self.prior_by_app else None
        if same:
            return _geometric_mean(np.maximum(same, 1.0))
        if self.prior == "service":
            svc = self._finished_service
            prior_s = _geometric_mean(np.maximum(svc, 1e-3)) if svc else self.prior_service_s
            t1 = j.speed_model.predict(1, 1)
            if math.isfinite(t1):
                return max(prior_s / t1, 1.0)
        return _geometric_mean(self._finished_steps) if self._finished_steps else self.prior_steps

    def remaining_steps(self, j: Job) -> float:
        """Fitted steps-to-converge minus progress; the prior before the fit exists (at least twice the
        progress so far), and a cap of max(prior, `cap_factor` × progress) while an early fit is still nearly
        flat (a ≈ 0 would otherwise predict an astronomically long job)."""
        prior = self._prior_total(j)
        total = j.loss_model.total_steps()
        if total is None or not math.isfinite(total):
            total = max(prior, 2.0 * j.progress) if self.prior == "service" else prior
        total = min(total, max(prior, self.cap_factor * j.progress))
        return max(total - j.progress, 0.02 * max(total, j.progress), 1.0)

    def sizes(self, j: Job, cluster: Cluster) -> np.ndarray:
        """Device counts a job may hold: powers of two up to a node, then whole nodes (`node_sizes`),
        so that packed placements tile nodes and do not fragment; else every count up to the cap; at
        most `explore_factor` × the largest measured size (and the size it holds now)."""
        cap = cap_for(j, cluster)
        if not self.node_sizes:
            out = np.arange(1, cap + 1)
        else:
            gpn = cluster.gpus_per_node
            small = {1 << i for i in range(gpn.bit_length()) if (1 << i) <= gpn} | {gpn}
            out = np.array(sorted({s for s in small if s <= cap} | set(range(gpn, cap + 1, gpn))) or [1])
        top = j.speed_model.largest_observed
        if self.explore_factor and top:
            keep = (out <= self.explore_factor * top) | (out == j.allocation)
            out = out[keep] if keep.any() else out[:1]
        return out

    def penalty(self, j: Job) -> float:
        """Resize cost of `j`: its own (`Job.resize_penalty_s`, e.g. a cheap in-place PS resize) or the default."""
        return self.resize_penalty_s if j.resize_penalty_s is None else j.resize_penalty_s

    def remaining_times(self, j: Job, sizes: np.ndarray, cluster: Cluster,
                        nodes: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds to finish at each size (no resize penalty): on `nodes` nodes, by default the
        nodes a packed placement spans, and for the size the job holds now the nodes it actually spans."""
        sizes = np.asarray(sizes)
        if nodes is None:
            nodes = np.ceil(sizes / cluster.gpus_per_node)
            if j.allocation and j.placement:
                nodes = np.where(sizes == j.allocation, j.nodes, nodes)
        st = j.speed_model.predict_many(sizes, nodes, measured=self.measured)
        return self.remaining_steps(j) * st

    def gains(self, j: Job, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        """(sizes, gain per device of stepping from the previous size, 0 for the first, to each size)."""
        sizes = self.sizes(j, cluster)
        r = self.remaining_times(j, sizes, cluster) + self.penalty(j) * (sizes != j.allocation)
        steps = np.diff(np.concatenate([[0], sizes]))
        if self.objective != "remaining_time":
            return sizes, np.diff(np.concatenate([[0.0], 1.0 / r])) / steps
        g = np.empty(len(r))
        g[0] = -r[0]            # start: shortest first (ranked above every growth step, see allocate)
        g[1:] = (r[:-1] - r[1:]) / steps[1:]
        return sizes, g

    def _keep_running(self, now, jobs, alloc):
        """Between re-plans: running jobs keep their devices; returns (devices, cpus) they use and the
        jobs still to plan."""
        if now - self._last_plan >= self.replan_s:
            self._last_plan = now
            return 0, 0, list(jobs)
        used = cpu = 0
        for j in jobs:
            if j.allocation:
                alloc[j.name] = j.allocation
                used += j.allocation
                cpu += j.allocation * j.cpus_per_replica
        return used, cpu, [j for j in jobs if not j.allocation]

    def _table(self, jobs, cluster):
        """Per job: (sizes, R without, R with the resize penalty)."""
        table = {}
        for j in jobs:
            sizes = self.sizes(j, cluster)
            r = self.remaining_times(j, sizes, cluster)
            table[j.name] = (sizes, r, r + self.penalty(j) * (sizes != j.allocation))
        return table

    def _grow(self, jobs, table, held, alloc, free, efficient: bool) -> None:
        """Greedy growth by the largest completion-rate gain per device (from the size each job holds in
        this plan, `held`: an index into its sizes, −1 for none); `efficient` admits only steps whose
        marginal efficiency is at least `min_efficiency`. Updates alloc, held and free in place."""
        byname = {j.name: j for j in jobs}

        def best(name: str):
            sizes, r, rp = table[name]
            i = held[name]
            s0, rate0 = (0, 0.0) if i < 0 else (int(sizes[i]), 1.0 / rp[i])
            ok = (sizes > s0) & (sizes - s0 <= free["gpus"]) & ((sizes - s0) * byname[name].cpus_per_replica <= free["cpus"])
            if efficient and i >= 0:
                ok &= (r[i] / r - 1.0) >= self.min_efficiency * (sizes / s0 - 1.0)
            if not ok.any():
                return None
            g = np.where(ok, (1.0 / rp - rate0) / np.maximum(sizes - s0, 1), -np.inf)
            k = int(np.argmax(g))
            return (float(g[k]), k) if g[k] > self.min_gain else None

        heap = [(-b[0], j.arrival, j.name) for j in jobs for b in [best(j.name)] if b]
        heapq.heapify(heap)
        while heap and free["gpus"] > 0:
            neg, arr, name = heapq.heappop(heap)
            b = best(name)
            if b is None:
                continue
            if heap and b[0] < -heap[0][0]:      # stale key (less is free now): re-rank
                heapq.heappush(heap, (-b[0], arr, name))
                continue
            k = b[1]
            step = int(table[name][0][k]) - alloc[name]
            alloc[name] += step
            free["gpus"] -= step
            free["cpus"] -= step * byname[name].cpus_per_replica
            held[name] = k
            nb = best(name)
            if nb:
                heapq.heappush(heap, (-nb[0], arr, name))

    def allocate(self, now, jobs, cluster):
        if self.objective == "remaining_time":
            return self._allocate_levels(now, jobs, cluster)
        if self.objective == "shadow_price":
            return self._allocate_shadow(now, jobs, cluster)
        alloc = {j.name: 0 for j in jobs}
        used, cpu, jobs = self._keep_running(now, jobs, alloc)
        free = {"gpus": cluster.gpus - used, "cpus": cluster.cpus - cpu}
        table = self._table(jobs, cluster)
        held = {j.name: -1 for j in jobs}          # index into sizes of what the job holds in this plan
        for efficient in (True, False):
            self._grow(jobs, table, held, alloc, free, efficient)
        return alloc

    def _allocate_shadow(self, now, all_jobs, cluster):
        alloc = {j.name: 0 for j in all_jobs}
        used, cpu, jobs = self._keep_running(now, all_jobs, alloc)
        C = cluster.gpus
        table = self._table(jobs, cluster)
        work = {j.name: float(np.min(table[j.name][0] * table[j.name][1]))
                - self.hysteresis * self.penalty(j) * j.allocation for j in jobs}
        if self.rank_freeze:
            self._freeze(jobs, work)
        betas = self._adjust(now, all_jobs, jobs, table, work)
        order = sorted(jobs, key=lambda j: (work[j.name], j.arrival, j.name))
        n = len(order)
        bound = [True] * n                 # capacity-bound: got less than it would pick on an empty cluster
        tried: list[list[bool]] = []
        pick: dict[str, int] = {}
        behind: dict[str, float] = {}
        for _ in range(max(1, self.shadow_iters)):
            after = np.concatenate([np.cumsum(bound[::-1])[::-1][1:], [0]])   # bound jobs ranked after each
            gpus, cpus = C - used, cluster.cpus - cpu
            pick, now_bound = {}, [False] * n
            for i, j in enumerate(order):
                sizes, r, rp = table[j.name]
                behind[j.name] = float(after[i])
                cost = shadow_cost(rp, sizes, after[i], C, betas[j.name])
                ok = (sizes <= gpus) & (sizes * j.cpus_per_replica <= cpus)
                if not ok.any():
                    pick[j.name], now_bound[i] = -1, True
                    continue
                k = int(np.argmin(np.where(ok, cost, np.inf)))
                now_bound[i] = bool(sizes[k] < sizes[int(np.argmin(cost))])
                pick[j.name] = k
                gpus -= int(sizes[k])
                cpus -= int(sizes[k]) * j.cpus_per_replica
            if now_bound == bound or now_bound in tried:
                break
            tried.append(bound)
            bound = now_bound
        for j in jobs:
            if pick[j.name] >= 0:
                alloc[j.name] = int(table[j.name][0][pick[j.name]])
        free = {"gpus": C - sum(alloc.values()),
                "cpus": cluster.cpus - sum(alloc[j.name] * j.cpus_per_replica for j in all_jobs)}
        self._grow(jobs, table, dict(pick), alloc, free, efficient=False)
        if self.repair_placement:
            self._repair(all_jobs, order, behind, alloc, cluster, betas)
        return alloc

    def _freeze(self, jobs, work: dict[str, float]) -> None:
        """A running job's key is at most `rank_freeze` × its key when it was (re)placed."""
        for j in jobs:
            if not (j.allocation and j.timeline):
                continue
            since = j.timeline[-1][0]
            got = self._placed_key.get(j.name)
            if got is None or got[0] != since:
                self._placed_key[j.name] = got = (since, work[j.name])
            work[j.name] = min(work[j.name], self.rank_freeze * got[1])

    def _adjust(self, now: float, all_jobs, jobs, table: dict, work: dict[str, float]) -> dict[str, float]:
        """Hook of the shadow-price plan: may rescale the ranking keys `work` in place; returns each job's
        `beta`. The fitted model leaves the keys and uses one beta; the learned scheduler adjusts both."""
        return {j.name: self.beta for j in jobs}

    def _repair(self, all_jobs, order, behind, alloc, cluster, betas=None) -> None:
        """Re-size jobs that `jobs.place` would spread over more nodes than they need (see the class
        docstring), then hand devices still free to waiting jobs, one each, in rank order."""
        gpn, C = cluster.gpus_per_node, cluster.gpus
        current = {j.name: j.placement for j in all_jobs}

        def free_after(pl):
            free = [gpn] * cluster.num_nodes
            for counts in pl.values():
                for i, c in enumerate(counts):
                    free[i] -= c
            return free

        for _ in range(self.repair_placement):
            pl = place(alloc, current, cluster, pack=True)
            free = free_after(pl)
            changed = False
            for j in order:
                n = alloc[j.name]
                if n == 0:
                    continue
                counts = pl[j.name]
                if sum(1 for c in counts if c) <= nodes_for(n, cluster):
                    continue
                kept = tuple(counts) == tuple(j.placement)
                avail = [f + c for f, c in zip(free, counts)]
                steps = self.remaining_steps(j)
                options = []            # (cost, size, counts)
                sizes = self.sizes(j, cluster)
                for s in sorted(set(sizes[sizes <= n].tolist()) | {n}):
                    cnt = list(counts) if s == n else place_one(avail, s)
                    if cnt is None:
                        continue
                    m = sum(1 for c in cnt if c)
                    st = float(j.speed_model.predict_many(np.array([s]), np.array([m]), measured=self.measured)[0])
                    r = steps * st + (0.0 if s == n and kept else self.penalty(j))
                    beta = self.beta if betas is None else betas.get(j.name, self.beta)
                    options.append((float(shadow_cost(r, s, behind.get(j.name, 0.0), C, beta)), s, cnt))
                cost, s, cnt = min(options, key=lambda o: (o[0], -o[1]))
                if s != n:
                    alloc[j.name] = s
                    free = [a - c for a, c in zip(avail, cnt)]
                    changed = True
            if not changed:
                break
        free = free_after(place(alloc, current, cluster, pack=True))
        cpus = cluster.cpus - sum(alloc[j.name] * j.cpus_per_replica for j in all_jobs)
        for j in order:
            if alloc[j.name] == 0 and max(free) >= 1 and j.cpus_per_replica <= cpus:
                cnt = place_one(free, 1)
                alloc[j.name] = 1
                cpus -= j.cpus_per_replica
                free = [f - c for f, c in zip(free, cnt)]

    def _allocate_levels(self, now, jobs, cluster):
        """Level-by-level greedy ("remaining_time"): every job starts before any grows."""
        alloc = {j.name: 0 for j in jobs}
        used, cpu, jobs = self._keep_running(now, jobs, alloc)
        gpus, cpus = cluster.gpus - used, cluster.cpus - cpu
        table = {j.name: self.gains(j, cluster) for j in jobs}
        level = {j.name: 0 for j in jobs}
        heap = [(-1, -table[j.name][1][0], j.arrival, j.name, j) for j in jobs]
        heapq.heapify(heap)
        while heap and gpus > 0:
            phase, neg, arr, name, j = heapq.heappop(heap)
            sizes, _ = table[name]
            step = int(sizes[level[name]]) - alloc[name]
            if (phase == 0 and -neg <= self.min_gain) or step > gpus or step * j.cpus_per_replica > cpus:
                continue
            alloc[name] += step
            gpus -= step
            cpus -= step * j.cpus_per_replica
            level[name] += 1
            if level[name] < len(sizes):
                heapq.heappush(heap, (0, -table[name][1][level[name]], arr, name, j))
        return alloc


class FittedOracle(FittedModel):
    """NOT an online scheduler: the fitted-model scheduler told every job's true remaining steps (the
    trace's `total_steps`). It exists to bound what better length estimates could buy the fitted-model
    allocation; the bench reports it next to the online schedulers."""
    name = "fitted_oracle"

    def remaining_steps(self, j: Job) -> float:
        return max(j.total_steps - j.progress, 1.0)


BASELINES = {"fifo": FIFO, "drf": DRF, "tiresias": Tiresias, "fitted": FittedModel, "fitted_oracle": FittedOracle}


def _geometric_mean(values) -> float:
    """The priors' typical length: job lengths span orders of magnitude, so a few long ones do not dominate."""
    return float(np.exp(np.mean(np.log(values))))
