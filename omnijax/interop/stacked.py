"""A pipelined LLM's parameters between the stacked layout the trainer holds ([stage, repeat, layer, ...], as
`omnijax.parallel.pipeline.stack_layers` lays them out) and the per-layer tensors of a Hugging Face folder:
`Stacked` reads each layer into its place in the stack, `flat_params` / `LayerOf` hand the writer one layer at a
time, sliced on the devices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from omnijax.errors import UserError


def leaf(var: Any) -> Any:
    return var.get_value() if isinstance(var, (nnx.Variable, LayerOf)) else var


@dataclass(frozen=True)
class Stacked:
    """A parameter of a pipelined LLM: every layer's tensor stacked [stage, repeat, layer, ...] the way
    `omnijax.parallel.pipeline.stack_layers` lays them out (entry (s, r, j) is layer (r*S + s)*per + j)."""
    path: tuple
    shape: tuple[int, ...]
    layers: dict  # (s, r, j) -> Tensor

    @staticmethod
    def of(path: tuple, shape: tuple[int, ...], by_path: dict) -> "Stacked":
        stages, repeats, per = shape[:3]
        layers = {}
        for s_ in range(stages):
            for r in range(repeats):
                for j in range(per):
                    key = ("blocks", (r * stages + s_) * per + j, *path[1:])
                    if key not in by_path:
                        raise UserError(f"pipelined parameter {'/'.join(map(str, path))}: no tensor for layer {key[1]}")
                    layers[s_, r, j] = by_path[key]
        return Stacked(path, tuple(shape), layers)


def flat_params(params: Any) -> dict[tuple, Any]:
    """path -> parameter; a pipelined LLM's stacked blocks also answer ('blocks', i, ...) paths lazily."""
    state = params if isinstance(params, nnx.State) else nnx.State(params)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    stacked = {p: v for p, v in flat.items() if p and p[0] == "stages"}
    for path, var in stacked.items():
        shape = leaf(var).shape
        stages, repeats, per = shape[:3]
        for s_ in range(stages):
            for r in range(repeats):
                for j in range(per):
                    flat[("blocks", (r * stages + s_) * per + j, *path[1:])] = LayerOf(var, (s_, r, j))
    return flat


@dataclass(frozen=True)
class LayerOf:
    """Layer (s, r, j) of a stacked parameter, sliced on the devices when gathered (one layer at a time)."""
    var: Any
    at: tuple[int, int, int]

    def get_value(self) -> jax.Array:
        return take_layer(leaf(self.var), *self.at)

    @property
    def dtype(self):
        return leaf(self.var).dtype


def param_dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype if isinstance(x, LayerOf) else leaf(x).dtype)


@jax.jit
def take_layer(stack: jax.Array, s_, r, j) -> jax.Array:
    return stack[s_, r, j]
