"""A small flax NNX MLP classifier: the tiny real model of the PS backend and the staleness benchmark.

Sized by config so the same class is a 10k-parameter test model (load_digits, 64 features) or a
multi-million-parameter model whose transfer cost dominates a parameter-server step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from omnijax.errors import ConfigError


@dataclass
class ClassifierConfig:
    in_dim: int = 64
    hidden: list[int] = field(default_factory=lambda: [64, 64])
    num_classes: int = 10


class Classifier(nnx.Module):
    """MLP: Linear -> gelu -> ... -> Linear logits. Params carry logical axis names only."""

    def __init__(self, cfg: ClassifierConfig, *, rngs: nnx.Rngs):
        if cfg.in_dim <= 0 or cfg.num_classes <= 1 or any(h <= 0 for h in cfg.hidden):
            raise ConfigError(f"classifier: in_dim, hidden sizes must be > 0 and num_classes > 1, got {cfg}")
        dims = [cfg.in_dim, *cfg.hidden, cfg.num_classes]
        self.layers = nnx.List([
            nnx.Linear(a, b, rngs=rngs,
                       kernel_metadata={"out_sharding": ("embed", "mlp")},
                       bias_metadata={"out_sharding": ("mlp",)})
            for a, b in zip(dims[:-1], dims[1:])
        ])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def classifier_loss(model: Classifier, batch: dict) -> jax.Array:
    """Mean softmax cross-entropy of `batch["x"]` (float [B, in_dim]) against `batch["y"]` (int [B])."""
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def accuracy(model: Classifier, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def build_classifier(cfg: ClassifierConfig, seed: int = 0) -> Classifier:
    """Module-level factory (picklable with functools.partial) for remote workers."""
    return Classifier(cfg, rngs=nnx.Rngs(seed))
