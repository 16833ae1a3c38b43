"""Which global batch rows each host loads, and global arrays built from them.

A batch array is split on its first dimension over some mesh axes (the *batch axes*, e.g. ``dp, fsdp,
ep``); the other axes (``pp``, ``tp``, ``cp``...) hold replicas of the same rows. A host must load
every row of every batch shard that one of its devices holds, and nothing else. Which shards those
are depends only on the mesh's device -> process map, so it is computed here as a pure function of
that map (no devices needed; device order need not be contiguous per host): hosts that differ only in
their pp/tp coordinates load the same rows, as the data plane's "no redundant loading" rule asks.

Convention: a host's rows are the union of its shards' rows, in increasing global order; loaders
produce them in that order and :func:`put_host_rows` places them with explicit global shapes.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from omnijax.errors import ConfigError


# ------------------------------------------------------------------------------- pure host side
def shard_grid(axis_names: Sequence[str], shape: Sequence[int], batch_axes: Sequence[str]) -> np.ndarray:
    """Batch shard index held by each mesh position (array of mesh ``shape``).

    Shards are numbered row-major over ``batch_axes`` in the order given (a PartitionSpec entry
    ``("dp", "fsdp")`` makes ``dp`` the major one), as ``NamedSharding`` numbers them."""
    names = list(axis_names)
    unknown = [a for a in batch_axes if a not in names]
    if unknown:
        raise ConfigError(f"batch axes {unknown} are not mesh axes {names}")
    grid = np.zeros(tuple(shape), np.int64)
    for a in batch_axes:
        i = names.index(a)
        coord = np.arange(shape[i]).reshape([-1 if j == i else 1 for j in range(len(shape))])
        grid = grid * shape[i] + coord
    return grid


def num_shards(axis_names: Sequence[str], shape: Sequence[int], batch_axes: Sequence[str]) -> int:
    return int(np.prod([shape[list(axis_names).index(a)] for a in batch_axes], dtype=np.int64))


def host_shards(processes: np.ndarray, axis_names: Sequence[str], batch_axes: Sequence[str],
                process: int) -> np.ndarray:
    """Sorted batch shard ids that ``process``'s devices hold; ``processes`` is the mesh-shaped array of
    each device's process index."""
    grid = shard_grid(axis_names, processes.shape, batch_axes)
    return np.unique(grid[np.asarray(processes) == process])


def host_rows(processes: np.ndarray, axis_names: Sequence[str], batch_axes: Sequence[str], global_rows: int,
              process: int) -> np.ndarray:
    """Global row indices (increasing) of the batch that ``process`` must load.

    Pure: ``processes`` is the mesh-shaped device -> process map (any device order), ``batch_axes``
    the mesh axes that split the batch dimension; rows are split evenly, shard ``s`` holding rows
    ``[s*per, (s+1)*per)``."""
    n = num_shards(axis_names, processes.shape, batch_axes)
    if global_rows % n:
        raise ConfigError(f"data.batch_size={global_rows}: the layout splits the batch {n} ways "
                          f"({' x '.join(batch_axes)}); use a multiple of {n}")
    per = global_rows // n
    shards = host_shards(processes, axis_names, batch_axes, process)
    return (shards[:, None] * per + np.arange(per)[None, :]).reshape(-1)


# ------------------------------------------------------------------------------- from a sharding
def process_map(mesh: Mesh) -> np.ndarray:
    """The mesh-shaped array of each device's process index."""
    return np.vectorize(lambda d: d.process_index, otypes=[np.int64])(np.asarray(mesh.devices))


def batch_axes_of(sharding: NamedSharding) -> tuple[str, ...]:
    """Mesh axes that split dimension 0 under ``sharding`` (major first)."""
    spec = sharding.spec
    first = spec[0] if len(spec) else None
    if first is None:
        return ()
    return tuple(first) if isinstance(first, (tuple, list)) else (first,)


def sharding_rows(sharding: NamedSharding, global_rows: int, process: int | None = None) -> np.ndarray:
    """Rows of a ``global_rows`` batch that ``process`` (default: this one) loads under ``sharding``."""
    mesh = sharding.mesh
    p = jax.process_index() if process is None else process
    return host_rows(process_map(mesh), mesh.axis_names, batch_axes_of(sharding), global_rows, p)


def global_rows_of(sharding: NamedSharding, local_rows: int, process: int | None = None,
                   what: str = "the layout") -> int:
    """Global batch size when this host holds ``local_rows`` rows (its shards' rows, see module doc)."""
    mesh = sharding.mesh
    p = jax.process_index() if process is None else process
    axes = batch_axes_of(sharding)
    held = len(host_shards(process_map(mesh), mesh.axis_names, axes, p))
    total = num_shards(mesh.axis_names, tuple(mesh.devices.shape), axes)
    if held == 0 or local_rows % held:
        est = round(local_rows * total / max(held, 1))
        raise ConfigError(f"data.batch_size={est}: {what} splits the batch {total} ways "
                          f"({' x '.join(axes) or 'none'}); use a multiple of {total}"
                          + (f" (this host holds {held} shards and got {local_rows} rows)" if held != total else ""))
    return local_rows // held * total


def put_host_rows(sharding: NamedSharding, local: Any, rows: np.ndarray, global_shape: tuple[int, ...]) -> jax.Array:
    """Global array of ``global_shape`` from this host's ``rows`` (``local[i]`` is global row ``rows[i]``).

    Every device's block is cut from the rows the host holds (other dimensions are complete on every
    host), so the layout and device order do not matter; a missing row is a clear error."""
    local = np.asarray(local)
    rows = np.asarray(rows, np.int64)
    if local.shape[0] != len(rows) or tuple(local.shape[1:]) != tuple(global_shape[1:]):
        raise ConfigError(f"host rows of shape {local.shape} do not match {len(rows)} rows of a {global_shape} batch")
    order = np.argsort(rows, kind="stable")

    def block(index: tuple) -> np.ndarray:
        want = np.arange(global_shape[0])[index[0]] if index else np.arange(global_shape[0])
        pos = np.searchsorted(rows, want, sorter=order)
        pos = np.minimum(pos, len(rows) - 1)
        found = order[pos] if len(rows) else pos
        if len(rows) == 0 or np.any(rows[found] != want):
            missing = sorted(set(want.tolist()) - set(rows.tolist()))[:4]
            raise ConfigError(f"process {jax.process_index()} was not given global batch rows {missing}... that its "
                              "devices hold; load the rows omnijax.parallel.hosts.sharding_rows names")
        return local[found][(slice(None), *index[1:])]

    return jax.make_array_from_callback(tuple(global_shape), sharding, block)


def put_local(sharding: NamedSharding, local: Any, global_rows: int | None = None) -> jax.Array:
    """Global array from this host's rows (increasing global order, the rows ``sharding_rows`` names);
    the global row count is inferred from how many batch shards this host holds unless given."""
    local = np.asarray(local)
    g = global_rows_of(sharding, local.shape[0]) if global_rows is None else int(global_rows)
    rows = sharding_rows(sharding, g)
    return put_host_rows(sharding, local, rows, (g, *local.shape[1:]))


def take_rows(batch: dict, rows: np.ndarray) -> dict:
    """The given global rows of a whole host batch (every ``[B, ...]`` array)."""
    return {k: np.asarray(v)[rows] for k, v in batch.items()}


def kv_exchange(prefix: str, timeout_s: float = 900.0, keep: int = 16) -> Callable[[int, bytes], list[bytes]]:
    """`exchange(round, part) -> every process's part` (process order) over the coordination service's
    key-value store: each process writes its part of a round under `prefix/round/process` and reads the
    others'. Host memory only, no device collective, so a prefetch thread may call it while a step runs.
    A process deletes its own part `keep` rounds later (processes run in step, at most a few rounds apart).
    Every process reads every part: fine for parts of a few bytes (capacities) or tens of hosts."""
    from omnijax.jax_private import distributed

    client = distributed.global_state.client
    me, n = jax.process_index(), jax.process_count()
    if client is None or n == 1:
        raise ConfigError("kv_exchange needs a multi-process job (jax.distributed initialized)")

    def exchange(window: int, part: bytes) -> list[bytes]:
        client.key_value_set_bytes(f"{prefix}/{window}/{me}", part, allow_overwrite=True)
        out = [part if j == me else bytes(client.blocking_key_value_get_bytes(f"{prefix}/{window}/{j}",
                                                                              int(timeout_s * 1000)))
               for j in range(n)]
        if window >= keep:
            try:
                client.key_value_delete(f"{prefix}/{window - keep}/{me}")
            except Exception:  # noqa: BLE001 - already gone
                pass
        return out
    return exchange
