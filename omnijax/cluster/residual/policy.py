"""The learned scheduler's policy network: per-job features -> log-scales of the ranking key and beta,
plus node-scoring weights; numpy, one flat parameter vector (evolution strategies perturb it directly)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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

    def split(self, theta: np.ndarray):
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
        W1, b1, L, _, W2, b2 = self.split(theta)
        return np.tanh(x @ W1 + b1) @ W2 + x @ L + b2

    def node_weights(self, theta: np.ndarray) -> np.ndarray:
        return self.split(theta)[3]
