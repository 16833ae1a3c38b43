"""Rematerialisation of encoder layers: `parallel.remat` (none | full | save_dots) as a tracing context.

Parallel code (the multiplexer, a trainer) enters `use_remat(mode)` while tracing the forward; layers
that honour it run each block through `run_checkpointed`, so model code never sees the config.
- ``none``: every activation is kept for the backward;
- ``full``: only each block's inputs are kept, the block is recomputed in the backward;
- ``save_dots``: matmul outputs without batch dimensions are kept, the cheap elementwise work is
  recomputed (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).
A bool reads as full (True) / none (False), as older configs wrote it. The mode is read while tracing:
jax caches a function's trace, so a function traced under one mode keeps it (trace a fresh one to change).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
from flax import nnx

from omnijax.errors import ConfigError

REMAT_MODES: tuple[str, ...] = ("none", "full", "save_dots")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("omnijax_remat", default="none")


def parse_remat(value: Any) -> str:
    """`parallel.remat` as one of REMAT_MODES; anything else is a ConfigError naming the field."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str) and value.strip().lower() in REMAT_MODES:
        return value.strip().lower()
    raise ConfigError(f"parallel.remat={value!r}: must be one of {', '.join(REMAT_MODES)}")


def remat_policy(mode: str) -> Callable | None:
    """The jax.checkpoint policy of a mode (None: save nothing but the inputs)."""
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable if parse_remat(mode) == "save_dots" else None


@contextlib.contextmanager
def use_remat(mode: Any) -> Iterator[None]:
    """Trace the enclosed forward with encoder blocks rematerialised as `mode` says."""
    token = _MODE.set(parse_remat(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def remat_mode() -> str:
    """The mode in force ("none" outside `use_remat`)."""
    return _MODE.get()


def run_checkpointed(block: nnx.Module, *args: Any, static: tuple = (), mode: str | None = None) -> Any:
    """`block(*args, *static)` under the remat mode in force (or `mode`): a jax.checkpoint around the
    block with its variables as explicit inputs (their gradients flow as usual); `static` arguments
    (host constants such as rotary tables) are closed over, not traced."""
    mode = parse_remat(remat_mode() if mode is None else mode)
    if mode == "none":
        return block(*args, *static)
    graph, state = nnx.split(block)
    return jax.checkpoint(lambda st, *a: nnx.merge(graph, st)(*a, *static), policy=remat_policy(mode))(state, *args)
