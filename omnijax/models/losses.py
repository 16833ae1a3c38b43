"""Losses over packed token buffers: token-weighted cross entropy with a mask.

Two ways to the same number. ``masked_cross_entropy`` takes logits [B, L, V] (the reference, and
``model.loss_chunk=0``). ``head_cross_entropy`` takes the final-normed hidden states and the head
weight and never holds more than one chunk of logits, forward or backward: at 128k-262k vocabularies
the full fp32 logits are the largest buffer of a training step (Qwen2-7B at 4096 tokens: 2.5 GB per
row). It is token-tiled: each row's loss-carrying positions are first moved to its front (a stable
per-row sort), the row is cut into chunks of ``loss_chunk`` positions, and a scan computes one chunk
of logits at a time; a chunk that holds no loss position in any row is skipped (``lax.cond``), so
fine-tuning data whose answers are a fraction of the row costs logits only at the answers, rounded up
to a chunk (one compiled program whatever the count). A ``custom_vjp`` keeps only the per-position
log-sum-exp [B, L] from the forward; the backward recomputes each chunk's logits once. The vocabulary
axis of a chunk keeps the head weight's sharding (tp splits the vocabulary; GSPMD reduces the
log-sum-exp over it), so every layout computes the same loss.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_LOSS_CHUNK = 512


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of per-token cross entropy where mask > 0, and the number of such tokens.

    Sums (not means) so that microbatches and shards add up to the exact global mean.
    """
    logits = logits.astype(jnp.float32)
    # a masked position's target may be an id outside the vocabulary (a media placeholder): never gathered
    targets = jnp.where(mask > 0, targets, 0)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum((logz - picked) * mask), jnp.sum(mask)


def loss_chunk_of(model: Any) -> int:
    """``model.loss_chunk`` of an LLM (or its pipelined form): positions per row per chunk, 0 = full logits."""
    return int(json.loads(model.config_json).get("loss_chunk", DEFAULT_LOSS_CHUNK))


def head_weight(model: Any, dtype: Any) -> tuple[jax.Array, bool]:
    """(the head weight in `dtype`, whether it is the tied [V, D] embedding rather than a [D, V] head)."""
    if model.lm_head is None:
        return model.embedding[...].astype(dtype), True
    return model.lm_head[...].astype(dtype), False


def _chunk_logits(h: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
    """h [..., D] -> float32 logits [..., V] (the same contraction as ``LLM.logits``)."""
    if tied:
        return jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


def _picked(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits[..., target] by comparing with an iota: stays local to each vocabulary shard (no gather)."""
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1)


def _chunks_needed(ms: jax.Array) -> jax.Array:
    """How many leading chunks hold a loss position in some row (rows are compacted, so these are a prefix)."""
    per_chunk = jnp.sum(ms, axis=tuple(range(1, ms.ndim)))  # [nc]
    return jnp.sum((per_chunk > 0).astype(jnp.int32))


def _typed_zero(*xs: jax.Array) -> jax.Array:
    """A float32 scalar 0 that varies over the union of the operands' manual axes (inside shard_map, a
    scan carry or cond branch must be typed like what it meets)."""
    return sum((jnp.zeros_like(x[(0,) * x.ndim]).astype(jnp.float32) for x in xs), jnp.zeros((), jnp.float32))


def _forward(hs, w, ts, ms, tied):
    needed = _chunks_needed(ms)

    def body(_, xs):
        h, t, m, k = xs

        def compute(_):
            logits = _chunk_logits(h, w, tied)
            lse = jax.nn.logsumexp(logits, axis=-1)
            return jnp.sum((lse - _picked(logits, t)) * m), lse

        def skip(_):  # zeros typed like the computed branch's
            z = _typed_zero(h, w, m)
            return z, jnp.zeros(m.shape, jnp.float32) + z

        return None, jax.lax.cond(k < needed, compute, skip, None)

    _, (parts, lse) = jax.lax.scan(body, None, (hs, ts, ms, jnp.arange(hs.shape[0])))
    return jnp.sum(parts), (lse, needed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_ce(hs: jax.Array, w: jax.Array, ts: jax.Array, ms: jax.Array, tied: bool) -> jax.Array:
    """Sum of masked cross entropy over chunks hs [nc, B, C, D], targets/mask [nc, B, C]."""
    return _forward(hs, w, ts, ms, tied)[0]


def _chunked_ce_fwd(hs, w, ts, ms, tied):
    total, (lse, needed) = _forward(hs, w, ts, ms, tied)
    return total, (hs, w, ts, ms, lse, needed)


def _chunk_grads(h, t, m, l, w, g, tied):
    """(d loss / d w, d loss / d h) of one chunk, its logits recomputed (l: its log-sum-exp). The weight's
    gradient comes out in the weight's (compute) dtype, as the full path's single matmul gives it: a float32
    sum would hold two float32 copies of the head (the carry and the chunk's product) where the full path
    holds one bf16 gradient; fp32 runs sum in fp32."""
    logits = _chunk_logits(h, w, tied)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    d = (jnp.exp(logits - l[..., None]) - (ids == t[..., None]).astype(jnp.float32)) * (g * m)[..., None]
    d = d.astype(w.dtype)
    if tied:
        return (jnp.einsum("...v,...d->vd", d, h, preferred_element_type=jnp.float32).astype(w.dtype),
                jnp.einsum("...v,vd->...d", d, w, preferred_element_type=jnp.float32).astype(h.dtype))
    return (jnp.einsum("...d,...v->dv", h, d, preferred_element_type=jnp.float32).astype(w.dtype),
            jnp.einsum("...v,dv->...d", d, w, preferred_element_type=jnp.float32).astype(h.dtype))


def _chunked_ce_bwd(tied, res, g):
    hs, w, ts, ms, lse, needed = res

    def body(dw, xs):
        h, t, m, l, k = xs

        def compute(dw):
            dw_k, dh = _chunk_grads(h, t, m, l, w, g, tied)
            return dw + dw_k, dh

        def skip(dw):
            return dw, (jnp.zeros(h.shape, jnp.float32) + _typed_zero(h, w, m, l, g)).astype(h.dtype)

        return jax.lax.cond(k < needed, compute, skip, dw)

    dw0 = (jnp.zeros(w.shape, jnp.float32) + _typed_zero(hs, w, ms, lse, g)).astype(w.dtype)
    dw, dhs = jax.lax.scan(body, dw0, (hs, ts, ms, lse, jnp.arange(hs.shape[0])))
    return dhs, dw, None, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def chunked_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, *, chunk: int,
                          tied: bool) -> tuple[jax.Array, jax.Array]:
    """``masked_cross_entropy(h @ w, targets, mask)`` holding one [B, chunk, V] block of logits at a time.

    h [B, L, D] final-normed hidden states; w the head weight ([D, V], or the tied [V, D] table). Each
    row's loss positions are moved to its front first, so chunks past the longest row's count are skipped.
    """
    (h, targets, m), _, split = loss_first_chunks(h, targets, mask, chunk)
    args = _same_manual_axes(split(h), w, split(targets), split(m))
    return _chunked_ce(*args, tied), jnp.sum(m)


def loss_first_chunks(h: jax.Array, targets: jax.Array, mask: jax.Array, chunk: int):
    """Each row's loss positions moved to its front (stable) and padded to whole chunks, so chunks past the
    longest row's count can be skipped: ((h, targets, mask) reordered [B, nc*chunk, ...], the order [B, L]
    (`argsort(order)` puts values back), and `split` [B, nc*chunk, ...] -> [nc, B, chunk, ...])."""
    b, l = targets.shape
    mask = mask.astype(jnp.float32)
    targets = jnp.where(mask > 0, targets, 0).astype(jnp.int32)
    order = jnp.argsort((mask <= 0).astype(jnp.int32), axis=1, stable=True)  # loss positions first, in order
    h = jnp.take_along_axis(h, order[..., None], axis=1)
    targets, mask = jnp.take_along_axis(targets, order, axis=1), jnp.take_along_axis(mask, order, axis=1)
    nc = -(-l // chunk)
    pad = nc * chunk - l
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets, mask = jnp.pad(targets, ((0, 0), (0, pad))), jnp.pad(mask, ((0, 0), (0, pad)))

    def split(x):  # [B, nc*C, ...] -> [nc, B, C, ...]
        return jnp.moveaxis(x.reshape(b, nc, chunk, *x.shape[2:]), 1, 0)
    return (h, targets, mask), order, split


def _same_manual_axes(*xs: jax.Array) -> list[jax.Array]:
    """Inside shard_map: every operand typed as varying over the union of their manual axes, so the custom
    rule's cotangents have their inputs' types (jax sums a replicated weight's gradient over the axes the
    data varies on, as the transpose of this cast). Outside shard_map: unchanged."""
    def varying(x):
        return set(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ()))
    axes = set().union(*map(varying, xs))
    return [jax.lax.pcast(x, tuple(sorted(axes - varying(x))), to="varying") if axes - varying(x) else x
            for x in xs]


def head_cross_entropy(model: Any, h: jax.Array, targets: jax.Array, mask: jax.Array,
                       chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(loss_sum, token_count) of the LLM head over final-normed hidden states h [B, L, D].

    ``chunk`` (default ``model.loss_chunk``): positions per row whose logits exist at once; 0, or a
    chunk as long as the row, computes the full logits (``masked_cross_entropy``, the old path)."""
    chunk = loss_chunk_of(model) if chunk is None else chunk
    if chunk <= 0 or chunk >= h.shape[1]:
        return masked_cross_entropy(model.logits(h), targets, mask)
    w, tied = head_weight(model, h.dtype)
    return chunked_cross_entropy(h, w, targets, mask, chunk=chunk, tied=tied)


def lm_loss(model, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """Next-token loss of a text LLM on a packed batch: (loss_sum, token_count, aux)."""
    x = model.embed(batch["tokens"])
    h, aux = model.forward_embeddings(x, batch["segment_ids"], batch["positions"], head=False)
    loss_sum, count = head_cross_entropy(model, h, batch["targets"], batch["loss_mask"])
    return loss_sum, count, aux
