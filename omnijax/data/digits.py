"""scikit-learn's bundled handwritten digits (1,797 8x8 images): real data with no download, for the
parameter-server recipe and the cluster executor's PS jobs."""
from __future__ import annotations

import numpy as np


def digits_split(seed: int = 1234):
    """load_digits (1,797 images, bundled with scikit-learn) scaled to [0, 1]; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


class DigitsBatches:
    """Worker `w` at step `s` draws its own batch: a pure function of (seed, step, worker)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, seed: int):
        self.x, self.y, self.batch, self.seed = x, y, batch, seed

    def __call__(self, step: int, worker: int, num_workers: int) -> dict:
        idx = np.random.default_rng((self.seed, step, worker)).integers(0, len(self.x), self.batch)
        return {"x": self.x[idx], "y": self.y[idx]}
