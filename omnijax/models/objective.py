"""The training objective of any model: the global-mean loss and its gradient.

Loss is the token-weighted mean over the *global* batch: each microbatch contributes
sum(ce)/total_tokens, so gradient accumulation and any sharding of the batch give the same
update as one big batch (up to float reassociation). Model-level (not a trainer internal), so
parallel placements that run their own forward/backward (e.g. inside shard_map) use the same one.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

# loss_fn(model, microbatch) -> (loss_sum, token_count, aux) with aux a dict of scalars.
LossFn = Callable[[Any, dict], tuple[jax.Array, jax.Array, dict]]


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Mixed precision: compute in `dtype` while gradients flow back to the fp32 masters."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def split_microbatches(batch: dict, count: int) -> dict:
    """[B, ...] -> [count, B/count, ...], interleaved (row j*count + a goes to microbatch a) so a
    batch sharded over its leading axis stays local to each device."""
    def split(x):
        if x.shape[0] % count:
            raise ValueError(f"batch leading dim {x.shape[0]} is not divisible by grad_accum={count}")
        return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def loss_and_grads(graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn, params: Any, batch: dict, *,
                   grad_accum: int = 1, compute_dtype: jnp.dtype = jnp.float32,
                   aux_weights: dict[str, float] | None = None,
                   total: jax.Array | None = None,
                   params_fn: Callable[[Any], Any] | None = None,
                   trainable: list[bool] | None = None) -> tuple[jax.Array, Any, dict]:
    """Global-mean loss, its gradient w.r.t. `params`, and summed aux metrics.

    `total` is the loss denominator (default: this batch's target tokens); code that sees only its
    own rows of the global batch (inside shard_map) passes the global count so the parts sum up.
    `params_fn` maps the (compute-dtype) params before the model sees them, inside the differentiated
    function: e.g. gathering FSDP shards, whose transpose then reduce-scatters the gradients.
    `trainable` (one bool per leaf of `params`, in `jax.tree.leaves` order) differentiates with respect to
    the trainable leaves only: no backward pass runs into a frozen part that nothing trainable feeds
    (a frozen encoder), and the frozen leaves' gradients are zeros (never read by a partitioned optimizer)."""
    aux_weights = aux_weights or {}
    if total is None:
        total = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

    def objective(p, mb):
        p = cast_floating(p, compute_dtype)
        model = nnx.merge(graphdef, params_fn(p) if params_fn else p, rest)
        loss_sum, _, aux = loss_fn(model, mb)
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
