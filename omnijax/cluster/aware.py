"""`fitted_aware`: the fitted model with a straggler and an interference term, the baseline a careful engineer
would write once co-located jobs and slow nodes are known to exist (the fitted scheduler stays Optimus as
published).

Everything comes from what a real scheduler observes: each running job's measured step time at its
current placement (`Job.observed_step_s`), the step time profiled for that configuration on arrival (the
first measurement the speed model holds for it), and which jobs share which nodes (`Job.placement`).

- Slowdown of job j: r_j = measured / profiled step time (>= 1 when something slows it).
- Node speed: a synchronous job runs at its slowest node, so r_j bounds every node it uses from above;
  a node's estimate is the smallest r_j over the jobs on it, smoothed over slots (`NodeSpeeds`).
- Interference: r_j / (its slowest node) − 1 = alpha · (the sync shares of its neighbours); alpha by least
  squares through the origin over the running jobs. A job's sync share comes from its own speed fit
  (1 − compute term / step time).
- Prediction: a size's step time is its profiled (or fitted) time × the expected slowest of the nodes it
  would span, drawn from the estimates (where a job lands is not known when it is sized) × (1 + alpha ·
  the mean neighbour load of a shared node) for sizes that do not fill whole nodes. The size a job holds
  is priced the same way, not at its own measured slowdown: that made a job on a slow node see every
  other size as faster, so it resized, landed on another node as likely slow, and moved again (on a
  generated straggler workload, 4.9 restarts a job against `fitted`'s 2.8; 7.95 with class lengths).
- Placement: fast nodes first (`node_order`), so the largest jobs, placed first, land on them.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from omnijax.cluster.jobs import Cluster, Job
from omnijax.cluster.schedulers import FittedModel


def profiled_step(j: Job, n: int, m: int) -> float:
    """The step time of (n, m) as first measured (the profiling run on arrival), else the speed fit's."""
    seen = j.speed_model.points.get((int(n), int(m)))
    if seen:
        return float(seen[0])
    return float(j.speed_model.predict(int(n), int(m)))


def slowdown(j: Job) -> float | None:
    """Measured over profiled step time at the job's current placement (None if not running/measured)."""
    if not j.allocation or not j.placement or not j.observed_step_s:
        return None
    ref = profiled_step(j, j.allocation, j.nodes)
    return float(j.observed_step_s / ref) if math.isfinite(ref) and ref > 0 else None


def sync_share(j: Job) -> float:
    """The job's sync share of its step time at its current size, from its own speed fit (0 if unknown)."""
    th = j.speed_model.theta
    if th is None or not j.allocation:
        return 0.0
    t = j.speed_model.predict(j.allocation, max(j.nodes, 1))
    return float(np.clip(1.0 - th[0] * j.speed_model.batch_size / j.allocation / t, 0.0, 1.0)) if t > 0 else 0.0


class NodeSpeeds:
    """Per-node slowdown estimates from the running jobs' measured slowdowns (module docstring)."""

    def __init__(self, memory: float = 0.5):
        self.memory = memory
        self.slow: np.ndarray | None = None

    def update(self, jobs: Sequence[Job], cluster: Cluster) -> np.ndarray:
        if self.slow is None or len(self.slow) != cluster.num_nodes:
            self.slow = np.ones(cluster.num_nodes)
        best = np.full(cluster.num_nodes, np.inf)
        for j in jobs:
            r = slowdown(j)
            if r is None or len(j.placement) != cluster.num_nodes:
                continue
            for i, c in enumerate(j.placement):
                if c:
                    best[i] = min(best[i], max(r, 1.0))
        seen = np.isfinite(best)
        self.slow[seen] = self.memory * self.slow[seen] + (1 - self.memory) * best[seen]
        return self.slow


def neighbour_loads(jobs: Sequence[Job], cluster: Cluster) -> dict[str, float]:
    """Per running job: the summed sync shares of the other jobs on any of its nodes."""
    users: dict[int, list[Job]] = {}
    for j in jobs:
        if len(j.placement) == cluster.num_nodes:
            for i, c in enumerate(j.placement):
                if c:
                    users.setdefault(i, []).append(j)
    shares = {j.name: sync_share(j) for j in jobs if j.allocation}
    out = {}
    for j in jobs:
        if j.allocation and len(j.placement) == cluster.num_nodes:
            near = {o.name for i, c in enumerate(j.placement) if c for o in users.get(i, []) if o.name != j.name}
            out[j.name] = float(sum(shares.get(o, 0.0) for o in near))
    return out


class FittedAware(FittedModel):
    """The fitted scheduler whose step times carry a straggler and an interference term (module docstring)."""
    name = "fitted_aware"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.name = "fitted_aware"
        self.nodes = NodeSpeeds()
        self.alpha = 0.0
        self._shared_load = 0.0
        self._loads: dict[str, float] = {}   # per running job: its neighbours' summed sync shares (this slot)
        self._gpn = 1

    def reset(self):
        super().reset()
        self.nodes = NodeSpeeds()
        self.alpha = 0.0
        self._loads = {}

    def node_order(self, cluster: Cluster) -> list[int] | None:
        """Fast nodes first (ties: node index)."""
        if self.nodes.slow is None:
            return None
        return sorted(range(cluster.num_nodes), key=lambda i: (self.nodes.slow[i], i))

    def observe(self, jobs: Sequence[Job], cluster: Cluster) -> None:
        """Update node speeds, alpha and the mean neighbour load of a shared node from this slot's view."""
        slow = self.nodes.update(jobs, cluster)
        self._loads = loads = neighbour_loads(jobs, cluster)   # the learned scheduler reads it too
        num = den = 0.0
        for j in jobs:
            r = slowdown(j)
            if r is None or j.name not in loads:
                continue
            worst = max(slow[i] for i, c in enumerate(j.placement) if c)
            num += (r / worst - 1.0) * loads[j.name]
            den += loads[j.name] ** 2
        if den > 0:
            self.alpha = 0.5 * self.alpha + 0.5 * max(num / den, 0.0)
        shared = [v for v in loads.values() if v > 0]
        self._shared_load = float(np.mean(shared)) if shared else 0.0

    def allocate(self, now, jobs, cluster):
        self._gpn = cluster.gpus_per_node
        self.observe(jobs, cluster)
        return super().allocate(now, jobs, cluster)

    def expected_slowdown(self, nodes: np.ndarray) -> np.ndarray:
        """E[the slowest of m nodes] for m in `nodes`, m nodes drawn at random from the estimates (where a job
        lands is not known when it is sized)."""
        if self.nodes.slow is None:
            return np.ones(len(nodes))
        v = np.sort(self.nodes.slow)
        cdf = np.arange(1, len(v) + 1) / len(v)
        out = []
        for m in np.asarray(nodes, dtype=int):
            p = cdf ** max(m, 1)
            out.append(float(np.sum(v * np.diff(np.concatenate([[0.0], p])))))
        return np.array(out)

    def remaining_times(self, j, sizes, cluster, nodes=None):
        sizes = np.asarray(sizes)
        if nodes is None:
            nodes = np.ceil(sizes / cluster.gpus_per_node)
            if j.allocation and j.placement:
                nodes = np.where(sizes == j.allocation, j.nodes, nodes)
        nodes = np.asarray(nodes)
        st = np.array([profiled_step(j, int(s), int(m)) for s, m in zip(sizes, nodes)])
        factor = self.expected_slowdown(nodes) * (1.0 + self.alpha * self._shared_load * ((sizes % cluster.gpus_per_node) != 0))
        return self.remaining_steps(j) * st * factor
