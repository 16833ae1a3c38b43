"""The warm start's supervised steps, from the observed outcomes of the fitted scheduler's decisions:
the drop anchor (job length over the steps at its first loss drop) and the length correction (a ridge fit of
log(true / fitted remaining) on the policy's misfit features)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from omnijax.cluster.residual.policy import MLP
from omnijax.cluster.residual.scheduler import ResidualScheduler
from omnijax.cluster.traces import JobSpec


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
    W1, b1, L, nodew, W2, b2 = mlp.split(theta)       # views into theta
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
