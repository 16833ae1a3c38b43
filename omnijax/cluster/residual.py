"""Learned scheduler: the fitted-model (shadow-price) plan steered by a small policy trained by evolution
strategies on generated workloads.

Action space: the fitted scheduler's own (every slot each job grows, shrinks or keeps its size, placement
repaired by `jobs.place`), because the policy only rescales the two knobs the shadow-price plan reads per
job: its ranking key (remaining work) and its `beta` (how much the devices it takes cost the jobs behind
it). A tanh MLP maps per-job features to log-scales of both. Its output layer starts at zero, so the
untrained policy makes exactly the fitted scheduler's decisions (the warm start: imitation with zero error).

Features the fitted model does not see: queue composition (waiting share, jobs per device), application
mix (share of active jobs of the job's own application), arrival burstiness (arrivals in the last
30 minutes) and time of day, beside the job's own rank, size, age and share of the active work.

Lengths from observed outcomes, where the fitted loss form is wrong (`ResidualScheduler.remaining_steps`):
- `ClassLengths`: jobs of one class (application and batch size) recur, and the lengths of the finished ones
  are observed online; a job whose class has finished jobs takes their lengths, whatever its loss curve looks
  like;
- `DropWatch`, `drop_anchor`: a learning-rate decay shows as a sudden drop, which the fitted form reads as a
  job far from done; a warm-start step learned from finished jobs replaces its remaining steps once a drop is
  seen, and is silent on curves without one.
Step times (`aware`): the straggler and interference terms of `FittedAware`, estimated from measured step
times and who shares which node.

Training (`train_residual`): antithetic evolution strategies (a policy-gradient estimate without
back-propagating through the simulator) with rank-shaped fitness; every iteration draws a workload from
the training distribution (`generate_workload`: a time window of a training trace, its jobs resampled
and their arrivals jittered) and scores each perturbation by its average JCT over the fitted scheduler's
on that same workload. The training traces are the Pollux sets the bench does not report (0.5x, 1.5x and
2x load); the bench evaluates on `workloads` and `workloads-realistic`. The trained policy is kept only if
it beats the fitted scheduler on `learned.es_validation` further generated workloads with confidence
(`accept`: the paired mean ratio plus `learned.es_confidence` standard errors below 1) and, where its warm
start passes that test too, the warm start as well; otherwise its warm start (class lengths, drop anchor,
step-time terms, the supervised correction) if it passes; otherwise the fitted scheduler's decisions. So a
training run whose gain is within the noise of a few workloads cannot make the scheduler worse on the files
it is evaluated on.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from omnijax.cluster.aware import FittedAware, slowdown, sync_share
from omnijax.cluster.jobs import Cluster, Job
from omnijax.cluster.schedulers import FittedModel, _geometric_mean
from omnijax.cluster.traces import APPLICATIONS, JobSpec

NUM_FEATURES = 20
OUTPUTS = 2            # log-scale of the ranking key, log-scale of beta
NODE_FEATURES = 3      # per node: log slowdown estimate, jobs on it, their summed sync shares
MAX_LOG_SCALE = 3.0


@dataclass
class MLP:
    """x -> tanh(x W1 + b1) W2 + x L + b2, plus node-scoring weights w (node order: ascending features·w);
    parameters as one flat vector [W1, b1, L, w, W2, b2] (ES perturbs everything from L on)."""
    features: int = NUM_FEATURES
    hidden: int = 16

    @property
    def head(self) -> int:
        """Index where the trained part (L, w, W2, b2) starts in the flat vector."""
        return self.features * self.hidden + self.hidden

    @property
    def size(self) -> int:
        return self.head + self.features * OUTPUTS + NODE_FEATURES + self.hidden * OUTPUTS + OUTPUTS

    def init(self, seed: int = 0) -> np.ndarray:
        """Random first layer, zero trained part (the policy starts as the fitted scheduler)."""
        rng = np.random.default_rng(seed)
        theta = np.zeros(self.size)
        n1 = self.features * self.hidden
        theta[:n1] = rng.standard_normal(n1) / math.sqrt(self.features)
        return theta

    def _split(self, theta: np.ndarray):
        F, H = self.features, self.hidden
        i = 0
        W1 = theta[i:i + F * H].reshape(F, H); i += F * H
        b1 = theta[i:i + H]; i += H
        L = theta[i:i + F * OUTPUTS].reshape(F, OUTPUTS); i += F * OUTPUTS
        w = theta[i:i + NODE_FEATURES]; i += NODE_FEATURES
        W2 = theta[i:i + H * OUTPUTS].reshape(H, OUTPUTS); i += H * OUTPUTS
        b2 = theta[i:i + OUTPUTS]
        return W1, b1, L, w, W2, b2

    def __call__(self, theta: np.ndarray, x: np.ndarray) -> np.ndarray:
        W1, b1, L, _, W2, b2 = self._split(theta)
        return np.tanh(x @ W1 + b1) @ W2 + x @ L + b2

    def node_weights(self, theta: np.ndarray) -> np.ndarray:
        return self._split(theta)[3]


def median_left(totals: np.ndarray, progress: float) -> float | None:
    """The median, over the lengths in `totals` a job at `progress` has not yet outlived, of the steps left;
    None when it has outlived them all."""
    left = totals[totals > 1.02 * progress] - progress
    return max(float(np.median(left)), 1.0) if left.size else None


class ClassLengths:
    """Lengths of finished jobs per job class (application, batch size), observed online, and whether they
    predict that class better than the scheduler's other estimate.

    Jobs recur in production clusters, and the lengths of earlier runs predict a recurring job's length where a
    curve fitted to its own loss cannot (3Sigma, Park et al., EuroSys'18, schedules on run-time distributions
    learned from job history). A job's remaining steps are the median over its class's lengths it has not yet
    outlived (`median_left`), so a job that outlives its class's usual length is not called done.
    How alike a class's jobs are is not assumed: every slot both estimates of each job's length are recorded
    (`record`), scored when the job finishes, and a class's lengths are used only while their mean log error
    over its finished jobs is at most the other estimate's (`trusted`; before any score, they are)."""

    def __init__(self):
        self.seen: dict[tuple[str, int], list[float]] = {}
        self._pending: dict[str, list[tuple[float, float]]] = {}
        self._error: dict[tuple[str, int], np.ndarray] = {}     # summed |log error|: class lengths, other; count

    def record(self, job: Job, class_total: float, other_total: float) -> None:
        self._pending.setdefault(job.name, []).append((class_total, other_total))

    def finished(self, job: Job) -> None:
        key = (job.application, job.batch_size)
        self.seen.setdefault(key, []).append(job.progress)
        guesses = np.asarray(self._pending.pop(job.name, []), dtype=float).reshape(-1, 2)
        if guesses.size:
            err = self._error.setdefault(key, np.zeros(3))
            err[:2] += np.abs(np.log(np.maximum(guesses, 1.0) / max(job.progress, 1.0))).sum(0)
            err[2] += len(guesses)

    def trusted(self, job: Job) -> bool:
        err = self._error.get((job.application, job.batch_size))
        return err is None or err[0] <= err[1]

    def remaining(self, job: Job) -> float | None:
        lengths = self.seen.get((job.application, job.batch_size))
        return median_left(np.asarray(lengths), job.progress) if lengths else None


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


_BLOCKS = (1, 2, 4, 8)     # DropWatch's block sizes
_NOISE_HISTORY = 40        # below_trend's noise estimate: this many points before the newest


class DropWatch:
    """Per job, the steps done when a sudden loss drop was first seen (`below_trend`)."""

    def __init__(self, last: int = 3, window: int = 6):
        self.last, self.window = last, window
        self.first: dict[str, float] = {}

    def update(self, name: str, model) -> float | None:
        """At block sizes 1, 2, 4, 8 (means of consecutive observations, at their mean step: progress per slot
        varies with the job's placement): a job observed often sees a drop spread over many observations,
        which only block means show as sudden."""
        if name not in self.first:
            tail = (_NOISE_HISTORY + self.last) * _BLOCKS[-1]        # the most any block size reads
            steps = np.asarray(model.steps[-tail:], dtype=float)
            losses = np.asarray(model.losses[-tail:], dtype=float)
            for size in _BLOCKS:
                nb = len(losses) // size
                if nb < self.window + self.last:
                    break
                cut = len(losses) - nb * size
                at = below_trend(steps[cut:].reshape(nb, size).mean(1), losses[cut:].reshape(nb, size).mean(1),
                                 self.last, self.window)
                if at is not None:
                    self.first[name] = max(at, 1.0)
                    break
        return self.first.get(name)


def below_trend(steps: Sequence[float], losses: Sequence[float], last: int = 3, window: int = 6,
                z: float = 4.0) -> float | None:
    """The step where a sudden drop began, if the `last` newest losses all lie more than `z` noise levels below
    the straight line through the `window` losses before them (noise: the spread of the history's second
    differences, widened by the line's own error where it is extrapolated); else None.
    A loss curve that falls ever more slowly (convex, as 1/(a·k + b) + c) stays above its own tangents, so
    only a drop (a learning-rate decay after a plateau) gets there, within `last` observations of it; no fitted
    form is trusted, so a fit drifting off a long job's curve is not taken for a drop."""
    if len(losses) < window + last:
        return None
    x = np.asarray(steps[-(window + last):], dtype=float)
    y = np.asarray(losses[-(window + last):], dtype=float)
    xo, yo = x[:window], y[:window]
    if np.ptp(xo) <= 0:
        return None
    slope, icpt = np.polyfit(xo, yo, 1)
    hist = np.asarray(losses[-(_NOISE_HISTORY + last):-last], dtype=float)   # noise: second differences of the history
    noise = float(np.median(np.abs(np.diff(hist, 2)))) / (0.6745 * math.sqrt(6.0))
    sigma = max(noise, 1e-3 * float(np.mean(np.abs(yo))))
    xn = x[window:]
    below = y[window:] - (slope * xn + icpt)
    spread = sigma * np.sqrt(1.0 + 1.0 / window + (xn - xo.mean()) ** 2 / np.sum((xo - xo.mean()) ** 2))  # + the line's own error
    return float(xn[0]) if bool(np.all(below < -z * spread)) else None


# ------------------------------------------------------------------------------------------ training
def generate_workload(pool: Sequence[Sequence[JobSpec]], rng: np.random.Generator, window_s: float = 3600.0,
                      jitter_s: float = 300.0) -> list[JobSpec]:
    """A workload from the training distribution: a random `window_s` window of a random training trace,
    its jobs resampled with replacement (same count) and their arrivals jittered by up to `jitter_s`."""
    specs = list(pool[int(rng.integers(len(pool)))])
    end = max(s.time for s in specs)
    t0 = float(rng.uniform(0.0, max(end - window_s, 0.0)))
    window = [s for s in specs if t0 <= s.time < t0 + window_s] or specs[:1]
    picks = rng.integers(len(window), size=len(window))
    out = []
    for i, k in enumerate(picks):
        s = window[int(k)]
        t = float(np.clip(s.time - t0 + rng.uniform(-jitter_s, jitter_s), 0.0, window_s))
        out.append(JobSpec(f"{s.application}-g{i}", t, s.application, s.num_replicas, s.batch_size))
    return sorted(out, key=lambda s: (s.time, s.name))


def episode_score(theta: np.ndarray, specs: Sequence[JobSpec], sim_cfg, hidden: int, reference: float,
                  opts: Mapping | None = None) -> float:
    """Average JCT of the policy on one workload over `reference` (the fitted scheduler's there); `opts`: the
    scheduler's other warm-start parts (`anchor`, `class_lengths`, `aware`)."""
    from omnijax.cluster.simulator import run_workload
    return run_workload(specs, ResidualScheduler(theta=theta, hidden=hidden, **(opts or {})), sim_cfg).avg_jct_s / reference


def evolve(theta: np.ndarray, workloads: Sequence[Sequence[JobSpec]], sim_cfg, *, hidden: int = 16,
           pairs: int = 4, sigma: float = 0.3, lr: float = 0.3, seed: int = 0, log=None,
           sims: Sequence | None = None, opts: Mapping | None = None) -> tuple[np.ndarray, list[dict]]:
    """Antithetic ES, one iteration per workload in `workloads`; returns (final parameters, history).

    Only the output layer is trained (the first layer stays a fixed random feature map): far fewer
    parameters, so a few mirrored pairs give a usable gradient estimate. Each iteration scores `pairs` mirrored perturbations θ ± σε relative to the fitted scheduler on that
    workload, ranks the 2·pairs scores (fitness shaping: robust to the scale of JCT differences) and steps
    θ along the estimated descent direction. The history holds each iteration's mean score of the
    perturbations and of the centre (both relative to fitted: < 1 is better)."""
    from omnijax.cluster.simulator import run_workload
    rng = np.random.default_rng(seed)
    theta = np.array(theta, dtype=float)
    head = MLP(hidden=hidden).head
    history = []
    for it, specs in enumerate(workloads):
        cfg_it = sims[it] if sims is not None else sim_cfg     # per iteration: its families and seed
        ref = run_workload(specs, FittedModel(), cfg_it).avg_jct_s
        eps = np.zeros((pairs, len(theta)))
        eps[:, head:] = rng.standard_normal((pairs, len(theta) - head))
        scores = np.array([[episode_score(theta + s * sigma * e, specs, cfg_it, hidden, ref, opts) for s in (1.0, -1.0)]
                           for e in eps])
        ranks = np.argsort(np.argsort(scores.ravel())).reshape(scores.shape) / (scores.size - 1) - 0.5
        grad = ((ranks[:, 0] - ranks[:, 1])[:, None] * eps).sum(0) / (pairs * sigma)
        theta = theta - lr * sigma * grad
        row = {"iteration": it, "jobs": len(specs), "families": list(cfg_it.families), "perturbed_vs_fitted": round(float(scores.mean()), 4),
               "best_vs_fitted": round(float(scores.min()), 4)}
        history.append(row)
        if log:
            log(row)
    return theta, history


def accept(scores: Sequence[float], z: float = 2.0) -> bool:
    """Whether a trained policy beats its warm start: `scores` are its average JCT over the fitted
    scheduler's on held-out generated workloads (paired: the same workload for both), and the policy is
    kept only if their mean plus `z` standard errors is below 1. A mean just under 1 over a handful of
    workloads is noise (a previous policy kept on that rule was worse than fitted on most evaluated files)."""
    s = np.asarray(scores, dtype=float)
    if not s.size:
        return True
    se = float(s.std(ddof=1) / math.sqrt(s.size)) if s.size > 1 else math.inf
    return float(s.mean()) + z * se < 1.0


class _Recorder(ResidualScheduler):
    """The warm-start policy (the fitted scheduler's decisions) that records, every slot, each planned job's
    features and the fitted model's remaining steps, for `length_correction`."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rows: list[tuple[str, float, float, np.ndarray]] = []   # (job, progress, fitted remaining, features)

    def _adjust(self, now, all_jobs, jobs, table, work):
        if jobs:
            x = self.features(now, all_jobs, jobs, work, max(int(self._gpus), 1))
            self.rows += [(j.name, j.progress, self.remaining_steps(j), x[i]) for i, j in enumerate(jobs)]
        return super()._adjust(now, all_jobs, jobs, table, work)


MISFIT_COLUMNS = (15, 16, 18, 19)   # a loss drop seen, the fit says converged, log(steps at the first drop / fitted
                                    # remaining) and log(steps now / steps at the first drop) after a drop


def length_correction(workloads: Sequence[Sequence[JobSpec]], sims: Sequence, hidden: int = 16, seed: int = 0,
                      ridge: float = 1.0, clip: float = 3.0,
                      columns: Sequence[int] = MISFIT_COLUMNS) -> tuple[np.ndarray, dict]:
    """Supervised step of the warm start, from observed outcomes: run the fitted scheduler's decisions on the
    training workloads, and once every job has finished (its length is then known, as to any real scheduler)
    regress log(true remaining / fitted remaining) at every slot it was planned on the `columns` of the
    policy's features (ridge, no intercept): the loss-history misfit signals, all zero while the loss follows
    the fitted form, so the correction is silent there (a correction on every feature, with an intercept,
    explained more of the error, r² 0.48, but re-ranked jobs whose fit was right and was worse than the
    fitted scheduler on held-out generated workloads). The fit becomes the linear path of the ranking
    output: the policy ranks by the remaining work its observations predict where the fitted loss form
    is visibly wrong. Returns the parameters (the rest at the warm start) and the fit's statistics."""
    from omnijax.cluster.simulator import run_jobs
    X, y = [], []
    for specs, sim in zip(workloads, sims):
        rec = _Recorder(hidden=hidden, seed=seed)
        jobs, _ = run_jobs(specs, rec, sim)
        total = {j.name: j.total_steps for j in jobs}
        for name, progress, rem_fit, x in rec.rows:
            X.append(x)
            y.append(float(np.clip(math.log(max(total[name] - progress, 1.0) / max(rem_fit, 1.0)), -clip, clip)))
    mlp = MLP(hidden=hidden)
    theta = mlp.init(seed)
    if not X:
        return theta, {"rows": 0}
    X, y = np.array(X), np.array(y)
    cols = list(columns)
    A = X[:, cols]
    w = np.linalg.solve(A.T @ A + ridge * np.eye(len(cols)), A.T @ y)
    W1, b1, L, nodew, W2, b2 = mlp._split(theta)       # views into theta
    L[cols, 0] = w
    pred = A @ w
    stats = {"rows": int(len(y)), "target_sd": round(float(y.std()), 4),
             "residual_sd": round(float((y - pred).std()), 4), "r2": round(1.0 - float(np.var(y - pred) / max(np.var(y), 1e-12)), 4),
             "weights": [round(float(v), 3) for v in w]}
    return theta, stats


def drop_anchor(workloads: Sequence[Sequence[JobSpec]], sims: Sequence, hidden: int = 16,
                seed: int = 0, quantiles: int = 10) -> tuple[np.ndarray, dict]:
    """The length anchor, from observed outcomes: run the fitted scheduler's decisions on the training
    workloads and, for every finished job in which a sudden loss drop was seen, take its length over the
    steps done when the drop was first seen; the anchor is `quantiles` quantiles of those ratios (none when no
    job dropped). Nothing is assumed about where drops fall: a schedule whose first decay comes at a third
    of the job gives ratios near 3 (less the detection delay), one at half near 2."""
    from omnijax.cluster.simulator import run_jobs
    ratios = []
    for specs, sim in zip(workloads, sims):
        rec = ResidualScheduler(hidden=hidden, seed=seed)
        jobs, _ = run_jobs(specs, rec, sim)
        ratios += [j.total_steps / rec.drops.first[j.name] for j in jobs if j.name in rec.drops.first]
    if not ratios:
        return np.zeros(0), {"jobs": 0}
    anchor = np.quantile(np.asarray(ratios), (np.arange(quantiles) + 0.5) / quantiles)
    return anchor, {"jobs": len(ratios), "anchor": [round(float(a), 3) for a in anchor]}


def episode_configs(sim_cfg, families: Sequence[str], count: int, rng: np.random.Generator) -> list:
    """`count` simulator configs, each with its own seed, under no family or one of `families`: round robin in a
    fresh random order per round, so every family gets its share of a short training run."""
    from dataclasses import replace
    options = [()] + [(f,) for f in families]
    if not families:
        return [sim_cfg] * count
    order: list[tuple[str, ...]] = []
    while len(order) < count:
        order += [options[int(i)] for i in rng.permutation(len(options))]
    return [replace(sim_cfg, families=order[i], seed=int(rng.integers(1 << 30))) for i in range(count)]


def save_policy(path: str, sched: "ResidualScheduler") -> None:
    np.savez(path, theta=sched.theta, hidden=sched.mlp.hidden, anchor=sched.anchor,
             class_lengths=sched.class_lengths, aware=sched.aware,
             validation=getattr(sched, "validation_vs_fitted", np.nan), accepted=getattr(sched, "accepted", False),
             kept=getattr(sched, "kept", ""))


def load_policy(path: str) -> "ResidualScheduler":
    """A policy `save_policy` wrote; a UserError if the file is missing or of another shape."""
    from omnijax.errors import UserError
    try:
        data = np.load(path)
        sched = ResidualScheduler(theta=data["theta"], hidden=int(data["hidden"]),     # older files: none of
                                  anchor=data["anchor"] if "anchor" in data else (),   # anchor, class lengths, aware
                                  class_lengths=bool(data["class_lengths"]) if "class_lengths" in data else False,
                                  aware=bool(data["aware"]) if "aware" in data else False)
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"learned.load={path!r}: not a saved learned policy ({exc})") from None
    sched.validation_vs_fitted = float(data["validation"])
    sched.accepted = bool(data["accepted"])
    if "kept" in data and str(data["kept"]):
        sched.kept = str(data["kept"])
    return sched


def train_residual(cfg) -> ResidualScheduler:
    """Train on workloads generated from the `learned.train_sets` traces (under `learned.train_families`);
    returns the scheduler (or `learned.load`'s saved one)."""
    from omnijax.cluster.simulator import run_workload
    from omnijax.cluster.traces import load_workload, workload_files
    lc = cfg.learned
    if lc.load:
        return load_policy(lc.load)
    pool = [load_workload(w) for s in lc.train_sets for w in workload_files(s, 0)]
    eval_names = {"workloads", "workloads-realistic"}
    if any(s in eval_names for s in lc.train_sets):
        raise ValueError(f"learned.train_sets={lc.train_sets} overlaps the evaluation sets {sorted(eval_names)}")
    rng = np.random.default_rng(lc.seed)
    episodes = [generate_workload(pool, rng, window_s=lc.window_s) for _ in range(lc.es_iterations)]
    frng = np.random.default_rng([lc.seed, 1])
    sims = episode_configs(cfg.sim, lc.train_families, lc.es_iterations, frng)
    mlp = MLP(hidden=lc.hidden_es)
    start = mlp.init(lc.seed)
    anchor = np.zeros(0)
    if lc.anchor_workloads:       # the warm start's first supervised step: lengths after a loss drop
        arng = np.random.default_rng([lc.seed, 3])
        aw = [generate_workload(pool, arng, window_s=lc.supervised_window_s or lc.window_s)
              for _ in range(lc.anchor_workloads)]
        anchor, stats = drop_anchor(aw, episode_configs(cfg.sim, lc.train_families, len(aw), arng),
                                    hidden=lc.hidden_es, seed=lc.seed)
        print(f"# learned supervised: drop anchor from {len(aw)} generated workloads: {stats}", file=sys.stderr)
    if lc.supervised_workloads:   # the warm start's supervised step: a length correction from observed outcomes
        srng = np.random.default_rng([lc.seed, 2])
        sup = [generate_workload(pool, srng, window_s=lc.supervised_window_s or lc.window_s)
               for _ in range(lc.supervised_workloads)]
        start, stats = length_correction(sup, episode_configs(cfg.sim, lc.train_families, len(sup), srng),
                                         hidden=lc.hidden_es, seed=lc.seed, columns=lc.supervised_columns)
        print(f"# learned supervised: length correction on {len(sup)} generated workloads: {stats}", file=sys.stderr)
    opts = {"anchor": anchor, "class_lengths": lc.class_lengths, "aware": lc.aware}
    theta, hist = evolve(start, episodes, cfg.sim, hidden=lc.hidden_es, pairs=lc.es_pairs,
                         sigma=lc.es_sigma, lr=lc.es_lr, seed=lc.seed, sims=sims, opts=opts,
                         log=lambda r: print(f"# learned es: {r}", file=sys.stderr))
    # validation on fresh generated workloads (same distribution, none trained on): of the trained policy and its
    # warm start, those that beat the fitted scheduler there with confidence; of both, the trained policy only if
    # it also beats its warm start with confidence; of neither, the fitted scheduler's decisions
    held = [generate_workload(pool, rng, window_s=lc.window_s) for _ in range(lc.es_validation)]
    held_sims = episode_configs(cfg.sim, lc.train_families, lc.es_validation, frng)
    refs = [run_workload(s, FittedModel(), c).avg_jct_s for s, c in zip(held, held_sims)]

    def validate(th: np.ndarray, what: str) -> tuple[list[float], bool]:
        sc = [episode_score(th, s, c, lc.hidden_es, r, opts) for s, c, r in zip(held, held_sims, refs)]
        ok = accept(sc, lc.es_confidence)
        print(f"# learned es: validation of the {what} on {len(held)} generated workloads: "
              f"{float(np.mean(sc)) if sc else 0.0:.4f} x fitted (per workload "
              f"{[(c.families, round(x, 4)) for c, x in zip(held_sims, sc)]}); {'accepted' if ok else 'rejected'}",
              file=sys.stderr)
        return sc, ok

    scores, kept = validate(theta, "trained policy")
    kept_what, trained = "trained policy", theta
    if lc.es_iterations and np.any(theta != start):
        warm, warm_ok = validate(start, "warm start")
        better = not warm_ok
        if kept and warm_ok:     # both beat fitted: RL must also beat its own warm start (paired, same rule)
            better = accept(np.asarray(scores) / np.asarray(warm), lc.es_confidence)
            print(f"# learned es: trained policy / warm start {float(np.mean(np.asarray(scores) / np.asarray(warm))):.4f}"
                  f" ({'better' if better else 'not better with confidence'})", file=sys.stderr)
        if not better:
            scores, kept, theta, kept_what = warm, warm_ok, start, "warm start"
    if not kept:
        theta, opts, kept_what = mlp.init(lc.seed), {}, "fitted"
    score = float(np.mean(scores)) if scores else 0.0
    print(f"# learned: keeping the {kept_what}", file=sys.stderr)
    sched = ResidualScheduler(theta=theta, hidden=lc.hidden_es, **opts)
    sched.history = hist
    sched.validation_vs_fitted = score
    sched.validation_scores = scores
    sched.accepted = kept
    sched.kept = kept_what
    sched.trained_theta = trained
    if lc.save:
        save_policy(lc.save, sched)
    return sched
