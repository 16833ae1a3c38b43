"""Expert parallelism: MoE experts sharded on ``ep``, tokens exchanged by all-to-all in ``shard_map``.

Routing reuses the model's pure ``omnijax.layers.moe.route`` per batch row (group), so capacity and
dropped tokens are exactly those of the single-device model. Each device builds its rows' dispatch
buffers ``[b, E, C, D]``; one all-to-all over ``ep`` sends expert e's slots to the device that owns e,
the owner runs its local experts on every source's slots, and a second all-to-all brings results back
to be combined with the router weights. Fixed capacity keeps every buffer static (no ragged exchange).
Expert weights may also be split on ``fsdp`` (gathered here, gradients reduce-scattered by the
transpose) and their hidden dim on ``tp`` (partial outputs summed with ``psum``).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from omnijax.layers.moe import expert_capacity, route


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _gather_dims(w: jax.Array, spec: P, keep: Sequence[str]) -> jax.Array:
    """All-gather every sharded dim of ``w`` except over the axes in ``keep``."""
    for dim, entry in enumerate(spec):
        for axis in reversed([a for a in _axes(entry) if a not in keep]):
            w = lax.all_gather(w, axis, axis=dim, tiled=True)
    return w


def ep_moe(moe: Any, x: jax.Array, segment_ids: jax.Array, *, mesh: Mesh, weight_specs: dict[str, P],
           axis: str = "ep", batch_axes: Sequence[str] = ("dp", "fsdp", "ep")) -> tuple[jax.Array, dict]:
    """Expert-parallel forward of an ``omnijax.layers.moe.MoE`` layer: ``x [B, L, D] -> (y, aux)``.

    ``weight_specs`` gives the PartitionSpec each expert weight (``gate``, ``up``, ``down``) has on
    ``mesh``; the expert dim must be sharded on ``axis`` exactly.
    """
    b, l, _ = x.shape
    E, k = moe.num_experts, moe.top_k
    ep = int(mesh.shape.get(axis, 1))
    cap = expert_capacity(l, E, k, moe.capacity_factor)
    bax = tuple(a for a in batch_axes if int(mesh.shape.get(a, 1)) > 1) or None
    n_rows = b
    # router in the automatic world: its weight may be fsdp-sharded, GSPMD gathers it
    logits = jnp.einsum("bld,de->ble", x, moe.router[...].astype(x.dtype), preferred_element_type=jnp.float32)
    ws = {n: getattr(moe, n)[...].astype(x.dtype) for n in ("gate", "up", "down")}
    hidden_axes = _axes(weight_specs["up"][2]) if len(weight_specs["up"]) > 2 else ()
    manual = {a for a in mesh.axis_names}

    def body(x, logits, seg, gate, up, down):
        gate, up = (_gather_dims(w, weight_specs[n], (axis, *hidden_axes)) for n, w in (("gate", gate), ("up", up)))
        down = _gather_dims(down, weight_specs["down"], (axis, *hidden_axes))
        r = jax.vmap(lambda lg, mk: route(lg, k, cap, mk))(logits, seg != 0)
        xe = jnp.einsum("btec,btd->becd", r.dispatch.astype(x.dtype), x)          # [b, E, C, D]
        xe = xe.reshape(xe.shape[0], ep, E // ep, cap, xe.shape[-1])
        xe = lax.all_to_all(xe, axis, 1, 1, tiled=True)                           # dim1: source device
        g = jnp.einsum("bsecd,edf->bsecf", xe, gate)
        u = jnp.einsum("bsecd,edf->bsecf", xe, up)
        ye = jnp.einsum("bsecf,efd->bsecd", jax.nn.silu(g) * u, down)
        ye = lax.all_to_all(ye, axis, 1, 1, tiled=True)                           # dim1: owner device
        ye = ye.reshape(ye.shape[0], E, cap, ye.shape[-1])
        y = jnp.einsum("btec,becd->btd", r.combine.astype(x.dtype), ye)
        if hidden_axes:
            y = lax.psum(y, hidden_axes)
        lb = jnp.sum(r.lb_loss)
        dropped = jnp.sum(r.dropped).astype(jnp.float32)
        if bax:
            lb, dropped = lax.psum(lb, bax), lax.psum(dropped, bax)
        return y, lb / n_rows, dropped

    rows = P(bax, None, None)
    specs = (rows, rows, P(bax, None), weight_specs["gate"], weight_specs["up"], weight_specs["down"])
    y, lb, dropped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(rows, P(), P()),
                                   axis_names=manual)(x, logits, segment_ids, ws["gate"], ws["up"], ws["down"])
    aux = {"moe_aux_loss": moe.aux_loss_weight * lb, "moe_lb_loss": lb, "moe_dropped_tokens": dropped}
    return y, aux
