"""The sharded reader: a parameter state (leaves with shardings) filled from safetensors files, every process
building only its own devices' shards (`jax.make_array_from_single_device_arrays`) from the slices those shards
need, through each tensor's layout kind (`layout.py`), so no host holds the whole model."""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from omnijax.errors import UserError
from omnijax.interop.layout import Tensor
from omnijax.interop.stacked import Stacked, leaf
from omnijax.interop.tensors import CHUNK_BYTES, TensorIndex


def _ranges(idx: tuple, shape: tuple[int, ...]) -> list[range]:
    out = []
    for s, n in zip(tuple(idx) + (slice(None),) * (len(shape) - len(idx)), shape):
        r = range(*s.indices(n))
        if r.step != 1:
            raise ValueError(f"strided shard index {s}")
        out.append(r)
    return out


def _flat_rows(ranges: list[range], shape: tuple[int, ...]) -> np.ndarray:
    grids = np.ix_(*[np.arange(r.start, r.stop) for r in ranges])
    return np.ravel_multi_index(grids, shape).reshape(-1) if shape else np.zeros(1, np.int64)


def read_part(index: TensorIndex, t: Tensor, idx: tuple, read: Callable | None = None) -> np.ndarray:
    """omnijax's array of `t` at `idx` (a shard's slices), reading only what that shard needs.

    ``read(name, rows, rest)`` returns ``tensor[rows][:, *rest]`` (default: ``index.read``); every kind
    but the conv kernels makes exactly one such request."""
    read = read or index.read
    r = _ranges(idx, t.shape)
    sl = tuple(slice(x.start, x.stop) for x in r)
    n = tuple(len(x) for x in r)
    if t.kind == "same":
        if not t.shape:
            return read(t.hf).reshape(())
        return read(t.hf, (t.offset + r[0].start, t.offset + r[0].stop), sl[1:])
    if t.kind == "reshape":
        return read(t.hf).reshape(t.shape)[sl]
    if t.kind == "linear_in":
        rows = _flat_rows(r[1:], t.shape[1:]) + t.offset
        lo, hi = int(rows.min()), int(rows.max()) + 1
        block = read(t.hf, (lo, hi), (sl[0],))
        return block[rows - lo].T.reshape(n)
    if t.kind == "linear_out":
        cols = _flat_rows(r[:-1], t.shape[:-1])
        lo, hi = int(cols.min()), int(cols.max()) + 1
        block = read(t.hf, (r[-1].start, r[-1].stop), (slice(lo, hi),))
        return block[:, cols - lo].T.reshape(n)
    if t.kind == "conv_patch":
        block = read(t.hf, (r[1].start, r[1].stop))  # [d', C, p, p]
        return block.transpose(2, 3, 1, 0).reshape(-1, n[1])[sl[0]]
    if t.kind == "conv1d":
        return read(t.hf, (r[2].start, r[2].stop), (sl[1], sl[0])).transpose(2, 1, 0)
    raise ValueError(t.kind)


def _sharding(value: Any) -> jax.sharding.Sharding:
    sharding = getattr(value, "sharding", None)
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def shard_key(idx: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple((r.start, r.stop) for r in _ranges(idx, shape))


def _check(index: TensorIndex, tensors: list[Tensor], where: str) -> None:
    missing = sorted({t.hf for t in tensors if t.hf not in index})
    if missing:
        raise UserError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the config implies, e.g. "
                        f"{', '.join(repr(m) for m in missing[:3])}")
    for t in tensors:
        info = index.info(t.hf)
        if info.shape != t.hf_shape:
            raise UserError(f"{where}: tensor {t.hf!r} in {info.file.name} has shape {list(info.shape)}, "
                            f"config.json implies {list(t.hf_shape)}")


class _Request(Exception):
    """What ``read_part`` would read, caught before any byte is read."""


def _request(index: TensorIndex, t: Tensor, idx: tuple) -> tuple | None:
    """(rows, columns) of the 2-D view of `t`'s HF tensor that the shard at `idx` reads, or None (kinds or
    ranks read otherwise)."""
    info = index.info(t.hf)
    if len(info.shape) > 2 or t.kind in ("conv_patch", "conv1d") or (t.kind == "same" and not t.shape):
        return None
    seen = []

    def record(name, rows=None, rest=()):
        seen.append(_box(info, rows, rest))
        raise _Request

    try:
        read_part(index, t, idx, record)
    except _Request:
        pass
    return seen[0] if len(seen) == 1 and seen[0] is not None else None


def _box(info: Any, rows: tuple[int, int] | None, rest: tuple) -> tuple | None:
    """``read(name, rows, rest)`` as a block of the 2-D view [rows, columns] (None: not one block)."""
    n_rows = info.shape[0] if info.shape else 1
    width = int(np.prod(info.shape[1:], dtype=np.int64)) if info.shape else 1
    if len(rest) > 1 or (rest and len(info.shape) != 2):
        return None
    cols = (0, width)
    if rest:
        a, b, step = rest[0].indices(width)
        if step != 1:
            return None
        cols = (a, max(a, b))
    return (tuple(rows) if rows is not None else (0, n_rows)), cols


def _box_reader(index: TensorIndex, blocks: dict | None = None) -> Callable:
    """A ``read`` for ``read_part`` that reads only the requested block of a 2-D (or 1-D) tensor, or takes it
    from ``blocks`` (``{(rows, columns): array}``, filled ahead by ``_fill_boxes``)."""
    def read(name, rows=None, rest=()):
        info = index.info(name)
        box = _box(info, rows, rest) if info.shape and len(info.shape) <= 2 else None
        if box is None:
            return index.read(name, rows, rest)
        (r0, r1), (c0, c1) = box
        out = blocks.get(box) if blocks else None
        if out is None:
            out = index.read_box(name, (r0, r1), (c0, c1))
        return out.reshape((r1 - r0,) + ((c1 - c0,) if rest else info.shape[1:]))
    return read


def _fill_boxes(index: TensorIndex, name: str, boxes: list[tuple]) -> dict:
    """{box: array} for blocks (rows, columns) of one tensor, reading their union once: band by band of rows
    (between the boxes' edges), each band's merged column intervals in pieces of bounded size, each piece
    copied into every box it overlaps. Several local shards that split a row's columns share one read of it."""
    info = index.info(name)
    out = {box: np.empty((box[0][1] - box[0][0], box[1][1] - box[1][0]), info.dtype) for box in boxes}
    cuts = sorted({e for (r, _) in boxes for e in r})
    for a, b in zip(cuts, cuts[1:]):
        inside = [box for box in boxes if box[0][0] <= a and b <= box[0][1] and box[1][1] > box[1][0]]
        merged: list[list[int]] = []
        for c0, c1 in sorted(box[1] for box in inside):
            if merged and c0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], c1)
            else:
                merged.append([c0, c1])
        for c0, c1 in merged:
            step = max(1, CHUNK_BYTES // max(1, (c1 - c0) * info.dtype.itemsize))
            for ra in range(a, b, step):
                rb = min(b, ra + step)
                piece = index.read_box(name, (ra, rb), (c0, c1))
                for (r, c) in inside:
                    lo, hi = max(c[0], c0), min(c[1], c1)
                    if lo < hi:
                        out[r, c][ra - r[0]: rb - r[0], lo - c[0]: hi - c[0]] = piece[:, lo - c0: hi - c0]
    return out


def _read(index: TensorIndex, t: Tensor | Stacked, idx: tuple, read: Callable | None = None) -> np.ndarray:
    if isinstance(t, Tensor):
        return read_part(index, t, idx, read or _box_reader(index))
    r = _ranges(idx, t.shape)
    rest = tuple(idx)[3:]
    read = _box_reader(index)  # each layer's block of this shard only
    return np.stack([np.stack([np.stack([read_part(index, t.layers[s_, q, j], rest, read) for j in r[2]])
                               for q in r[1]]) for s_ in r[0]])


def _build(index: TensorIndex, t: Tensor | Stacked, dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """One global array of `t` in `sharding`, built from this process's device shards one at a time (each
    put on its device and dropped before the next). A plain tensor's blocks for all of this host's shards
    are filled first from their union (each byte read once, none outside it: several local devices that
    split a row's columns share one read of the row); host memory holds this host's share of one tensor
    beyond the devices', each block dropped once its shard is made. A pipelined stack reads each shard's
    own block of every layer."""
    per_device = sharding.addressable_devices_indices_map(t.shape)
    keys = {d: shard_key(idx, t.shape) for d, idx in per_device.items()}
    left = {k: list(keys.values()).count(k) for k in set(keys.values())}
    cache: dict = {}
    shards = []
    read, filled, box_of = None, {}, {}
    if isinstance(t, Tensor):  # this host's blocks of the tensor read together: each byte once
        first = {keys[d]: idx for d, idx in per_device.items()}
        box_of = {k: _request(index, t, idx) for k, idx in first.items()}
        if box_of and all(b is not None for b in box_of.values()):
            filled = _fill_boxes(index, t.hf, sorted(set(box_of.values())))
            read = _box_reader(index, filled)
    for device, idx in per_device.items():
        key = keys[device]
        if key not in cache:  # replicas of one shard on this host are read once
            cache[key] = np.asarray(_read(index, t, idx, read), dtype=dtype)
            if read is not None and not any(box_of[k] == box_of[key] for k in left if k != key and left[k]):
                filled.pop(box_of[key], None)  # its block is in the shard now
        shards.append(jax.device_put(cache[key], device))
        left[key] -= 1
        if not left[key]:
            jax.block_until_ready(shards[-1])
            del cache[key]
    return jax.make_array_from_single_device_arrays(t.shape, sharding, shards)


def load_params(index: TensorIndex, tensors: list[Tensor], target: Any, where: str) -> nnx.State:
    """`target` (Param state, leaves with shardings) filled from `index`, each process reading its shards only.

    A pipelined LLM's stacked blocks (`stages/...`, [stage, repeat, layer, ...]) are read layer by layer
    into the stack, each device taking the layers of its own stage."""
    flat = list(nnx.to_flat_state(target)) if isinstance(target, nnx.State) else list(
        nnx.to_flat_state(nnx.State(target)))
    by_path = {t.path: t for t in tensors}
    wanted: list[Tensor | Stacked] = []
    for path, var in flat:
        path = tuple(path)
        if path in by_path:
            wanted.append(by_path[path])
        elif path and path[0] == "stages" and len(leaf(var).shape) >= 3:
            wanted.append(Stacked.of(path, tuple(leaf(var).shape), by_path))
        else:
            raise UserError(f"{where}: target parameter {'/'.join(map(str, path))} has no tensor in this "
                            "checkpoint format")
    _check(index, [u for w in wanted for u in (w.layers.values() if isinstance(w, Stacked) else [w])], where)
    out = []
    for (path, var), t in zip(flat, wanted):
        value = leaf(var)
        expect = t.shape if isinstance(t, Tensor) else t.shape[:3] + next(iter(t.layers.values())).shape
        if tuple(value.shape) != expect:
            raise UserError(f"{where}: target parameter {'/'.join(map(str, path))} has shape {list(value.shape)}, "
                            f"the checkpoint's config implies {list(expect)}")
        arr = _build(index, t, np.dtype(value.dtype), _sharding(value))
        out.append((path, var.replace(arr) if isinstance(var, nnx.Variable) else arr))
    return nnx.from_flat_state(out)
