"""Logical-axis rules: ``shardings/<name>.yaml`` maps model axis names to mesh axes.

Model code only says ``("embed", "mlp")``; these rules turn that into ``P("fsdp", "tp")`` for one
strategy. Parameters and activations have separate tables (the batch axis exists only for activations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.parallel.mesh import MESH_AXES

SHARDINGS_DIR = Path(__file__).resolve().parents[2] / "shardings"


@dataclass(frozen=True)
class Rules:
    name: str
    params: dict[str, tuple[str, ...]] = field(default_factory=dict)
    activations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    description: str = ""

    def spec(self, names: Sequence[str | None] | None, shape: Sequence[int] | None, mesh: Mesh,
             kind: str = "params") -> P:
        """PartitionSpec for one array; skips size-1 and already-used mesh axes and non-dividing ones."""
        if not names:
            return P()
        table = self.params if kind == "params" else self.activations
        used: set[str] = set()
        out: list[Any] = []
        for i, name in enumerate(names):
            axes = []
            extent = 1
            for axis in table.get(name, ()) if name else ():
                size = int(mesh.shape.get(axis, 1))
                if size == 1 or axis in used:
                    continue
                if shape is not None and shape[i] % (extent * size):
                    continue  # not divisible: leave this axis off (replication is visible in the byte checks)
                axes.append(axis)
                extent *= size
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def sharding(self, names: Sequence[str | None] | None, shape: Sequence[int] | None, mesh: Mesh,
                 kind: str = "activations") -> NamedSharding:
        return NamedSharding(mesh, self.spec(names, shape, mesh, kind))


def _axes_table(raw: Any, where: str) -> dict[str, tuple[str, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping 'logical_axis: [mesh axes]'")
    table = {}
    for logical, axes in raw.items():
        if axes is None:
            axes = []
        if isinstance(axes, str):
            axes = [axes]
        if not isinstance(axes, list):
            raise ConfigError(f"{where}.{logical}: expected a list of mesh axes, got {axes!r}")
        for a in axes:
            if a not in MESH_AXES:
                raise ConfigError(f"{where}.{logical}: unknown mesh axis '{a}'; known: {', '.join(MESH_AXES)}")
        table[str(logical)] = tuple(axes)
    return table


def load_rules(name: str) -> Rules:
    """Load ``shardings/<name>.yaml`` (or a path to a YAML file)."""
    import yaml

    path = Path(name)
    if path.suffix not in {".yaml", ".yml"}:
        path = SHARDINGS_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in SHARDINGS_DIR.glob("*.yaml"))
        raise ConfigError(f"parallel.rules={name!r}: no file {path}; known rule sets: {', '.join(known)}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    unknown = set(raw) - {"params", "activations", "description"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; allowed: params, activations, description")
    return Rules(name=path.stem, params=_axes_table(raw.get("params"), f"{path.name}:params"),
                 activations=_axes_table(raw.get("activations"), f"{path.name}:activations"),
                 description=str(raw.get("description", "")))


# ----------------------------------------------------------------------------- NNX state
def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any, rules: Rules, mesh: Mesh, extra_leading: Sequence[str] = ()) -> Any:
    """NamedSharding per variable of an NNX state, from its ``out_sharding`` logical names.

    ``extra_leading`` names leading axes added on top of the model's own (e.g. ``("stage",)`` when the
    pipeline stacks blocks).
    """
    def one(v: Any) -> Any:
        if not _is_var(v):
            return NamedSharding(mesh, P())
        names = v.get_metadata().get("out_sharding")
        value = v.get_value()
        if not jax.tree.leaves(value):  # a frozen part's slot in a partitioned optimizer state: nothing to place
            return v
        shape = getattr(value, "shape", ())
        if names is None:
            names = (None,) * (len(shape) - len(extra_leading))
        names = tuple(extra_leading) + tuple(names)
        if len(names) != len(shape):
            raise ConfigError(f"variable with logical axes {names} has rank {len(shape)} (shape {shape})")
        return v.replace(NamedSharding(mesh, rules.spec(names, shape, mesh, "params")))

    return jax.tree.map(one, state, is_leaf=_is_var)


def optimizer_shardings(optimizer: optax.GradientTransformation, params: Any, param_shardings: Any,
                        mesh: Mesh) -> Any:
    """Optimizer state sharded like the parameters it mirrors (moments); scalars replicated."""
    abstract = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, sh: sh, abstract, param_shardings,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def per_device_bytes(tree: Any) -> int:
    """Bytes that device 0 holds for a tree of (placed) arrays."""
    dev = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", []):
            if shard.device == dev:
                total += shard.data.nbytes
    return total


def promised_bytes(tree: Any, shardings: Any) -> int:
    """Bytes per device that a tree would take under these shardings (largest shard per leaf)."""
    total = 0
    for leaf, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shard = sh.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total
