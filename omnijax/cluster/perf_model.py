"""Online performance models of one job: its loss curve and its speed as a function of resources.

Loss: l(k) = 1/(a·k + b) + c with a, b, c >= 0 (the convergence form of SGD on smooth problems), fitted
to the (step, loss) points seen so far; the fitted curve predicts how many steps remain until the loss
has closed all but a fraction `eps` of its gap to the asymptote c.

Speed: seconds per step as a non-negative combination of resource features (non-negative least squares
on 1/speed): for all-reduce (SPMD) jobs on n devices over m nodes with total batch B,
t = θ0·B/n + θ1 + θ2·log2(n) + θ3·(n−1) + θ4·(m−1)
(compute, fixed overhead, tree-latency, per-peer and cross-node sync; a ring's (n−1)/n term would be
collinear with B/n and 1 at a fixed batch); for parameter-server jobs with p servers and w workers,
t = θ0·B/w + θ1 + θ2·w/p + θ3·w + θ4·p. Non-negativity keeps the fitted curves physically sensible
(more compute never speeds up sync) and lets a handful of points give a usable model.

Both models report the relative error of each new point against the prediction made before it arrived.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from scipy.optimize import least_squares, nnls


@dataclass(frozen=True)
class LossCoeffs:
    a: float
    b: float
    c: float

    def __call__(self, k):
        return 1.0 / (self.a * np.asarray(k, dtype=float) + self.b) + self.c

    def steps_to_converge(self, eps: float) -> float:
        """Smallest k with l(k) − c <= eps·(l(0) − c): k = b·(1/eps − 1)/a (infinite if a == 0)."""
        if self.a <= 0:
            return float("inf")
        return self.b * (1.0 / eps - 1.0) / self.a


def fit_loss_curve(k: np.ndarray, loss: np.ndarray) -> LossCoeffs:
    """Least-squares fit of 1/(a·k + b) + c with a, b, c >= 0.

    For a fixed c the model is linear in 1/(l − c), so a grid over c with NNLS gives a good start;
    a bounded nonlinear least-squares refine then fits in loss space (where the noise lives).
    """
    k = np.asarray(k, dtype=float)
    loss = np.asarray(loss, dtype=float)
    if k.shape != loss.shape or k.size < 3:
        raise ValueError("fit_loss_curve needs at least 3 (step, loss) points of equal length")
    scale = max(float(k.max()), 1.0)
    x = k / scale
    best = None
    lo = float(loss.min())
    for c in np.concatenate([[0.0], lo * np.linspace(0.0, 0.99, 34)[1:]]):
        gap = loss - c
        if np.any(gap <= 0):
            continue
        # weight by gap**2 so the linearised residuals match loss-space residuals to first order
        w = gap ** 2
        A = np.stack([x, np.ones_like(x)], 1) * w[:, None]
        (a, b), _ = nnls(A, w / gap)
        if b <= 0:
            continue
        r = float(np.sum((1.0 / (a * x + b) + c - loss) ** 2))
        if best is None or r < best[0]:
            best = (r, a, b, c)
    a0, b0, c0 = (best[1:] if best else (1.0, 1.0 / max(loss[0], 1e-6), 0.0))

    def resid(p):
        return 1.0 / (p[0] * x + p[1]) + p[2] - loss

    p0 = np.array([max(a0, 1e-9), max(b0, 1e-9), max(c0, 0.0)])
    sol = least_squares(resid, p0, bounds=([0.0, 1e-12, 0.0], [np.inf, np.inf, np.inf]), x_scale="jac")
    a, b, c = sol.x
    return LossCoeffs(a=float(a) / scale, b=float(b), c=float(c))


@dataclass
class LossModel:
    """A job's loss curve fitted online; `remaining_steps` is what schedulers consume."""
    eps: float = 0.05
    min_points: int = 5
    steps: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)   # relative error of each new point before fitting
    coeffs: LossCoeffs | None = None
    refit_growth: float = 1.2     # refit when the point count grew by this factor (keeps fitting O(log n))
    _fitted_at: int = 0

    def observe(self, step: float, loss: float) -> None:
        if not np.isfinite(loss):
            return
        if self.coeffs is not None:
            pred = float(self.coeffs(step))
            self.errors.append(abs(pred - loss) / max(abs(loss), 1e-12))
        self.steps.append(float(step))
        self.losses.append(float(loss))
        n = len(self.steps)
        if n >= self.min_points and (self.coeffs is None or n >= self._fitted_at * self.refit_growth):
            self._fitted_at = n
            self.coeffs = fit_loss_curve(np.array(self.steps), np.array(self.losses))

    def total_steps(self) -> float | None:
        """Predicted steps to converge, or None before enough points."""
        return None if self.coeffs is None else self.coeffs.steps_to_converge(self.eps)


ResourceForm = Literal["allreduce", "ps"]


def speed_features(form: ResourceForm, batch_size: float, n: int, m: int) -> np.ndarray:
    """Features whose non-negative combination is the step time.

    allreduce: n devices over m nodes. ps: n workers, m servers.
    """
    if n <= 0 or m <= 0:
        raise ValueError(f"resources must be positive, got n={n}, m={m}")
    if form == "allreduce":
        return np.array([batch_size / n, 1.0, np.log2(n), n - 1.0, m - 1.0])
    if form == "ps":
        return np.array([batch_size / n, 1.0, n / m, float(n), float(m)])
    raise ValueError(f"unknown resource form {form!r}")


@dataclass
class SpeedModel:
    """Step time as a function of resources, fitted by NNLS on observed step times (1/speed)."""
    form: ResourceForm = "allreduce"
    batch_size: float = 1.0
    points: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)
    theta: np.ndarray | None = None

    def observe(self, n: int, m: int, step_time: float) -> None:
        if not (np.isfinite(step_time) and step_time > 0):
            return
        if self.theta is not None:
            self.errors.append(abs(self.predict(n, m) - step_time) / step_time)
        self.points.setdefault((n, m), []).append(float(step_time))
        self._fit()

    def _fit(self) -> None:
        keys = list(self.points)
        X = np.stack([speed_features(self.form, self.batch_size, n, m) for n, m in keys])
        y = np.array([np.mean(self.points[key]) for key in keys])
        # relative error matters (fast and slow configs alike): scale rows by 1/y
        self.theta, _ = nnls(X / y[:, None], np.ones_like(y))

    def predict_many(self, n: np.ndarray, m: np.ndarray, measured: bool = False) -> np.ndarray:
        """Vectorised `predict` for arrays of device and node (or worker and server) counts.

        `measured`: where a configuration was observed, its mean measured step time replaces the fit (the
        five-term form cannot follow every measured kink, e.g. the jump from one node to two)."""
        n = np.asarray(n, dtype=float)
        m = np.asarray(m, dtype=float)
        if self.theta is None:
            return np.full(n.shape, np.inf)
        if self.form == "allreduce":
            X = np.stack([self.batch_size / n, np.ones_like(n), np.log2(n), n - 1, m - 1], -1)
        else:
            X = np.stack([self.batch_size / n, np.ones_like(n), n / m, n, m], -1)
        out = np.maximum(X @ self.theta, 1e-9)
        if measured and self.points:
            for i, key in enumerate(zip(n.astype(int).tolist(), m.astype(int).tolist())):
                seen = self.points.get(key)
                if seen:
                    out[i] = float(np.mean(seen))
        return out

    @property
    def largest_observed(self) -> int:
        """The largest device (worker) count with a measurement (0 before any)."""
        return max((n for n, _ in self.points), default=0)

    def predict(self, n: int, m: int) -> float:
        """Predicted seconds per step (inf before any point arrived)."""
        if self.theta is None:
            return float("inf")
        return max(float(speed_features(self.form, self.batch_size, n, m) @ self.theta), 1e-9)

    @property
    def mean_error(self) -> float:
        return float(np.mean(self.errors[-20:])) if self.errors else float("nan")
