"""The training state: one pytree so that jit, sharding and checkpointing see all of it."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


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
