"""Projector: encoder output tokens -> LLM embedding width (LayerNorm, Linear, GELU, Linear)."""
from __future__ import annotations

import jax
from flax import nnx

from omnijax.models.encoder_layers import layer_norm, linear
from omnijax.mm_config import ProjectorConfig


class Projector(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, cfg: ProjectorConfig, *, rngs: nnx.Rngs):
        hidden = cfg.hidden_dim or out_dim
        self.norm = layer_norm(in_dim, 1e-6, rngs) if cfg.norm else None
        self.fc1 = linear(in_dim, hidden, (None, "mlp"), rngs)
        self.fc2 = linear(hidden, out_dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.norm is not None:
            x = self.norm(x)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))
