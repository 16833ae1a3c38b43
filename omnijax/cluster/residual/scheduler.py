"""`ResidualScheduler`: the fitted (shadow-price) plan with per-job ranking and beta scales from the policy,
remaining steps from class lengths and the drop anchor where they say more than the fit."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from omnijax.cluster.aware import FittedAware, slowdown, sync_share
from omnijax.cluster.jobs import Cluster, Job
from omnijax.cluster.residual.drops import DropWatch
from omnijax.cluster.residual.lengths import ClassLengths, median_left
from omnijax.cluster.residual.policy import MAX_LOG_SCALE, MLP, NODE_FEATURES, NUM_FEATURES
from omnijax.cluster.schedulers import FittedModel, _geometric_mean
from omnijax.cluster.traces import APPLICATIONS


class ResidualScheduler(FittedAware):
    """The shadow-price plan with per-job ranking and beta scales from a policy (module docstring).

    `class_lengths` and `anchor` replace the fitted remaining steps where observed outcomes say more;
    `aware` prices sizes with `FittedAware`'s straggler and interference terms and offers fast nodes first.
    All off and the policy at zero, it is the fitted scheduler decision for decision."""
    name = "learned"

    def __init__(self, theta: np.ndarray | None = None, hidden: int = 16, seed: int = 0,
                 anchor: Sequence[float] = (), class_lengths: bool = False, aware: bool = False, **kw):
        super().__init__(**kw)
        # learned quantiles of a job's length over the steps done when its first loss drop was seen (`drop_anchor`;
        # empty: off)
        self.anchor = np.sort(np.asarray(anchor, dtype=float))
        self.class_lengths = bool(class_lengths)
        self.aware = bool(aware)
        self.lengths = ClassLengths()
        self.mlp = MLP(hidden=hidden)
        self.theta = self.mlp.init(seed) if theta is None else np.asarray(theta, dtype=float)
        if self.theta.shape != (self.mlp.size,):
            raise ValueError(f"theta has shape {self.theta.shape}, the policy needs ({self.mlp.size},)")
        self._arrivals: dict[str, float] = {}
        self._gpus = 1
        self.name = "learned"
        self._node_features: np.ndarray | None = None
        self.drops = DropWatch()

    def reset(self):
        super().reset()
        self._arrivals = {}
        self.drops = DropWatch()
        self.lengths = ClassLengths()
        self._node_features = None

    def features(self, now: float, all_jobs: Sequence[Job], jobs: Sequence[Job], work: dict[str, float],
                 gpus: int) -> np.ndarray:
        """[len(jobs), NUM_FEATURES]: the job's own state and what the fitted model does not see: the queue,
        the mix, arrivals; measured slowdown at its placement, its neighbours' communication and its nodes'
        estimated speed (straggler, interference); how its loss history agrees with the fitted curve (whether
        a sudden loss drop was seen and at which step, whether the fit says it has converged, the fit's length
        against its application's finished jobs)."""
        for j in all_jobs:
            self._arrivals.setdefault(j.name, j.arrival)
        n = len(all_jobs)
        waiting = sum(1 for j in all_jobs if not j.allocation) / max(n, 1)
        recent = sum(1 for t in self._arrivals.values() if now - 1800.0 <= t <= now) / 16.0
        day = 2 * math.pi * (now % 86400.0) / 86400.0
        apps = {a: 0 for a in APPLICATIONS}
        for j in all_jobs:
            apps[j.application] = apps.get(j.application, 0) + 1
        keys = np.array([work[j.name] for j in jobs])
        rank = np.argsort(np.argsort(keys, kind="stable"), kind="stable") / max(len(jobs), 1)
        total = float(np.sum(np.maximum(keys, 0.0))) or 1.0
        loads = self._loads
        slow = self.nodes.slow
        x = np.zeros((len(jobs), NUM_FEATURES))
        for i, j in enumerate(jobs):
            r = slowdown(j)
            worst = max((slow[k] for k, c in enumerate(j.placement) if c), default=1.0) if slow is not None and \
                len(j.placement) == len(slow) else 1.0
            fit_total = j.loss_model.total_steps()
            rem_fit = self.remaining_steps(j)
            same = self._finished_by_app.get(j.application)
            prior = _geometric_mean(np.maximum(same, 1.0)) if same else None
            rem_prior = (max(prior, 1.25 * j.progress) - j.progress) if prior else rem_fit
            k_drop = self.drops.first.get(j.name)
            dropped = float(k_drop is not None)
            plateau = float(fit_total is not None and math.isfinite(fit_total) and fit_total < 1.1 * max(j.progress, 1.0))
            disagree = float(np.clip(math.log(max(rem_prior, 1.0) / max(rem_fit, 1.0)), -4, 4)) / 4
            since = math.log(max(j.progress, 1.0) / k_drop) if k_drop else 0.0
            scale = math.log(k_drop / max(rem_fit, 1.0)) if k_drop else 0.0
            x[i] = [math.log1p(max(work[j.name], 0.0) / 3600.0) / 3, rank[i], j.allocation / gpus * 4,
                    float(j.allocation > 0), math.log1p(max(now - j.arrival, 0.0) / 3600.0),
                    waiting, n / gpus, recent, math.sin(day), math.cos(day),
                    apps[j.application] / max(n, 1), max(work[j.name], 0.0) / total,
                    math.log(max(r, 1e-3)) if r else 0.0, loads.get(j.name, 0.0) / 2, math.log(worst),
                    dropped, plateau, disagree, scale, since]
        return x

    def observe(self, all_jobs: Sequence[Job], cluster: Cluster) -> None:
        """Per slot: node speed estimates and neighbour loads from the measured step times and placements."""
        for j in all_jobs:
            self.drops.update(j.name, j.loss_model)
            if self.class_lengths:
                left = self.lengths.remaining(j)
                if left is not None:
                    self.lengths.record(j, j.progress + left, j.progress + self._remaining_observed(j))
        FittedAware.observe(self, all_jobs, cluster)   # once a slot: node speeds, alpha, slowdowns, neighbour loads
        shares = {j.name: sync_share(j) for j in all_jobs if j.allocation}
        per_node = np.zeros((cluster.num_nodes, NODE_FEATURES))
        per_node[:, 0] = np.log(np.maximum(self.nodes.slow, 1e-3))
        for j in all_jobs:
            if len(j.placement) == cluster.num_nodes:
                for k, c in enumerate(j.placement):
                    if c:
                        per_node[k, 1] += 0.25
                        per_node[k, 2] += shares.get(j.name, 0.0)
        self._node_features = per_node

    def job_finished(self, job):
        super().job_finished(job)
        self.lengths.finished(job)

    def remaining_steps(self, j: Job) -> float:
        """With `class_lengths`, from the finished jobs of the job's class while they predict it best
        (`ClassLengths`). Else, after a sudden loss drop: the median remaining length over the learned lengths
        (anchor quantiles × the steps at which the drop was first seen) this job has not yet outlived (a
        step-decay schedule's milestones sit at fixed fractions of the job; the fitted form reads the plateau
        before a drop as convergence, then the drop as a job far from done). Otherwise (both off, no finished
        job of its class and no drop seen, or a job past every length they know) the fitted model's remaining
        steps."""
        if self.class_lengths and self.lengths.trusted(j):
            left = self.lengths.remaining(j)
            if left is not None:
                return left
        return self._remaining_observed(j)

    def _remaining_observed(self, j: Job) -> float:
        """The job's remaining steps from its own observations: the drop anchor after a seen drop, else the fit."""
        k = self.drops.first.get(j.name)
        if self.anchor.size and k:
            left = median_left(self.anchor * k, j.progress)
            if left is not None:
                return left
        return FittedModel.remaining_steps(self, j)

    def remaining_times(self, j, sizes, cluster, nodes=None):
        if self.aware:
            return FittedAware.remaining_times(self, j, sizes, cluster, nodes)
        return FittedModel.remaining_times(self, j, sizes, cluster, nodes)

    def node_order(self, cluster: Cluster) -> list[int] | None:
        """Nodes by ascending score: the learned weights times the node features, plus, with `aware`, the log of
        each node's estimated slowdown (the warm start's fast-first order, which small weights then only adjust:
        the order moves continuously away from the warm start's as the weights grow). Zero weights: exactly the
        warm start's order (`FittedAware.node_order`, or None, the default order)."""
        w = self.mlp.node_weights(self.theta)
        if not np.any(w) or self._node_features is None or len(self._node_features) != cluster.num_nodes:
            return FittedAware.node_order(self, cluster) if self.aware else None
        score = self._node_features @ w
        if self.aware:
            score = score + self._node_features[:, 0]
        return sorted(range(cluster.num_nodes), key=lambda k: (score[k], k))

    def _adjust(self, now, all_jobs, jobs, table, work):
        if not jobs:
            return {}
        gpus = max(int(self._gpus), 1)
        out = np.clip(self.mlp(self.theta, self.features(now, all_jobs, jobs, work, gpus)),
                      -MAX_LOG_SCALE, MAX_LOG_SCALE)
        betas = {}
        for j, (rank_scale, beta_scale) in zip(jobs, out):
            work[j.name] *= math.exp(rank_scale)
            betas[j.name] = self.beta * math.exp(beta_scale)
        return betas

    def allocate(self, now, jobs, cluster):
        self._gpus = cluster.gpus
        self._gpn = cluster.gpus_per_node
        self.observe(jobs, cluster)
        return FittedModel.allocate(self, now, jobs, cluster)
