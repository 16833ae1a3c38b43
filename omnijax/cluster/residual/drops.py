"""Loss-drop detection: the step where a learning-rate decay showed as a sudden drop in a job's loss
curve, which the fitted form 1/(a·k + b) + c reads as a job far from done."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

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
