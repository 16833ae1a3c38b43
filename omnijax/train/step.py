"""The jitted training step: a pure function of (state, batch).

Loss is the token-weighted mean over the *global* batch: each microbatch contributes
sum(ce)/total_tokens, so gradient accumulation and any sharding of the batch give the same
update as one big batch (up to float reassociation).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from omnijax.train.state import TrainState

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
                   params_fn: Callable[[Any], Any] | None = None) -> tuple[jax.Array, Any, dict]:
    """Global-mean loss, its gradient w.r.t. `params`, and summed aux metrics.

    `total` is the loss denominator (default: this batch's target tokens); code that sees only its
    own rows of the global batch (inside shard_map) passes the global count so the parts sum up.
    `params_fn` maps the (compute-dtype) params before the model sees them, inside the differentiated
    function: e.g. gathering FSDP shards, whose transpose then reduce-scatters the gradients."""
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


def apply_update(state: TrainState, grads: Any, optimizer: optax.GradientTransformation,
                 finite: jax.Array) -> TrainState:
    """Apply the optimizer where `finite`; otherwise keep everything and count the skip.

    A `lax.cond`, not `where(finite, new, old)`: the select would keep both versions of every donated
    parameter and moment alive and make XLA copy each leaf; the cond updates in place or not at all."""
    def update(st: TrainState) -> TrainState:
        updates, new_opt = optimizer.update(grads, st.opt_state, st.params)
        return st.replace(step=st.step + 1, params=optax.apply_updates(st.params, updates), opt_state=new_opt,
                          nonfinite_in_row=jnp.zeros_like(st.nonfinite_in_row))

    def skip(st: TrainState) -> TrainState:
        return st.replace(nonfinite_in_row=st.nonfinite_in_row + 1, skipped_updates=st.skipped_updates + 1)

    return jax.lax.cond(finite, update, skip, state)


def make_train_step(graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    *, grad_accum: int = 1, compute_dtype: jnp.dtype = jnp.float32,
                    aux_weights: dict[str, float] | None = None,
                    state_shardings: Any = None, grads_fn: Callable | None = None) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Build `step(state, batch) -> (state, metrics)`; jit it with the shardings of your layout.

    `state_shardings` (the placement's shardings of the TrainState) pins the gradients to their
    parameters' layout as soon as they are computed, so the batch reduction of a sharded (FSDP) weight's
    gradient is a reduce-scatter into its shard rather than a full all-reduce that is sliced afterwards
    (XLA:CPU does not make that rewrite by itself), and keeps the new state in the layout it came in.
    `grads_fn` replaces `loss_and_grads` (same signature), e.g. a placement's explicit-collective version."""

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads, aux = (grads_fn or loss_and_grads)(graphdef, rest, loss_fn, state.params, batch,
                                                        grad_accum=grad_accum, compute_dtype=compute_dtype,
                                                        aux_weights=aux_weights)
        if state_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, state_shardings.params)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_state = apply_update(state, grads, optimizer, finite)
        if state_shardings is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": jnp.sum(batch["loss_mask"]),
                   "update_skipped": 1 - finite.astype(jnp.int32),
                   "nonfinite_in_row": new_state.nonfinite_in_row, **aux}
        return new_state, metrics

    return step


def make_eval_step(graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn,
                   compute_dtype: jnp.dtype = jnp.float32) -> Callable[[Any, dict], tuple[jax.Array, jax.Array]]:
    """`eval_step(params, batch) -> (loss_sum, token_count)`."""

    def eval_step(params, batch):
        model = nnx.merge(graphdef, cast_floating(params, compute_dtype), rest)
        loss_sum, count, _ = loss_fn(model, batch)
        return loss_sum, count

    return eval_step
