"""Attention inside a pipeline stage, where the region is manual over pp only, made fully manual.

jax's cuDNN attention is custom-partitioned, and its partitioner fails inside a shard_map that is manual over
some mesh axes and automatic over others (it reads `.spec` of the GSPMDSharding such a region hands it): the
pipeline's stages then took blockwise attention. Here the call runs in a nested shard_map over the remaining
axes, with q/k/v split by the layout's rules (batch over the data axes, heads over tp): every axis is manual
inside, cuDNN sees one device's shapes and needs no partitioner. Attention is independent per sequence and per
head, so the split changes nothing numerically (GQA's head groups stay whole when heads and kv heads take the
same axes).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from omnijax.layers import attention as attn


def _without(spec: P, axes: set[str], ndim: int) -> tuple:
    """The spec's entries (padded to ndim) with the axes in `axes` left out."""
    out = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in names if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)


def _typed(x: jax.Array) -> bool:
    """Whether `x` carries shard_map's per-device typing (which manual axes it varies over)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return bool(mat.varying if mat is not None else getattr(t, "vma", ()))


def stage_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, pos: jax.Array, *, mesh: Any,
                    rules: Any, impl: str = "auto") -> jax.Array | None:
    """Causal self-attention of a pipeline stage, where the call would take cuDNN: `manual_attention`.
    None where this does not apply (not in a partly manual region, no cuDNN for the target or these shapes):
    the caller's path stands."""
    ctx = jax.sharding.get_abstract_mesh()
    if ctx.empty or not ctx.manual_axes or impl not in ("auto", "cudnn"):
        return None
    if not any(n > 1 for a, n in ctx.shape.items() if a not in ctx.manual_axes):
        return None  # already fully manual: cuDNN is taken as it is
    if not attn.cudnn_available() or not attn._cudnn_shapes_fit(q, k, v, False):
        return None
    if q.shape[1] * k.shape[1] <= attn.TINY_SCORES and impl == "auto":
        return None  # tiny rows take the reference kernel wherever they are
    return manual_attention(q, k, v, seg, pos, mesh=mesh, rules=rules, impl=impl)


def manual_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, pos: jax.Array, *, mesh: Any,
                     rules: Any, impl: str = "auto") -> jax.Array | None:
    """`dot_product_attention` (causal, self) in a shard_map nested in the enclosing partly manual region, manual
    over every other mesh axis, q/k/v split by the layout's rules; None where the split cannot keep attention
    local (the sequence split (cp), or heads and kv heads split differently)."""
    ctx = jax.sharding.get_abstract_mesh()
    manual = set(ctx.manual_axes)
    qs = _without(rules.spec(("batch", "seq", "heads", "head_dim"), q.shape, mesh, "activations"), manual, 4)
    ks = _without(rules.spec(("batch", "seq", "kv_heads", "head_dim"), k.shape, mesh, "activations"), manual, 4)
    if qs[1] is not None or qs[0] != ks[0] or qs[2] != ks[2]:
        return None
    rows = P(qs[0], None)
    # manual over every remaining axis, size-1 ones too: only a fully manual region lowers cuDNN's
    # custom-partitioned call as it is, with no partitioner
    # (per-device typing as the enclosing region has it: the pipeline's is off when it carries a feed)
    smap = functools.partial(jax.shard_map, mesh=ctx, axis_names={a for a in ctx.axis_names if a not in manual},
                             check_vma=_typed(q))
    specs = (P(*qs), P(*ks), P(*ks), rows, rows)

    def local(q, k, v, seg, pos):
        return attn.dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                          kv_positions=pos, causal=True, impl=impl)

    # The backward is a shard_map of its own that recomputes the forward inside (one more attention forward
    # per layer): differentiating through the nested shard_map would hand its residuals out with specs over
    # the enclosing region's manual axis too (jax 0.12 names every varying axis), which XLA's verifier
    # rejects ("operates on axis pp which is already bound").
    @jax.custom_vjp
    def call(q, k, v, seg, pos):
        return smap(local, in_specs=specs, out_specs=P(*qs))(q, k, v, seg, pos)

    def fwd(q, k, v, seg, pos):
        with attn.recording_kernels():  # jax traces `call` too, where the call is counted
            out = smap(local, in_specs=specs, out_specs=P(*qs))(q, k, v, seg, pos)
        return out, (q, k, v, seg, pos)

    def bwd(res, g):
        def grads(q, k, v, seg, pos, g):
            with attn.recording_kernels():  # the forward's call is counted once, where it was traced
                _, vjp = jax.vjp(lambda q, k, v: local(q, k, v, seg, pos), q, k, v)
                return vjp(g)

        dq, dk, dv = smap(grads, in_specs=(*specs, P(*qs)), out_specs=(P(*qs), P(*ks), P(*ks)))(*res, g)
        return dq, dk, dv, None, None

    call.defvjp(fwd, bwd)
    return call(q, k, v, seg, pos)
