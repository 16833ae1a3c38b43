"""The training state: one pytree so that jit, sharding and checkpointing see all of it."""
from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@flax.struct.dataclass
class TrainState:
    step: jax.Array              # number of updates applied (int32 scalar)
    params: Any                  # fp32 master weights (an nnx.State of nnx.Param)
    opt_state: Any
    nonfinite_in_row: jax.Array  # consecutive skipped updates (non-finite loss or gradient)
    skipped_updates: jax.Array   # all skipped updates so far
    extra: Any = None            # mode-specific state (e.g. stale gradients); None when unused


def init_state(params: Any, optimizer: optax.GradientTransformation, extra: Any = None) -> TrainState:
    zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the step donates its state
    return TrainState(step=zero(), params=params, opt_state=optimizer.init(params),
                      nonfinite_in_row=zero(), skipped_updates=zero(), extra=extra)


def sharded_init(build: Callable[[], nnx.Module], optimizer: optax.GradientTransformation,
                 shardings_of: Callable[[Any], Any], mesh: Mesh) -> tuple[nnx.GraphDef, Any, TrainState]:
    """Build the model and its optimizer state directly in their shardings.

    `build()` makes the module to train (already in the placement's form, e.g. pipelined);
    `shardings_of(abstract_state)` gives the placement's shardings of a TrainState. The model is traced
    abstractly once (shapes and logical axes only), then one jitted init with those out-shardings creates
    every parameter and moment shard on its own device: no device ever holds a full-size array that
    the layout splits. Returns (graphdef, rest, state); `rest` (non-parameter variables) is replicated.
    """
    graph: list[nnx.GraphDef] = []

    def init() -> tuple[TrainState, Any]:
        graphdef, params, rest = nnx.split(build(), nnx.Param, ...)
        graph[:] = [graphdef]
        return init_state(params, optimizer), rest

    abstract_state, abstract_rest = jax.eval_shape(init)
    replicated = NamedSharding(mesh, P())
    out = (shardings_of(abstract_state), jax.tree.map(lambda _: replicated, abstract_rest))
    state, rest = jax.jit(init, out_shardings=out)()
    return graph[0], rest, state


def sharded_opt_init(params: Any, optimizer: optax.GradientTransformation,
                     shardings_of: Callable[[Any], Any]) -> TrainState:
    """TrainState for parameters already placed: the optimizer state is created in its shardings
    (the parameters' layout for the moments), never first on one device."""
    abstract = jax.eval_shape(lambda p: init_state(p, optimizer), params)
    shardings = shardings_of(abstract)
    return jax.jit(lambda p: init_state(p, optimizer), in_shardings=(shardings.params,),
                   out_shardings=shardings)(params)
