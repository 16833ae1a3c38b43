"""RMSNorm: the Llama/Qwen2 normalisation (no mean subtraction, no bias)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Statistics in float32 (bf16 squares lose too much), result back in x's dtype, then scaled."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, rngs: nnx.Rngs | None = None):
        del rngs  # deterministic init; the argument keeps every layer's constructor alike
        self.eps = float(eps)
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)
