"""Blockwise (flash) attention in pure JAX: memory linear in length, fully masked blocks skipped.

Same contract as the dense reference in `omnijax.layers.attention`: a query sees a key when both have
the same non-zero segment id and (if causal) kv_position <= q_position; which key is visible depends
on ids and positions only, never on the buffer index. Rows with no visible key give output 0 and
lse -inf, without NaN in either direction.

How (FlashAttention's algorithm): the buffer is cut into query blocks (outer `lax.scan`) and key
blocks (inner loop) with an online softmax in float32, so temporaries are O(block_q x block_k) per
(batch, head). Before the loops, per-block min/max segment ids and positions give a conservative
"some pair may be visible" table; the inner loop runs only between the first and last visible key
block of each query block and skips the rest with `lax.cond`, so a buffer of many short segments
costs sum(segment^2), not buffer^2. The backward (`jax.custom_vjp`) recomputes probabilities from the
saved log-sum-exp and honours the lse cotangent (D = rowsum(dO*O) - dlse), which ring attention
needs because it merges partial results through their lse.

Batch and heads stay vectorised inside each block (never looped), so GSPMD can still shard them;
skipping is decided per block pair over the whole local batch.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

_BIG = 2 ** 30
_F32 = jnp.float32


def _block_stats(seg: jax.Array, pos: jax.Array, blocks: int, size: int):
    """Per (batch, block): min/max non-zero segment id and min/max position of non-padding rows."""
    b = seg.shape[0]
    s, p = seg.reshape(b, blocks, size), pos.reshape(b, blocks, size)
    live = s != 0
    return (jnp.min(jnp.where(live, s, _BIG), -1), jnp.max(jnp.where(live, s, -1), -1),
            jnp.min(jnp.where(live, p, _BIG), -1), jnp.max(jnp.where(live, p, -_BIG), -1))


def visible_blocks(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, q_positions: jax.Array,
                   kv_positions: jax.Array, *, causal: bool, block_q: int, block_k: int) -> jax.Array:
    """[nq, nk] bool: whether some (query, key) pair of the block pair may be visible, for any batch row.

    Conservative (segment-id intervals overlap, and under causality the smallest key position is <= the
    largest query position): a True block may still be fully masked, a False one never has a visible pair.
    Lengths must be multiples of the block sizes."""
    nq, nk = q_segment_ids.shape[1] // block_q, kv_segment_ids.shape[1] // block_k
    qs_min, qs_max, _, qp_max = _block_stats(q_segment_ids, q_positions, nq, block_q)
    ks_min, ks_max, kp_min, _ = _block_stats(kv_segment_ids, kv_positions, nk, block_k)
    vis = (qs_min[:, :, None] <= ks_max[:, None, :]) & (ks_min[:, None, :] <= qs_max[:, :, None])
    if causal:
        vis &= kp_min[:, None, :] <= qp_max[:, :, None]
    return jnp.any(vis, axis=0)


def _ranges(vis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First and one-past-last True index along the last axis (0, 0 for an all-False row)."""
    n = vis.shape[-1]
    anyv = jnp.any(vis, -1)
    lo = jnp.argmax(vis, -1)
    hi = n - jnp.argmax(vis[..., ::-1], -1)
    return jnp.where(anyv, lo, 0).astype(jnp.int32), jnp.where(anyv, hi, 0).astype(jnp.int32)


def _mask(qs, qp, ks, kp, causal: bool) -> jax.Array:
    """[B, 1, 1, bq, bk] from [B, bq] query and [B, bk] key ids/positions (the reference's rule)."""
    m = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
    if causal:
        m &= kp[:, None, :] <= qp[:, :, None]
    return m[:, None, None]


def _scores(qi, kj, mask, scale: float) -> jax.Array:
    """Masked scores [B, KVH, G, bq, bk] in float32 (-inf where not visible)."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kj, preferred_element_type=_F32) * scale
    return jnp.where(mask, s, -jnp.inf)


def _vma(x) -> frozenset:
    """Manual mesh axes `x` varies over (jax 0.10: `typeof(x).mat.varying`; older: `.vma`)."""
    t = jax.typeof(x)
    mat = getattr(t, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(t, "vma", None) or ())


def _varying_like(tree, *refs):
    """Mark fresh loop carries as varying over the manual mesh axes the inputs vary over (inside
    `shard_map`, e.g. the pipeline), so the skip branch and the compute branch have the same type."""
    axes = frozenset().union(*(_vma(r) for r in refs))

    def vary(x):
        missing = tuple(sorted(axes - _vma(x)))
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(vary, tree) if axes else tree


def _blocks(x: jax.Array, n: int) -> jax.Array:
    """[B, n*bs, ...] -> [n, B, bs, ...] (blocks leading, for scan / dynamic indexing)."""
    return jnp.swapaxes(x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]), 0, 1)


def _unblocks(x: jax.Array) -> jax.Array:
    """[n, B, bs, ...] -> [B, n*bs, ...]."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _forward(q, k, v, qs, ks, qp, kp, causal: bool, scale: float, bq: int, bk: int):
    """(out [B, Lq, H, D], lse [B, Lq, H], executed key blocks). Lengths are block multiples."""
    b, lq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    nq, nk = lq // bq, k.shape[1] // bk
    vis = visible_blocks(qs, ks, qp, kp, causal=causal, block_q=bq, block_k=bk)
    lo, hi = _ranges(vis)
    qb = _blocks(q.reshape(b, lq, kvh, g, d), nq)
    kb, vb, ksb, kpb = _blocks(k, nk), _blocks(v, nk), _blocks(ks, nk), _blocks(kp, nk)

    def row(count, xs):
        qi, qsi, qpi, vis_i, lo_i, hi_i = xs

        def compute(j, carry):
            o, m, l, n = carry
            s = _scores(qi, kb[j], _mask(qsi, qpi, ksb[j], kpb[j], causal), scale)
            m_new = jnp.maximum(m, jnp.max(s, -1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])           # masked keys: exp(-inf) = 0
            alpha = jnp.exp(m - m_safe)                  # m = -inf (nothing seen yet): 0
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), vb[j], preferred_element_type=_F32)
            return o * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, -1), n + 1

        step = lambda j, c: lax.cond(vis_i[j], functools.partial(compute, j), lambda c: c, c)  # noqa: E731
        init = _varying_like((jnp.zeros((b, kvh, g, bq, d), _F32), jnp.full((b, kvh, g, bq), -jnp.inf, _F32),
                              jnp.zeros((b, kvh, g, bq), _F32), count), q, k, v, qs, ks, qp, kp)
        o, m, l, count = lax.fori_loop(lo_i, hi_i, step, init)
        ok = l > 0
        safe = jnp.where(ok, l, 1.0)
        out = jnp.where(ok[..., None], o / safe[..., None], 0.0)
        lse = jnp.where(ok, m + jnp.log(safe), -jnp.inf)
        return count, (jnp.moveaxis(out, 3, 1).astype(q.dtype), jnp.moveaxis(lse, 3, 1))

    count0 = _varying_like(jnp.int32(0), q, k, v, qs, ks, qp, kp)
    count, (out, lse) = lax.scan(row, count0, (qb, _blocks(qs, nq), _blocks(qp, nq), vis, lo, hi))
    return _unblocks(out).reshape(b, lq, h, d), _unblocks(lse).reshape(b, lq, h), count


def _backward(q, k, v, qs, ks, qp, kp, out, lse, do, dlse, causal: bool, scale: float, bq: int, bk: int):
    """(dq, dk, dv, executed blocks): outer scan over key blocks, inner loop over visible query blocks.

    P is recomputed from the saved lse; dS = P * (dP - D) with D = rowsum(dO*O) - dlse, which is the
    gradient of both the output and the lse."""
    b, lq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    nq, nk = lq // bq, k.shape[1] // bk
    vis = visible_blocks(qs, ks, qp, kp, causal=causal, block_q=bq, block_k=bk)
    lo, hi = _ranges(vis.T)
    delta = jnp.sum(do.astype(_F32) * out.astype(_F32), -1) - dlse.astype(_F32)   # [B, Lq, H]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)   # rows with no key: every p is exp(-inf) = 0
    as_rows = lambda t: jnp.moveaxis(_blocks(t.reshape(b, lq, kvh, g), nq), 2, 4)  # noqa: E731 [nq,B,KVH,G,bq]
    qb, dob = _blocks(q.reshape(b, lq, kvh, g, d), nq), _blocks(do.reshape(b, lq, kvh, g, d), nq)
    lseb, deltab = as_rows(lse_safe), as_rows(delta)
    qsb, qpb = _blocks(qs, nq), _blocks(qp, nq)

    def column(carry, xs):
        dq, count = carry
        kj, vj, ksj, kpj, vis_j, lo_j, hi_j = xs

        def compute(i, c):
            dk, dv, dq, n = c
            qi, doi = qb[i], dob[i]
            s = _scores(qi, kj, _mask(qsb[i], qpb[i], ksj, kpj, causal), scale)
            p = jnp.exp(s - lseb[i][..., None])
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), doi, preferred_element_type=_F32)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=_F32)
            ds = p * (dp - deltab[i][..., None])
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qi, preferred_element_type=_F32)
            dqi = jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), kj, preferred_element_type=_F32)
            return dk, dv, lax.dynamic_update_index_in_dim(dq, dq[i] + dqi, i, 0), n + 1

        step = lambda i, c: lax.cond(vis_j[i], functools.partial(compute, i), lambda c: c, c)  # noqa: E731
        zeros = _varying_like(jnp.zeros((b, bk, kvh, d), _F32), q, k, v, qs, ks, qp, kp, do, dlse)
        dk, dv, dq, count = lax.fori_loop(lo_j, hi_j, step, (zeros, zeros, dq, count))
        return (dq, count), ((dk * scale).astype(k.dtype), dv.astype(v.dtype))

    init = _varying_like((jnp.zeros((nq, b, bq, kvh, g, d), _F32), jnp.int32(0)), q, k, v, qs, ks, qp, kp, do, dlse)
    xs = (_blocks(k, nk), _blocks(v, nk), _blocks(ks, nk), _blocks(kp, nk), vis.T, lo, hi)
    (dq, count), (dk, dv) = lax.scan(column, init, xs)
    dq = (_unblocks(dq) * scale).reshape(b, lq, h, d).astype(q.dtype)
    return dq, _unblocks(dk), _unblocks(dv), count


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, qs, ks, qp, kp, causal, scale, bq, bk):
    out, lse, _ = _forward(q, k, v, qs, ks, qp, kp, causal, scale, bq, bk)
    return out, lse


def _flash_fwd(q, k, v, qs, ks, qp, kp, causal, scale, bq, bk):
    out, lse, _ = _forward(q, k, v, qs, ks, qp, kp, causal, scale, bq, bk)
    return (out, lse), (q, k, v, qs, ks, qp, kp, out, lse)


def _flash_bwd(causal, scale, bq, bk, res, cts):
    q, k, v, qs, ks, qp, kp, out, lse = res
    do, dlse = cts
    dq, dk, dv, _ = _backward(q, k, v, qs, ks, qp, kp, out, lse, do, dlse, causal, scale, bq, bk)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _prepare(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, scale, block_q, block_k):
    """Check shapes, clip block sizes to the lengths and pad lengths to block multiples (segment id 0)."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention wants q [B, Lq, H, D] and k = v [B, Lk, KVH, D]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be > 0, got block_q={block_q}, block_k={block_k}")
    lq, lk = q.shape[1], k.shape[1]
    bq, bk = min(block_q, lq), min(block_k, lk)
    pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2)) if n else x  # noqa: E731
    pq, pk = -lq % bq, -lk % bk
    ints = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return (pad(q, pq), pad(k, pk), pad(v, pk), pad(ints(q_segment_ids), pq), pad(ints(kv_segment_ids), pk),
            pad(ints(q_positions), pq), pad(ints(kv_positions), pk), scale, bq, bk)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                        kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                        causal: bool = True, scale: float | None = None, block_q: int = 128,
                        block_k: int = 128) -> tuple[jax.Array, jax.Array]:
    """Flash attention: (out [B, Lq, H, D] in q's dtype, lse [B, Lq, H] float32).

    q [B, Lq, H, D], k/v [B, Lk, KVH, D] with H a multiple of KVH (query head h uses kv head h // (H/KVH),
    K/V are never repeated). Differentiable in q, k, v through a custom VJP that also takes the lse's
    cotangent. Block sizes are clipped to the lengths; other lengths are padded internally."""
    lq = q.shape[1]
    args = _prepare(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, scale, block_q, block_k)
    qp_, kp_, vp_, qs, ks, qpos, kpos, scale, bq, bk = args
    with jax.named_scope("blockwise_attention"):  # visible in profiles and in the lowered program
        out, lse = _flash(qp_, kp_, vp_, qs, ks, qpos, kpos, bool(causal), scale, bq, bk)
    return out[:, :lq], lse[:, :lq]


def executed_blocks(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                    kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                    causal: bool = True, scale: float | None = None, block_q: int = 128,
                    block_k: int = 128) -> tuple[int, int, int]:
    """Debug: (block pairs the forward computed, block pairs the backward computed, all block pairs).

    Runs the very loops `blockwise_attention` uses (the counter ticks only inside the taken branch of the
    skip `lax.cond`), so it shows whether skipping really happens."""
    args = _prepare(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, scale, block_q, block_k)
    qp_, kp_, vp_, qs, ks, qpos, kpos, scale, bq, bk = args

    @jax.jit
    def run(qp_, kp_, vp_, qs, ks, qpos, kpos):
        out, lse, nf = _forward(qp_, kp_, vp_, qs, ks, qpos, kpos, bool(causal), scale, bq, bk)
        *_, nb = _backward(qp_, kp_, vp_, qs, ks, qpos, kpos, out, lse, jnp.ones_like(out),
                           jnp.zeros_like(lse), bool(causal), scale, bq, bk)
        return nf, nb

    nf, nb = run(qp_, kp_, vp_, qs, ks, qpos, kpos)
    return int(nf), int(nb), (qp_.shape[1] // bq) * (kp_.shape[1] // bk)
