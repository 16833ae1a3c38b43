"""The training objective of any model: the global-mean loss and its gradient.

Loss is the token-weighted mean over the *global* batch: each microbatch contributes
sum(ce)/total_tokens, so gradient accumulation and any sharding of the batch give the same
update as one big batch (up to float reassociation). Model-level (not a trainer internal), so
parallel placements that run their own forward/backward (e.g. inside shard_map) use the same one.

A loss whose mean is over something else than tokens (DPO: pairs) says so with an attribute
`loss_fn.global_counts(batch) -> dict` of scalars over a whole batch, `count` its denominator: it is
computed once over the step's batch, divides every microbatch's loss_sum, and reaches each microbatch
call as `batch[GLOBAL_COUNTS]` (a loss normalising a term by another global count reads it there).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

# loss_fn(model, microbatch) -> (loss_sum, token_count, aux) with aux a dict of scalars.
LossFn = Callable[[Any, dict], tuple[jax.Array, jax.Array, dict]]
GLOBAL_COUNTS = "global_counts"  # the batch key of a loss's `global_counts` over the whole step (see above)


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Mixed precision: compute in `dtype` while gradients flow back to the fp32 masters."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def split_microbatches(batch: dict, count: int) -> dict:
    """[B, ...] -> [count, B/count, ...], interleaved (row j*count + a goes to microbatch a) so a
    batch sharded over its leading axis stays local to each device.

    A multimodal batch's encoder buffers (`NAME_inputs` / `_segment_ids` / `_positions`, whose rows are
    not LLM rows) go whole to every microbatch, and `NAME_dest` (flat LLM positions row * L + column)
    is renumbered into each microbatch's rows, -1 (dropped) for the positions of the others: each
    microbatch encodes the step's segments and keeps the outputs its own rows take, so the gradients
    add up to the whole batch's."""
    dests = [k for k in batch if k.endswith("_dest") and f"{k[:-5]}_inputs" in batch]
    media = {f"{k[:-5]}_{s}" for k in dests for s in ("inputs", "segment_ids", "positions")}
    L = batch["tokens"].shape[1] if "tokens" in batch else None

    def split(x):
        if x.shape[0] % count:
            raise ValueError(f"batch leading dim {x.shape[0]} is not divisible by grad_accum={count}")
        return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)

    def renumber(dest):
        rows = dest // L
        mine = [(dest >= 0) & (rows % count == a) for a in range(count)]
        return jnp.stack([jnp.where(m, rows // count * L + dest % L, -1).astype(dest.dtype) for m in mine])

    out = {}
    for k, v in batch.items():
        if k in dests:
            out[k] = renumber(v)
        elif k in media:
            out[k] = jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), v)
        else:
            out[k] = jax.tree.map(split, v)
    return out


def loss_and_grads(graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn, params: Any, batch: dict, *,
                   grad_accum: int = 1, compute_dtype: jnp.dtype = jnp.float32,
                   aux_weights: dict[str, float] | None = None,
                   total: jax.Array | None = None,
                   params_fn: Callable[[Any], Any] | None = None,
                   trainable: list[bool] | None = None) -> tuple[jax.Array, Any, dict]:
    """Global-mean loss, its gradient w.r.t. `params`, and summed aux metrics.

    `total` is the loss denominator (default: this batch's target tokens, or `loss_fn.global_counts`'s
    `count` where the loss has one); code that sees only its own rows of the global batch (inside
    shard_map) passes the global count so the parts sum up.
    `params_fn` maps the (compute-dtype) params before the model sees them, inside the differentiated
    function: e.g. gathering FSDP shards, whose transpose then reduce-scatters the gradients.
    `trainable` (one bool per leaf of `params`, in `jax.tree.leaves` order) differentiates with respect to
    the trainable leaves only: no backward pass runs into a frozen part that nothing trainable feeds
    (a frozen encoder), and the frozen leaves' gradients are zeros (never read by a partitioned optimizer)."""
    aux_weights = aux_weights or {}
    counts_fn, extra = getattr(loss_fn, "global_counts", None), {}
    if total is None and counts_fn is not None:  # the loss's own denominator, over the whole step's batch
        counts = counts_fn(batch)
        total, extra = jnp.maximum(counts["count"], 1.0), {GLOBAL_COUNTS: counts}
    elif total is None:
        total = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

    def objective(p, mb):
        p = cast_floating(p, compute_dtype)
        model = nnx.merge(graphdef, params_fn(p) if params_fn else p, rest)
        loss_sum, _, aux = loss_fn(model, {**mb, **extra})
        obj = loss_sum / total
        for name, weight in aux_weights.items():
            if name in aux and weight:
                obj = obj + weight * aux[name].astype(jnp.float32) / grad_accum
        return obj, (loss_sum / total, aux)

    if trainable is not None and not all(trainable):
        grad_fn = _partial_value_and_grad(objective, params, trainable)
    else:
        grad_fn = jax.value_and_grad(objective, has_aux=True)
    if grad_accum == 1:
        (_, (loss, aux)), grads = grad_fn(params, batch)
        return loss, grads, aux

    micro = split_microbatches(batch, grad_accum)

    def body(carry, mb):
        loss_acc, grad_acc, aux_acc = carry
        (_, (loss, aux)), grads = grad_fn(params, mb)
        return (loss_acc + loss, jax.tree.map(jnp.add, grad_acc, grads),
                jax.tree.map(jnp.add, aux_acc, aux)), None

    first = jax.tree.map(lambda x: x[0], micro)
    aux_shape = jax.eval_shape(lambda: grad_fn(params, first)[0][1][1])
    zeros_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), zeros_aux)
    (loss, grads, aux), _ = jax.lax.scan(body, init, micro)
    return loss, grads, aux


def _partial_value_and_grad(objective: Callable, params: Any, trainable: list[bool]) -> Callable:
    """`value_and_grad(objective, has_aux=True)` with respect to the leaves where `trainable` is True only;
    the gradient tree has zeros at the frozen leaves."""
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(trainable):
        raise ValueError(f"trainable mask has {len(trainable)} entries for {len(leaves)} parameter leaves")

    def rebuild(train_leaves: list, other: list) -> Any:
        it_t, it_f = iter(train_leaves), iter(other)
        return jax.tree.unflatten(treedef, [next(it_t) if t else next(it_f) for t in trainable])

    def fn(p, mb):
        ps = jax.tree.leaves(p)
        train = [x for x, t in zip(ps, trainable) if t]
        fixed = [x for x, t in zip(ps, trainable) if not t]
        out, g = jax.value_and_grad(lambda tl: objective(rebuild(tl, fixed), mb), has_aux=True)(train)
        return out, rebuild(g, [jnp.zeros(x.shape, x.dtype) for x in fixed])
    return fn
