"""M-RoPE: the 3-D rotary positions of Qwen2-VL / Qwen2.5-VL's LLM.

Every token carries three rotary positions (temporal, height, width); `mrope_section` splits the head's
rotary pairs into three runs, the first turned by the temporal position, the next by the height, the last
by the width ("rotate half" layout, as the Qwen2 weights are stored). Text tokens have all three equal, so
text alone is plain RoPE. Vision tokens of an image start where the text before them stopped and spread
over the merged patch grid; the text after continues past the grid (the rule of transformers'
`get_rope_index`, computed on the host from a sample's metadata: `omnijax.data.qwen_processor.rope_index`).

Causality is *not* decided by these positions (an image's tokens share a temporal position): the LLM keeps
its ordinary per-token `positions` (0..n-1 within a document) for the mask, and these `rope_positions`
[B, L, 3] travel beside them, per token and segment-local, through packing; nothing recomputes them from
the row index.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.errors import ConfigError
from omnijax.layers.attention import cached_decode, dot_product_attention


def section_table(inv_freq: Sequence[float], section: Sequence[int]) -> np.ndarray:
    """[3, pairs] inverse frequencies, row a non-zero only on the pairs of axis a's section."""
    inv = np.asarray(inv_freq, np.float32)
    if len(section) != 3 or sum(section) != inv.shape[0] or min(section) < 0:
        raise ConfigError(f"model.llm.rope.mrope_section={list(section)}: three non-negative runs summing to "
                          f"head_dim/2={inv.shape[0]}")
    table = np.zeros((3, inv.shape[0]), np.float32)
    start = 0
    for axis, n in enumerate(section):
        table[axis, start:start + n] = inv[start:start + n]
        start += n
    return table


def apply_mrope(x: jax.Array, rope_positions: jax.Array, table: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotate x [B, L, H, Dh] by angles sum_a rope_positions[..., a] * table[a] ([B, L, 3] positions)."""
    angles = jnp.einsum("bla,ap->blp", rope_positions.astype(jnp.float32), jnp.asarray(table))
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def project_qkv(attn, x: jax.Array, rope_positions: jax.Array, section: Sequence[int]):
    """`Attention.project_qkv` with M-RoPE: the same parameters and projections, q/k turned by
    `rope_positions` [B, L, 3]."""
    dt = x.dtype
    q = jnp.einsum("bld,dhk->blhk", x, attn.q[...].astype(dt))
    k = jnp.einsum("bld,dhk->blhk", x, attn.k[...].astype(dt))
    v = jnp.einsum("bld,dhk->blhk", x, attn.v[...].astype(dt))
    if attn.q_bias is not None:
        q, k, v = q + attn.q_bias[...].astype(dt), k + attn.k_bias[...].astype(dt), v + attn.v_bias[...].astype(dt)
    table = section_table(attn.inv_freq, section)
    return apply_mrope(q, rope_positions, table, attn.rope_scale), apply_mrope(k, rope_positions, table,
                                                                                 attn.rope_scale), v


def attention(attn, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, rope_positions: jax.Array,
              section: Sequence[int]) -> jax.Array:
    """`omnijax.layers.attention.Attention`'s forward with M-RoPE: the causal mask from `positions` [B, L]."""
    q, k, v = project_qkv(attn, x, rope_positions, section)
    out = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                q_positions=positions, kv_positions=positions, causal=True, impl=attn.impl)
    return attn.output(out)


def prefill(attn, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, rope_positions: jax.Array,
            section: Sequence[int], cache_k: jax.Array, cache_v: jax.Array):
    """`Attention.prefill` with M-RoPE: the prompt's attention and its k/v (turned) in cache slots [0, L)."""
    q, k, v = project_qkv(attn, x, rope_positions, section)
    out = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                q_positions=positions, kv_positions=positions, causal=True, impl=attn.impl)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, 0, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, 0, 0, 0))
    return attn.output(out), cache_k, cache_v


def decode(attn, x: jax.Array, positions: jax.Array, rope_positions: jax.Array, section: Sequence[int],
           cache_k: jax.Array, cache_v: jax.Array):
    """`Attention.decode` with M-RoPE: one token per row x [B, 1, D] into cache slot `positions` [B], turned by
    `rope_positions` [B, 3] (a generated token is text: its three positions are equal)."""
    q, k, v = project_qkv(attn, x, rope_positions[:, None, :], section)
    out, cache_k, cache_v = cached_decode(q, k, v, positions, cache_k, cache_v)
    return attn.output(out), cache_k, cache_v
