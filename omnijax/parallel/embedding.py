"""Embedding lookup on a sharded table that moves token ids and rows, never the table.

The table stays in its parameter layout (rows split over the ``vocab`` mesh axes, columns over the
``embed`` ones, e.g. FSDP). Inside one ``shard_map``:

1. every device gathers the token ids of the batch shards that share its table columns (and vocab
   rows) — integers, a few KB;
2. it looks up the ids that fall in its vocab range, in its columns, and writes zeros elsewhere;
3. partial rows are summed over the vocab axes (``psum``, or ``psum_scatter`` where the vocab axis also
   splits the batch) and the columns are sent back to the devices that own each batch row
   (``all_to_all``: the rows of a batch shard, not the table).

The transpose is the same traffic in reverse: the table's gradient is formed locally in its own shard
(a scatter-add), so no full-size table gradient is ever all-reduced.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(spec: P, i: int) -> tuple[str, ...]:
    return _axes(spec[i]) if i < len(spec) else ()


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis a PartitionSpec names, in order."""
    return tuple(a for i in range(len(spec)) for a in _entry(spec, i))


def can_shard_lookup(table_spec: P, ids_spec: P) -> bool:
    """True when the sharded lookup applies: every axis that splits the table's columns also splits the
    batch (so whole rows can be sent back to their batch shard by an all-to-all)."""
    cols, batch = _entry(table_spec, 1), _entry(ids_spec, 0)
    return bool(_entry(table_spec, 0) or cols) and set(cols) <= set(batch)


def local_lookup(tab: jax.Array, tok: jax.Array, *, mesh: Mesh, table_spec: P, ids_spec: P) -> jax.Array:
    """Per device, inside a ``shard_map`` that is manual over the table's and the ids' axes: this device's
    table block and ids in, this device's rows ``[b, l, D]`` out (the body of :func:`sharded_lookup`)."""
    vocab_axes, col_axes, batch_axes = _entry(table_spec, 0), _entry(table_spec, 1), _entry(ids_spec, 0)
    vocab_in_batch = tuple(a for a in vocab_axes if a in batch_axes)
    vocab_only = tuple(a for a in vocab_axes if a not in batch_axes)
    rows_per_shard = tab.shape[0]
    # ids of every batch shard that shares this device's columns, then its vocab rows
    if col_axes:
        tok = jax.lax.all_gather(tok, col_axes, axis=0, tiled=True)
    if vocab_in_batch:
        tok = jax.lax.all_gather(tok, vocab_in_batch, axis=0, tiled=True)
    shard = jnp.zeros((), jnp.int32)
    for a in vocab_axes:  # this device's vocab shard, in the spec's (outer-first) order
        shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
    local = tok - shard * rows_per_shard
    hit = (local >= 0) & (local < rows_per_shard)
    rows = jnp.take(tab, jnp.where(hit, local, 0), axis=0)
    rows = jnp.where(hit[..., None], rows, jnp.zeros((), rows.dtype))
    if vocab_in_batch:
        rows = jax.lax.psum_scatter(rows, vocab_in_batch, scatter_dimension=0, tiled=True)
    if vocab_only:
        rows = jax.lax.psum(rows, vocab_only)
    if col_axes:  # [B_group, l, D/c] -> [b, l, D]: each device gets its own rows, every column
        rows = jax.lax.all_to_all(rows, col_axes, 0, rows.ndim - 1, tiled=True)
    return rows


def sharded_lookup(table: jax.Array, ids: jax.Array, *, mesh: Mesh, table_spec: P, ids_spec: P) -> jax.Array:
    """``jnp.take(table, ids, axis=0)`` for a ``[V, D]`` table laid out as ``table_spec`` and ``[B, L]`` ids
    laid out as ``ids_spec``; the result ``[B, L, D]`` is laid out as ``P(*ids_spec, None)``.

    Ids outside ``[0, V)`` give zero rows. Needs ``can_shard_lookup(table_spec, ids_spec)``."""
    if not can_shard_lookup(table_spec, ids_spec):
        raise ValueError(f"sharded_lookup: table spec {table_spec} vs ids spec {ids_spec}: every column axis must "
                         "also split the batch")

    def body(tab: jax.Array, tok: jax.Array) -> jax.Array:
        return local_lookup(tab, tok, mesh=mesh, table_spec=table_spec, ids_spec=ids_spec)

    out_spec = P(*ids_spec, *([None] * (ids.ndim + 1 - len(ids_spec))))
    return jax.shard_map(body, mesh=mesh, in_specs=(table_spec, ids_spec), out_specs=out_spec)(table, ids)
