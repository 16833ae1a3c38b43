"""Per-segment reductions that give the same answer however a packed buffer is split over devices.

Encoders see packed buffers of many segments (images, clips). Under sequence parallelism one long
segment is split over a group of devices (an `esp` group); a reduction over a segment's rows (its
grid extent, an attention-pooled vector) must then combine the group's parts, or each device sees
only its own chunk. Parallel code names the group's mesh axes with `use_sequence_group(axes)` while
tracing the encoder (inside `shard_map`); model code calls `segment_max` / `merge_partial_softmax`
and stays free of mesh logic. Segment ids are compared by value only (never used as table indices),
so they may be any non-negative integers, unique per segment across the group (0 = padding).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

_GROUP: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("omnijax_sequence_group", default=())


@contextlib.contextmanager
def use_sequence_group(axes: tuple[str, ...] | str) -> Iterator[None]:
    """Trace the enclosed forward with segments split over the mesh axes `axes` (inside shard_map)."""
    token = _GROUP.set((axes,) if isinstance(axes, str) else tuple(axes))
    try:
        yield
    finally:
        _GROUP.reset(token)


def sequence_group() -> tuple[str, ...]:
    """The mesh axes the current buffer's segments are split over (() = the buffer is whole)."""
    return _GROUP.get()


def _local_segment_max(segment_ids: jax.Array, values: jax.Array) -> jax.Array:
    """values [N, ...] -> for each row, the max of `values` over the rows with its segment id.

    Sort-based (ids relabelled by rank after a stable sort), so memory is linear in N and any id
    values work, not only ids below N."""
    n = segment_ids.shape[0]
    ids = segment_ids.astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    rank = jnp.cumsum(starts.astype(jnp.int32)) - 1
    maxima = jax.ops.segment_max(values[order], rank, num_segments=n, indices_are_sorted=True)
    return jnp.zeros_like(values).at[order].set(maxima[rank])


def segment_max(segment_ids: jax.Array, values: jax.Array) -> jax.Array:
    """Per row, the max of `values` [N, ...] over every row of the same segment, group-wide.

    Inside `use_sequence_group(axes)` the rows of all devices of the group count (their ids and values
    are gathered, N x group rows of integers per call); outside, only this buffer's."""
    axes = sequence_group()
    if not axes:
        return _local_segment_max(segment_ids, values)
    n = segment_ids.shape[0]
    all_ids = jax.lax.all_gather(segment_ids, axes, axis=0, tiled=True)
    all_values = jax.lax.all_gather(values, axes, axis=0, tiled=True)
    out = _local_segment_max(all_ids, all_values)
    return jax.lax.dynamic_slice_in_dim(out, jax.lax.axis_index(axes) * n, n, axis=0)


def segment_extent(segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """[N, A] grid extent (max coordinate + 1, at least 1) of each row's segment, group-wide."""
    return jnp.maximum(segment_max(segment_ids, positions) + 1, 1)


def merge_partial_softmax(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Combine softmax-attention results over disjoint key sets held by the group's devices.

    out [..., H, Dh] and lse [..., H] (log of each part's softmax denominator, -inf where a part saw
    no key) -> the attention over the union of the keys, the same on every device of the group.
    Outside a group the input is returned as is."""
    axes = sequence_group()
    if not axes:
        return out
    m = jax.lax.stop_gradient(jax.lax.pmax(jnp.where(jnp.isfinite(lse), lse, -jnp.inf), axes))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m), 0.0)
    num = jax.lax.psum(out.astype(jnp.float32) * w[..., None], axes)
    den = jax.lax.psum(w, axes)
    return (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(out.dtype)
