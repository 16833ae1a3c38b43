"""Parameters as one flat fp32 vector cut into blocks (the unit servers own) and chunks (the unit sent).

The flat order is the forward order (the tensor the forward reads first comes first), found from the
jaxpr of the loss, so block index = priority: low blocks are pushed first and are updated, and pulled,
first. A block is a contiguous slice and may span several tensors; a big tensor spans several blocks.
Every server therefore applies the optimizer to 1-D slices, which is exact for element-wise optax
transformations (sgd, momentum, adam/adamw without masks) and is the contract of this backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from omnijax.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    """One parameter tensor inside the flat vector."""
    path: str
    shape: tuple[int, ...]
    dtype: str
    leaf: int      # index among the pytree leaves (tree order)
    offset: int    # start inside the flat vector (priority order)
    size: int


@dataclass(frozen=True)
class Block:
    """A contiguous slice [start, stop) of the flat vector; `index` is also its priority (0 first)."""
    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return 4 * self.size


@dataclass(frozen=True)
class ParamLayout:
    entries: tuple[Entry, ...]
    treedef: Any
    total: int

    def flatten(self, params: Any) -> np.ndarray:
        """Pytree of arrays -> flat float32 numpy vector in priority order."""
        leaves = jax.tree_util.tree_leaves(params)
        if len(leaves) != len(self.entries):
            raise ValueError(f"expected {len(self.entries)} parameter leaves, got {len(leaves)}")
        out = np.empty(self.total, np.float32)
        for e in self.entries:
            out[e.offset:e.offset + e.size] = np.asarray(leaves[e.leaf], np.float32).reshape(-1)
        return out

    def unflatten(self, flat: jax.Array) -> Any:
        """Flat vector -> pytree with the original shapes and dtypes (traceable under jit)."""
        leaves: list[Any] = [None] * len(self.entries)
        for e in self.entries:
            leaves[e.leaf] = flat[e.offset:e.offset + e.size].reshape(e.shape).astype(e.dtype)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def forward_order(fn: Callable[[Any], Any], params: Any) -> list[int]:
    """Leaf indices of `params` in the order the traced `fn(params)` first reads them.

    Leaves `fn` never reads go last, in tree order."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    closed = jax.make_jaxpr(lambda ls: fn(jax.tree_util.tree_unflatten(treedef, ls)))(leaves)
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    order: list[int] = []
    seen: set[int] = set()
    for eqn in closed.jaxpr.eqns:
        for v in eqn.invars:
            i = None if type(v).__name__ == "Literal" else position.get(v)
            if i is not None and i not in seen:
                seen.add(i)
                order.append(i)
    return order + [i for i in range(len(leaves)) if i not in seen]


def param_layout(params: Any, order: list[int] | None = None) -> ParamLayout:
    """Layout of a parameter pytree with leaves placed in `order` (default: tree order)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    n = len(with_paths)
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {order}")
    entries, offset = [], 0
    for leaf in order:
        path, value = with_paths[leaf]
        size = int(np.prod(value.shape, dtype=np.int64))
        entries.append(Entry(jax.tree_util.keystr(path), tuple(value.shape), str(value.dtype), leaf, offset, size))
        offset += size
    return ParamLayout(tuple(entries), treedef, offset)


def make_blocks(total: int, num_blocks: int) -> tuple[Block, ...]:
    """Cut `total` elements into `num_blocks` contiguous blocks of near-equal size (sizes differ by ≤ 1)."""
    if total <= 0:
        raise ConfigError(f"ps: the model has no parameters to serve (total={total})")
    if not 0 < num_blocks <= total:
        raise ConfigError(f"ps.num_blocks={num_blocks}: must be in [1, number of parameters={total}]")
    bounds = [total * i // num_blocks for i in range(num_blocks + 1)]
    return tuple(Block(i, bounds[i], bounds[i + 1]) for i in range(num_blocks))


def chunk_ranges(length: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Split [0, length) into consecutive chunks of at most `chunk_elems` elements."""
    if chunk_elems <= 0:
        raise ConfigError(f"ps.chunk_bytes must hold at least one float32 (got {4 * chunk_elems} bytes)")
    return [(s, min(s + chunk_elems, length)) for s in range(0, length, chunk_elems)]


def checksum(flat: np.ndarray) -> str:
    """Exact fingerprint of a parameter vector (bitwise): equal iff every float is identical."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(flat, np.float32).tobytes()).hexdigest()[:16]


def split_blocks(flat: np.ndarray, blocks: tuple[Block, ...]) -> list[np.ndarray]:
    return [np.array(flat[b.start:b.stop]) for b in blocks]


def join_blocks(parts: list[np.ndarray], blocks: tuple[Block, ...], total: int) -> np.ndarray:
    out = np.empty(total, np.float32)
    for b, p in zip(blocks, parts):
        out[b.start:b.stop] = p
    return out


__all__ = ["Entry", "Block", "ParamLayout", "forward_order", "param_layout", "make_blocks", "chunk_ranges",
           "checksum", "split_blocks", "join_blocks"]
