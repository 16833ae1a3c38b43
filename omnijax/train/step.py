"""The jitted training step: a pure function of (state, batch).

The objective (global-mean loss and its gradient) is model-level: omnijax/models/objective.py.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from omnijax.layers.attention import compiling_for
from omnijax.models.objective import LossFn, cast_floating, loss_and_grads, split_microbatches  # noqa: F401
from omnijax.train.state import TrainState


def target_devices(shardings: Any) -> list | None:
    """The devices a step laid out by `shardings` is compiled for (the first sharding's mesh; None if none).

    Kernel choices (cuDNN attention) follow them, not `jax.default_backend()`: a step compiled on a CPU host
    for abstract H100s (`recipes dryrun target=h100`) picks what it would pick on the H100s."""
    for s in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)):
        if isinstance(s, jax.sharding.Sharding):
            return sorted(s.device_set, key=lambda d: d.id)
    return None


def apply_update(state: TrainState, grads: Any, optimizer: optax.GradientTransformation,
                 finite: jax.Array, trainable: list[bool] | None = None) -> TrainState:
    """Apply the optimizer where `finite`; otherwise keep everything and count the skip.

    `trainable` (one bool per parameter leaf): frozen leaves are carried over untouched (not `p + 0`),
    so they stay bitwise what they were.

    A `lax.cond`, not `where(finite, new, old)`: the select would keep both versions of every donated
    parameter and moment alive and make XLA copy each leaf; the cond updates in place or not at all."""
    def update(st: TrainState) -> TrainState:
        updates, new_opt = optimizer.update(grads, st.opt_state, st.params)
        if trainable is None or all(trainable):
            params = optax.apply_updates(st.params, updates)
        else:
            leaves, treedef = jax.tree.flatten(st.params)
            new = jax.tree.leaves(optax.apply_updates(st.params, updates))
            params = jax.tree.unflatten(treedef, [n if t else old for n, old, t in zip(new, leaves, trainable)])
        return st.replace(step=st.step + 1, params=params, opt_state=new_opt,
                          nonfinite_in_row=jnp.zeros_like(st.nonfinite_in_row))

    def skip(st: TrainState) -> TrainState:
        return st.replace(nonfinite_in_row=st.nonfinite_in_row + 1, skipped_updates=st.skipped_updates + 1)

    return jax.lax.cond(finite, update, skip, state)


def make_train_step(graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    *, grad_accum: int = 1, compute_dtype: jnp.dtype = jnp.float32,
                    aux_weights: dict[str, float] | None = None,
                    state_shardings: Any = None, grads_fn: Callable | None = None,
                    trainable: list[bool] | None = None) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Build `step(state, batch) -> (state, metrics)`; jit it with the shardings of your layout.

    `state_shardings` (the placement's shardings of the TrainState) pins the gradients to their
    parameters' layout as soon as they are computed, so the batch reduction of a sharded (FSDP) weight's
    gradient is a reduce-scatter into its shard rather than a full all-reduce that is sliced afterwards
    (XLA:CPU does not make that rewrite by itself), and keeps the new state in the layout it came in.
    `grads_fn` replaces `loss_and_grads` (same signature), e.g. a placement's explicit-collective version.
    `trainable` (one bool per parameter leaf, omnijax/train/parts.py): gradients of the trainable leaves
    only, frozen leaves untouched by the update (a placement's own `grads_fn` is not used then).
    Attention kernels are chosen for the devices of `state_shardings` (`target_devices`)."""
    partial = trainable is not None and not all(trainable)
    if partial:
        grads_fn = functools.partial(loss_and_grads, trainable=trainable)
    devices = target_devices(state_shardings)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with compiling_for(devices):  # kernels for the layout's devices, whatever backend traces the step
            loss, grads, aux = (grads_fn or loss_and_grads)(graphdef, rest, loss_fn, state.params, batch,
                                                            grad_accum=grad_accum, compute_dtype=compute_dtype,
                                                            aux_weights=aux_weights)
        if state_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, state_shardings.params)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_state = apply_update(state, grads, optimizer, finite, trainable if partial else None)
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
