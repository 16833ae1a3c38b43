"""M-RoPE: the 3-D rotary positions of Qwen2-VL / Qwen2.5-VL's LLM.

Every token carries three rotary positions (temporal, height, width); `mrope_section` splits the head's
rotary pairs into three runs, the first turned by the temporal position, the next by the height, the last
by the width ("rotate half" layout, as the Qwen2 weights are stored). Text tokens have all three equal, so
text alone is plain RoPE. Vision tokens of an image start where the text before them stopped and spread
over the merged patch grid; the text after continues past the grid (`rope_index`, the rule of transformers'
`get_rope_index`).

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


def decode_delta(rope_positions: np.ndarray, length: int) -> int:
    """What a generated token adds to its cache slot to get its (equal) rope positions: max(prompt's) + 1 -
    prompt length (transformers' `rope_deltas`)."""
    return int(np.max(rope_positions[:length])) + 1 - int(length) if length else 0


# ------------------------------------------------------------------------ positions (host side)
def vision_positions(start: int, grid: tuple[int, int, int], merge: int, interval: float = 1.0) -> np.ndarray:
    """[t * h/m * w/m, 3] positions of one image's or video's LLM tokens, (t, h, w) row-major."""
    t, h, w = (int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge)
    temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64) + start
    tt, hh, ww = np.meshgrid(temporal, np.arange(h) + start, np.arange(w) + start, indexing="ij")
    return np.stack([tt, hh, ww], axis=-1).reshape(-1, 3)


def rope_index(segments: Sequence[tuple], merge: int = 2, tokens_per_second: float = 2.0) -> np.ndarray:
    """M-RoPE positions [n, 3] (int32) of one sample from its segments in order:
    ("text", n_tokens) | ("image", (t, h, w)) | ("video", (t, h, w), seconds_per_temporal_patch).

    Grids are in patches (before merging). Text continues from the running position; an image/video starts
    there, its temporal positions stepping by tokens_per_second * seconds per temporal patch (Qwen2.5-VL's
    videos) or 1 (images; Qwen2-VL, tokens_per_second 0), and moves the running position by max(h, w) / merge,
    as transformers' `get_rope_index` does."""
    parts, cur = [], 0
    for seg in segments:
        kind = seg[0]
        if kind == "text":
            n = int(seg[1])
            parts.append(np.repeat((np.arange(n) + cur)[:, None], 3, axis=1))
            cur += n
        elif kind in ("image", "video"):
            grid = tuple(int(g) for g in seg[1])
            interval = 1.0  # images; Qwen2-VL's videos (tokens_per_second 0): one step per temporal patch
            if kind == "video" and tokens_per_second > 0:
                interval = tokens_per_second * (float(seg[2]) if len(seg) > 2 else 1.0)
            parts.append(vision_positions(cur, grid, merge, interval))
            cur += max(grid[1], grid[2]) // merge
        else:
            raise ValueError(f"unknown segment kind {kind!r}")
    if not parts:
        return np.zeros((0, 3), np.int32)
    return np.concatenate(parts, axis=0).astype(np.int32)
