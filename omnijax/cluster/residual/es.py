"""Evolution strategies on the policy's trained part, scored against the fitted scheduler on the same
workload, and the acceptance test a trained policy must pass to be kept."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from omnijax.cluster.residual.policy import MLP
from omnijax.cluster.residual.scheduler import ResidualScheduler
from omnijax.cluster.schedulers import FittedModel
from omnijax.cluster.traces import JobSpec


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
