"""Context parallelism: attention over a sequence sharded on the ``cp`` mesh axis.

Masks come from positions and segment ids, never from array indices, so the sequence may be stored in
any order. That is what the causal load-balancing layout uses: split the sequence into ``2*cp`` chunks
and give rank ``i`` chunks ``i`` and ``2*cp-1-i`` (one early, cheap chunk and one late, expensive one),
so every rank does the same amount of causal work. Two exchange strategies:

- ``allgather``: gather K/V (and their segment ids/positions) over ``cp``, attend locally;
- ``ring``: pass K/V blocks around the ring with ``ppermute``, merging each step's partial result by
  its log-sum-exp, so no rank ever holds the whole sequence's K/V. Steps with no visible pair are
  skipped (``lax.cond``); inside a step the blockwise attention skips empty blocks, so under the
  balanced layout (chunks at block granularity) every rank skips the same causal work
  (``ring_tiles`` counts it for two tiles per rank).
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
from omnijax.layers.attention import dot_product_attention
from omnijax.layers.flash import visible_blocks


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


# ------------------------------------------------------------------------------ sharded attention
def merge_partials(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array):
    """Merge attention over two disjoint key sets: (out [B,L,H,D] f32, lse [B,L,H]) from each.

    out = w1*o1 + w2*o2 with w_i = exp(lse_i - lse); rows with no key in either part stay 0 / -inf, and
    no NaN reaches the gradient (the reference max is a constant, empty parts get weight exactly 0)."""
    m = lax.stop_gradient(jnp.maximum(lse1, lse2))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e1, e2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    total = e1 + e2
    ok = total > 0
    safe = jnp.where(ok, total, 1.0)
    out = (e1 / safe)[..., None] * o1 + (e2 / safe)[..., None] * o2
    return out, jnp.where(ok, m + jnp.log(safe), -jnp.inf)


def _like(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """``x`` typed as varying over every manual axis the ``refs`` vary over (a typed shard_map wants both
    branches of a ``lax.cond`` alike); a no-op outside typed shard_maps."""
    def vma(a: jax.Array) -> set:
        t = jax.typeof(a)
        mat = getattr(t, "manual_axis_type", None)
        return set(mat.varying if mat is not None else getattr(t, "vma", ()))

    want = set().union(*(vma(r) for r in refs))
    missing = tuple(sorted(want - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _ring_body(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, axis, size, causal, attention_impl):
    """Each rank attends its queries to every rank's K/V block as the blocks travel round the ring,
    merging partial results by their log-sum-exp (whose gradient the attention honours). A ring step
    whose block has no visible pair at all is skipped (`lax.cond`); inside a step, the blockwise
    implementation skips empty blocks on its own."""
    perm = [(j, (j + 1) % size) for j in range(size)]
    b, sq, h, d = q.shape

    def attend(k, v, kv_seg, kv_pos):
        visible = visible_blocks(q_seg, kv_seg, q_pos, kv_pos, causal=causal, block_q=sq,
                                 block_k=k.shape[1])[0, 0]

        def run(k, v):
            out, lse = dot_product_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                                             kv_positions=kv_pos, causal=causal, return_lse=True, impl=attention_impl)
            return out.astype(jnp.float32), lse

        def empty(k, v):
            return (_like(jnp.zeros((b, sq, h, d), jnp.float32), q, k),
                    _like(jnp.full((b, sq, h), -jnp.inf, jnp.float32), q, k))
        return lax.cond(visible, run, empty, k, v)

    out, lse = attend(k, v, kv_seg, kv_pos)
    kv = (k, v, kv_seg, kv_pos)
    for _ in range(size - 1):  # static and small: unrolled so XLA can overlap permute with compute
        kv = tuple(lax.ppermute(t, axis, perm) for t in kv)
        out, lse = merge_partials(out, lse, *attend(*kv))
    return out.astype(q.dtype)


def _allgather_body(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, axis, size, causal, attention_fn):
    gather = lambda t: lax.all_gather(t, axis, axis=1, tiled=True)  # noqa: E731
    k, v, kv_seg, kv_pos = gather(k), gather(v), gather(kv_seg), gather(kv_pos)
    return attention_fn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                        kv_positions=kv_pos, causal=causal)


def cp_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, mesh: Mesh,
                 impl: Literal["ring", "allgather"] = "ring", causal: bool = True, axis: str = "cp",
                 batch_axes: Sequence[str] = ("dp", "fsdp", "ep"), head_axes: Sequence[str] = ("tp",),
                 attention_fn=None, attention_impl: str = "auto"):
    """Attention of ``q [b,s,h,d]`` over ``k, v [b,s,kvh,d]`` whose sequence is sharded on ``axis``.

    Local attention is ``omnijax.layers.attention.dot_product_attention`` with ``impl=attention_impl``
    (the model config's ``attention``); ``attention_fn`` (same keyword interface) replaces it for the
    all-gather strategy. The ring always asks for the lse (so cuDNN is never used there).
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
        body = partial(_ring_body, axis=axis, size=size, causal=causal, attention_impl=attention_impl)
    elif impl == "allgather":
        fn = attention_fn or partial(dot_product_attention, impl=attention_impl)
        body = partial(_allgather_body, axis=axis, size=size, causal=causal, attention_fn=fn)
    else:
        raise ConfigError(f"context attention impl={impl!r}: must be 'ring' or 'allgather'")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(qs, kvs, kvs, ids, ids, ids, ids), out_specs=qs,
                       check_vma=False)
    return fn(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
