"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, embed_dim: int, mlp_dim: int, *, rngs: nnx.Rngs):
        def init(shape, fan_in):
            return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)

        self.gate = nnx.Param(init((embed_dim, mlp_dim), embed_dim), out_sharding=("embed", "mlp"))
        self.up = nnx.Param(init((embed_dim, mlp_dim), embed_dim), out_sharding=("embed", "mlp"))
        self.down = nnx.Param(init((mlp_dim, embed_dim), mlp_dim), out_sharding=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        h = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))
        return h @ self.down[...].astype(dt)
