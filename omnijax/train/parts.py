"""Which parameters train: the model's parameter tree split into parts (`llm`, `projector`, encoder names, `lora`).

A stage of LLaVA-style training is a choice of parts (`trainer.trainable`): the optimizer is an optax
partition over these labels (frozen parts map to `set_to_zero`, so they hold no optimizer state and take
no weight decay), the gradient is taken with respect to the trainable leaves only (no backward pass
through a frozen encoder), and the update never touches a frozen leaf (bitwise unchanged). Per-part
learning rates (`optimizer.lr_scale`) scale the schedule of one part.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax

from omnijax.errors import ConfigError
from omnijax.models import adapters

LLM, PROJECTOR, LORA = "llm", "projector", adapters.LORA
# other names of a part in trainer.trainable / optimizer.lr_scale: Qwen2-VL's patch merger is its projector
ALIASES = {"merger": PROJECTOR}


def part_of(path: Sequence[Any]) -> str:
    """The part a parameter at `path` belongs to: `llm`, `projector`, its encoder's name, or `lora` for an
    adapter (omnijax/models/adapters.py). A text-only LLM's parameters (no `llm` prefix) are all `llm`."""
    return adapters.part_of(path)


def labels(params: Any) -> list[str]:
    """The part of every leaf of `params`, in `jax.tree.leaves` order."""
    return [part_of(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def label_tree(params: Any) -> Any:
    """`params` with each leaf replaced by its part name (optax's `param_labels`)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: part_of(path), params)


class Partition:
    """The parts of a parameter tree, which of them train, and each part's learning-rate scale."""

    def __init__(self, params: Any, trainable: Sequence[str] | None = None,
                 lr_scale: dict[str, float] | None = None):
        trainable = None if trainable is None else [ALIASES.get(p, p) for p in trainable]
        self.leaf_parts = labels(params)
        sizes: dict[str, int] = {}
        for part, leaf in zip(self.leaf_parts, jax.tree.leaves(params)):
            sizes[part] = sizes.get(part, 0) + int(getattr(leaf, "size", 0))
        self.sizes = sizes
        self.parts = list(sizes)
        known = ", ".join(self.parts)
        if LORA in sizes:  # adapters train, with trainer.trainable's parts beside them; adapted bases stay frozen
            adapted = {adapters.base_part(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
                       if adapters.is_adapter(path)}
            clash = sorted(adapted & set(trainable or []))
            if clash:
                raise ConfigError(f"trainer.trainable={list(trainable or [])}: {', '.join(clash)} carries adapters "
                                  "(trainer.lora.parts), whose base stays frozen; drop it from trainer.trainable")
            trainable = [LORA, *(p for p in (trainable or []) if p != LORA)]
        trainable = list(trainable or self.parts)
        for part in trainable:
            if part not in sizes:
                raise ConfigError(f"trainer.trainable: this model has no part {part!r}; its parts are {known}")
        self.trainable = [p for p in self.parts if p in trainable]
        self.lr_scale = {ALIASES.get(k, k): v for k, v in (lr_scale or {}).items()}
        for part, scale in self.lr_scale.items():
            if part not in sizes:
                raise ConfigError(f"optimizer.lr_scale.{part}: this model has no part {part!r}; its parts are {known}")
            if not isinstance(scale, (int, float)) or scale < 0:
                raise ConfigError(f"optimizer.lr_scale.{part}={scale!r}: must be a number >= 0")

    @property
    def frozen(self) -> list[str]:
        return [p for p in self.parts if p not in self.trainable]

    @property
    def is_trivial(self) -> bool:
        """Everything trains at the base learning rate: the plain optimizer does the same."""
        return not self.frozen and all(s == 1.0 for s in self.lr_scale.values())

    def mask(self) -> list[bool]:
        """Per leaf (in `jax.tree.leaves` order): does it train?"""
        train = set(self.trainable)
        return [p in train for p in self.leaf_parts]

    def summary(self) -> str:
        """One line per part: parameter count and whether it trains (printed at the start of a run)."""
        rows = []
        for part in self.parts:
            state = "trainable" if part in self.trainable else "frozen"
            scale = self.lr_scale.get(part, 1.0)
            rows.append(f"  {part:<12} {self.sizes[part]:>14,} {state}" + (f" (lr x{scale:g})" if scale != 1.0 else ""))
        t = sum(self.sizes[p] for p in self.trainable)
        f = sum(self.sizes[p] for p in self.frozen)
        return "\n".join([f"parameters: {t:,} trainable, {f:,} frozen"] + rows)
