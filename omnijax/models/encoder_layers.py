"""Building blocks shared by the vision and audio encoders (pre-LayerNorm ViT blocks).

Encoders see one packed buffer [N, D] of many images/clips; attention is bidirectional inside a
segment (segment ids, 0 = padding) via the LLM's `dot_product_attention` (or the attention that
`omnijax.layers.attention.use_attention` puts in force, e.g. sequence-parallel). Positions are (t, h, w)
grid coordinates; multi-axis rotary embeddings (each axis owns a slice of the rotary pairs) make any
grid size work without a learned table.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.layers import remat
from omnijax.layers.attention import attention_fn


def rope_sections(pairs: int, axes: int) -> tuple[int, ...]:
    """Rotary pairs per position axis: 1 axis gets all; 3 axes (t, h, w) give t a quarter, h/w the rest."""
    if axes == 1:
        return (pairs,)
    if axes == 3:
        t = pairs // 4
        h = (pairs - t + 1) // 2
        return (t, h, pairs - t - h)
    raise ValueError(f"rope over {axes} axes is not supported (1 or 3)")


def rope_inv_freq(head_dim: int, axes: int, theta: float) -> np.ndarray:
    """[axes, pairs] inverse frequencies, zero outside each axis's section (host-side constant)."""
    pairs = head_dim // 2
    table = np.zeros((axes, pairs), np.float32)
    start = 0
    for a, n in enumerate(rope_sections(pairs, axes)):
        table[a, start:start + n] = 1.0 / theta ** (np.arange(n, dtype=np.float32) / max(n, 1))
        start += n
    return table


def as_static(table: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """A host table as nested tuples: a hashable module attribute that jit treats as a constant."""
    return tuple(tuple(float(v) for v in row) for row in np.asarray(table))


def apply_rope_nd(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, L, H, Dh] ("rotate half" layout) by angles sum_a positions[..., a] * inv_freq[a]."""
    angles = jnp.einsum("bla,ap->blp", positions.astype(jnp.float32), jnp.asarray(np.asarray(inv_freq, np.float32)))
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)


def layer_norm(dim: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, epsilon=eps, rngs=rngs, scale_metadata={"out_sharding": ("embed",)},
                         bias_metadata={"out_sharding": ("embed",)})


def linear(d_in: int, d_out: int, axes: tuple[str | None, str | None], rngs: nnx.Rngs,
           bias: bool = True) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, rngs=rngs,
                      kernel_init=jax.nn.initializers.normal(1.0 / math.sqrt(d_in)),
                      kernel_metadata={"out_sharding": axes}, bias_metadata={"out_sharding": (axes[1],)})


class SelfAttention(nnx.Module):
    """Bidirectional multi-head attention with biases (ViT/SigLIP style), per-head parameter shapes."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs, attention: str = "auto"):
        dh = dim // heads
        self.heads, self.head_dim = heads, dh
        self.impl = attention  # static: attention implementation (omnijax.layers.attention)
        for name in ("q", "k", "v"):
            setattr(self, name, nnx.Param(_normal(rngs, (dim, heads, dh), dim), out_sharding=("embed", "heads", "head_dim")))
            setattr(self, name + "_bias", nnx.Param(jnp.zeros((heads, dh), jnp.float32), out_sharding=("heads", "head_dim")))
        self.o = nnx.Param(_normal(rngs, (heads, dh, dim), dim), out_sharding=("heads", "head_dim", "embed"))
        self.o_bias = nnx.Param(jnp.zeros((dim,), jnp.float32), out_sharding=("embed",))

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
                 inv_freq: np.ndarray | None) -> jax.Array:
        """x [B, L, D], segment_ids [B, L], positions [B, L, A] -> [B, L, D]."""
        dt = x.dtype
        q, k, v = (jnp.einsum("bld,dhk->blhk", x, getattr(self, n)[...].astype(dt)) + getattr(self, n + "_bias")[...].astype(dt)
                   for n in ("q", "k", "v"))
        if inv_freq is not None:
            q, k = apply_rope_nd(q, positions, inv_freq), apply_rope_nd(k, positions, inv_freq)
        flat = jnp.zeros(segment_ids.shape, jnp.int32)  # non-causal: positions only matter for rope
        out = attention_fn()(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                             q_positions=flat, kv_positions=flat, causal=False, impl=self.impl)
        return jnp.einsum("blhk,hkd->bld", out, self.o[...].astype(dt)) + self.o_bias[...].astype(dt)


class GeluMLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.fc1 = linear(dim, hidden, ("embed", "mlp"), rngs)
        self.fc2 = linear(hidden, dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class EncoderBlock(nnx.Module):
    """x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, eps: float, *, rngs: nnx.Rngs, attention: str = "auto"):
        self.ln1 = layer_norm(dim, eps, rngs)
        self.attn = SelfAttention(dim, heads, rngs=rngs, attention=attention)
        self.ln2 = layer_norm(dim, eps, rngs)
        self.mlp = GeluMLP(dim, mlp_dim, rngs=rngs)

    def __call__(self, x, segment_ids, positions, inv_freq):
        x = x + self.attn(self.ln1(x), segment_ids, positions, inv_freq)
        return x + self.mlp(self.ln2(x))


def compute_dtype(param: nnx.Variable) -> jnp.dtype:
    """The dtype an encoder computes in: its parameters' (the trainer casts fp32 masters to
    `trainer.compute_dtype` before the forward, as for the LLM), inputs are cast to it on entry."""
    return param[...].dtype


def run_blocks(blocks, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """The encoder's blocks in order, each rematerialised as `parallel.remat` says
    (`omnijax.layers.remat.use_remat`, entered by the placement while tracing)."""
    for block in blocks:
        x = remat.run_checkpointed(block, x, segment_ids, positions, static=(inv_freq,))
    return x


def transformer_flops(n: int, dim: int, mlp_dim: int, layers: int) -> float:
    """Forward FLOPs of `layers` blocks over one segment of n tokens (linear + quadratic attention)."""
    linear_flops = 2.0 * n * (4 * dim * dim + 2 * dim * mlp_dim)
    attention_flops = 4.0 * n * n * dim
    return layers * (linear_flops + attention_flops)
