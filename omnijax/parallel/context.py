"""Context parallelism: attention over a sequence sharded on the ``cp`` mesh axis.

Masks come from positions and segment ids, never from array indices, so the sequence may be stored in
any order. That is what the causal load-balancing layout uses: split the sequence into ``2*cp`` chunks
and give rank ``i`` chunks ``i`` and ``2*cp-1-i`` (one early, cheap chunk and one late, expensive one),
so every rank does the same amount of causal work. Two exchange strategies:

- ``allgather``: gather K/V (and their segment ids/positions) over ``cp``, attend locally;
- ``ring``: pass K/V blocks around the ring with ``ppermute``, merging blocks with an online softmax,
  so no rank ever holds the whole sequence's K/V. Each block is split into tiles matching the two
  chunks a rank holds, and tiles with an empty mask are skipped (``lax.cond``): under the balanced
  layout every rank computes 2*cp+1 of its 4*cp tiles.
"""
from __future__ import annotations

from functools import partial
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from omnijax.errors import ConfigError

_NEG = -1e30


# ------------------------------------------------------------------------ host-side layout (pure)
def balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """Index array that stores the sequence so rank i of ``cp`` holds chunks i and 2cp-1-i."""
    if cp == 1:
        return np.arange(seq_len)
    if seq_len % (2 * cp):
        raise ConfigError(f"data.seq_len={seq_len}: context parallelism cp={cp} needs a multiple of 2*cp="
                          f"{2 * cp} (load-balanced chunks)")
    chunk = seq_len // (2 * cp)
    parts = []
    for i in range(cp):
        parts += [np.arange(i * chunk, (i + 1) * chunk), np.arange((2 * cp - 1 - i) * chunk, (2 * cp - i) * chunk)]
    return np.concatenate(parts)


def causal_work(order: np.ndarray, cp: int) -> np.ndarray:
    """Causal (q, k) pairs each rank computes when the sequence is stored in ``order`` (one document)."""
    pos = np.asarray(order)
    per_rank = pos.reshape(cp, -1)
    # query at position p attends p + 1 keys (itself and everything earlier)
    return (per_rank + 1).sum(axis=1)


def ring_tiles(order: np.ndarray, cp: int, splits: int = 2) -> np.ndarray:
    """Tiles each rank computes in the ring (non-empty causal masks; one document stored in ``order``)."""
    tiles = np.asarray(order).reshape(cp, splits, -1)
    first, last = tiles.min(axis=2), tiles.max(axis=2)  # per rank, per tile
    # a (q tile, kv tile) pair is non-empty when some query position >= some key position
    return np.array([sum(int(last[r, a] >= first[o, b]) for o in range(cp) for a in range(splits)
                         for b in range(splits)) for r in range(cp)])


# -------------------------------------------------------------------------- local block attention
def _mask(q_seg, kv_seg, q_pos, kv_pos, causal):
    m = (q_seg[:, :, None] == kv_seg[:, None, :])
    if causal:
        m &= q_pos[:, :, None] >= kv_pos[:, None, :]
    return m  # [b, q, k]


def _block(q, k, v, mask, scale):
    """Unnormalised attention of one K/V block: (out, running max, running sum) for online softmax."""
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, sq, kvh, h // kvh, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    mk = mask[:, None, None]
    s = jnp.where(mk, s, _NEG)
    m = lax.stop_gradient(jnp.max(s, axis=-1))
    p = jnp.where(mk, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m, l  # o [b,q,kvh,g,d]; m, l [b,kvh,g,q]


def _merge(acc, new):
    o1, m1, l1 = acc
    o2, m2, l2 = new
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    to_o = lambda a: jnp.moveaxis(a, -1, 1)[..., None]  # [b,kvh,g,q] -> [b,q,kvh,g,1]
    return o1 * to_o(a1) + o2 * to_o(a2), m, l1 * a1 + l2 * a2


def _finish(o, l, shape, dtype):
    l = jnp.moveaxis(l, -1, 1)[..., None]
    out = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
    return out.reshape(shape).astype(dtype)


def local_attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal: bool = True):
    """Reference single-device attention with the same masking rules (rows with no key give 0)."""
    scale = q.shape[-1] ** -0.5
    o, _, l = _block(q, k, v, _mask(q_seg, kv_seg, q_pos, kv_pos, causal), scale)
    return _finish(o, l, q.shape, q.dtype)


# ------------------------------------------------------------------------------ sharded attention
def _empty(q, k, v):
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    return (jnp.zeros((b, sq, kvh, h // kvh, d), jnp.float32), jnp.full((b, kvh, h // kvh, sq), _NEG, jnp.float32),
            jnp.zeros((b, kvh, h // kvh, sq), jnp.float32))


def _tiles(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal, scale, splits):
    """Online-softmax state of q against one K/V block, computed per (q tile, kv tile) and skipping tiles
    whose mask is empty (the causal upper triangle, other documents): this is where the load-balanced
    layout pays off, every rank skips the same number of tiles."""
    cut = lambda a, n: jnp.split(a, n, axis=1)
    qs, qsegs, qposs = cut(q, splits), cut(q_seg, splits), cut(q_pos, splits)
    ks, vs, ksegs, kposs = cut(k, splits), cut(v, splits), cut(kv_seg, splits), cut(kv_pos, splits)
    rows = []
    for qt, qsg, qps in zip(qs, qsegs, qposs):
        acc = None
        for kt, vt, ksg, kps in zip(ks, vs, ksegs, kposs):
            mask = _mask(qsg, ksg, qps, kps, causal)
            tile = lax.cond(jnp.any(mask), lambda a: _block(*a, scale), lambda a: _empty(*a[:3]),
                            (qt, kt, vt, mask))
            acc = tile if acc is None else _merge(acc, tile)
        rows.append(acc)
    return (jnp.concatenate([r[0] for r in rows], axis=1), jnp.concatenate([r[1] for r in rows], axis=-1),
            jnp.concatenate([r[2] for r in rows], axis=-1))


def _ring_body(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, axis, size, causal, splits=2):
    scale = q.shape[-1] ** -0.5
    splits = splits if q.shape[1] % splits == 0 and k.shape[1] % splits == 0 else 1
    perm = [(j, (j + 1) % size) for j in range(size)]
    attend = partial(_tiles, causal=causal, scale=scale, splits=splits)
    acc = attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos)
    kv = (k, v, kv_seg, kv_pos)
    for _ in range(size - 1):  # static and small: unrolled so XLA can overlap permute with compute
        kv = tuple(lax.ppermute(t, axis, perm) for t in kv)
        k2, v2, s2, p2 = kv
        acc = _merge(acc, attend(q, k2, v2, q_seg, s2, q_pos, p2))
    o, _, l = acc
    return _finish(o, l, q.shape, q.dtype)


def _allgather_body(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, axis, size, causal, attention_fn):
    gather = lambda t: lax.all_gather(t, axis, axis=1, tiled=True)
    k, v, kv_seg, kv_pos = gather(k), gather(v), gather(kv_seg), gather(kv_pos)
    if attention_fn is not None:
        return attention_fn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                            kv_positions=kv_pos, causal=causal)
    return local_attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal=causal)


def cp_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, mesh: Mesh,
                 impl: Literal["ring", "allgather"] = "ring", causal: bool = True, axis: str = "cp",
                 batch_axes: Sequence[str] = ("dp", "fsdp", "ep"), head_axes: Sequence[str] = ("tp",),
                 attention_fn=None):
    """Attention of ``q [b,s,h,d]`` over ``k, v [b,s,kvh,d]`` whose sequence is sharded on ``axis``.

    ``attention_fn`` (same keyword interface as ``omnijax.layers.attention.dot_product_attention``) is
    used for the local step of the all-gather strategy so that results match the model's own attention.
    """
    size = int(mesh.shape.get(axis, 1))
    live = lambda axes: tuple(a for a in axes if int(mesh.shape.get(a, 1)) > 1) or None
    bax = live(batch_axes)
    hax = live(head_axes)
    hax_q = hax if hax and q.shape[2] % np.prod([mesh.shape[a] for a in hax]) == 0 else None
    hax_kv = hax if hax and k.shape[2] % np.prod([mesh.shape[a] for a in hax]) == 0 else None
    if hax_q != hax_kv:  # keep GQA groups local
        hax_q = hax_kv = None
    qs, kvs = P(bax, axis, hax_q, None), P(bax, axis, hax_kv, None)
    ids = P(bax, axis)
    if impl == "ring":
        body = partial(_ring_body, axis=axis, size=size, causal=causal)
    elif impl == "allgather":
        body = partial(_allgather_body, axis=axis, size=size, causal=causal, attention_fn=attention_fn)
    else:
        raise ConfigError(f"context attention impl={impl!r}: must be 'ring' or 'allgather'")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(qs, kvs, kvs, ids, ids, ids, ids), out_specs=qs,
                       check_vma=False)
    return fn(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
