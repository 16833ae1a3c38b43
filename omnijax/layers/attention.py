"""Grouped-query attention over packed buffers.

`dot_product_attention` is a pure function: which key a query may see is decided only by segment ids
(same non-zero document) and positions (causality), never by buffer index. Context-parallel attention
can therefore call it on any permuted/sharded layout and merge partial results with the returned
log-sum-exp.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.layers import rope


def attention_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, q_positions: jax.Array,
                   kv_positions: jax.Array, causal: bool = True) -> jax.Array:
    """[B, Lq, Lk] bool: same non-zero segment and (not causal or kv_pos <= q_pos)."""
    mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
    if causal:
        mask &= kv_positions[:, None, :] <= q_positions[:, :, None]
    return mask


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                          kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                          causal: bool = True, scale: float | None = None, return_lse: bool = False):
    """Masked softmax attention; q [B, Lq, H, Dh], k/v [B, Lk, KVH, Dh], H a multiple of KVH.

    Query head h uses kv head h // (H // KVH). Scores, softmax and the normaliser are float32; the
    output has q's dtype. Rows with no visible key return 0 (and lse = -inf), never NaN.
    With return_lse=True also returns lse [B, Lq, H] (float32), log of the softmax denominator, so
    partial results over disjoint key sets merge as sum_i exp(lse_i - lse) * out_i.
    """
    b, lq, h, dh = q.shape
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    g = h // kvh
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    qg = q.reshape(b, lq, kvh, g, dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(scores - m)  # exp(-inf) = 0 for masked keys, with zero gradient
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    safe = jnp.where(denom > 0, denom, 1.0)  # [B, KVH, G, Lq, 1]
    out = out / jnp.moveaxis(safe, 3, 1)  # [B, Lq, KVH, G, 1]
    out = out.reshape(b, lq, h, dh).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(denom > 0, jnp.log(safe) + m, -jnp.inf)[..., 0]  # [B, KVH, G, Lq]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, lq, h)


_ATTENTION: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("omnijax_attention", default=None)


@contextlib.contextmanager
def use_attention(fn: Callable) -> Iterator[None]:
    """Trace the enclosed forward with `fn` in place of `dot_product_attention` (same signature).

    Parallel code swaps in distributed attention (e.g. sequence parallelism inside an encoder) this
    way, so model code stays free of mesh logic."""
    token = _ATTENTION.set(fn)
    try:
        yield
    finally:
        _ATTENTION.reset(token)


def attention_fn() -> Callable:
    """The attention in force: `dot_product_attention` unless `use_attention` says otherwise."""
    return _ATTENTION.get() or dot_product_attention


def _kernel(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)


class Attention(nnx.Module):
    """q/k/v/o projections with per-head shapes (so heads shard on their own logical axis) + RoPE."""

    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs):
        d, h, kvh, dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = nnx.Param(_kernel(rngs, (d, h, dh), d), out_sharding=("embed", "heads", "head_dim"))
        self.k = nnx.Param(_kernel(rngs, (d, kvh, dh), d), out_sharding=("embed", "kv_heads", "head_dim"))
        self.v = nnx.Param(_kernel(rngs, (d, kvh, dh), d), out_sharding=("embed", "kv_heads", "head_dim"))
        self.o = nnx.Param(_kernel(rngs, (h, dh, d), h * dh), out_sharding=("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, dh), jnp.float32), out_sharding=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((kvh, dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((kvh, dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        inv_freq, rope_scale = rope.inv_frequencies(dh, cfg.rope)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a compile-time constant
        self.rope_scale = rope_scale

    def project_qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, D] -> rotated q [B, L, H, Dh], rotated k and v [B, L, KVH, Dh]."""
        dt = x.dtype
        q = jnp.einsum("bld,dhk->blhk", x, self.q[...].astype(dt))
        k = jnp.einsum("bld,dhk->blhk", x, self.k[...].astype(dt))
        v = jnp.einsum("bld,dhk->blhk", x, self.v[...].astype(dt))
        if self.q_bias is not None:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        q = rope.apply_rope(q, positions, self.inv_freq, self.rope_scale)
        k = rope.apply_rope(k, positions, self.inv_freq, self.rope_scale)
        return q, k, v

    def output(self, attn: jax.Array) -> jax.Array:
        return jnp.einsum("blhk,hkd->bld", attn, self.o[...].astype(attn.dtype))

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v = self.project_qkv(x, positions)
        attn = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                     q_positions=positions, kv_positions=positions, causal=True)
        return self.output(attn)
