"""LoRA / QLoRA adapters on a model's parts (`trainer.lora`): which projections get one, and the tree around them.

`attach(model, cfg)` gives every targeted projection of the named parts (`llm`, encoder names) an adapter
(omnijax/layers/lora.py: sibling parameters `<w>_lora_a`, `<w>_lora_b`, read through the module's own matmul),
before a layout prepares the model (pipeline stacking keeps them per layer like any parameter). The adapters
are ordinary `nnx.Param`s: the part labelled `lora` (`part_of`) is what trains, with `trainer.trainable`'s
parts beside it; the bases stay frozen (omnijax/train/parts.py), and checkpoints, resume and `init.checkpoint`
carry the adapters like every other parameter.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import LoraConfig
from omnijax.errors import ConfigError
from omnijax.layers import lora
from omnijax.layers.lora import A_SUFFIX, B_SUFFIX, SCALE_SUFFIX  # noqa: F401 (the adapter leaves' names)
from omnijax.layers.attention import Attention
from omnijax.layers.mlp import MLP
from omnijax.models.encoder_layers import SelfAttention

LORA = "lora"  # the part name of every adapter parameter
# module class -> {weight attribute: number of leading input axes}; `targets` names are these attributes
TARGETS: dict[type, dict[str, int]] = {
    Attention: {"q": 1, "k": 1, "v": 1, "o": 2},
    SelfAttention: {"q": 1, "k": 1, "v": 1, "o": 2},
    MLP: {"gate": 1, "up": 1, "down": 1},
}
ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _key(entry: Any) -> Any:
    if isinstance(entry, (str, int)):
        return entry
    return getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", None)))


def base_part(path: Sequence[Any]) -> str:
    """The part a parameter at `path` belongs to, adapters counted with the part they adapt: `llm`, `projector`
    or its encoder's name (a text-only LLM's parameters, with no `llm` prefix, are all `llm`)."""
    keys = [_key(k) for k in path]
    for i, k in enumerate(keys):
        if k == "llm":
            return "llm"
        if k == "projectors":
            return "projector"
        if k == "encoders" and i + 1 < len(keys):
            return str(keys[i + 1])
    return "llm"


def is_adapter(path: Sequence[Any]) -> bool:
    """Is the parameter at `path` (tree path or flat-state path) an adapter's A or B?"""
    return any(str(_key(k)).endswith((lora.A_SUFFIX, lora.B_SUFFIX)) for k in path)


def part_of(path: Sequence[Any]) -> str:
    """`lora` for an adapter parameter, else its `base_part`."""
    return LORA if is_adapter(path) else base_part(path)


def enabled(cfg: LoraConfig | None) -> bool:
    return cfg is not None and cfg.rank > 0


def check(cfg: LoraConfig) -> None:
    """Values types alone cannot check: one line naming the field."""
    if cfg.rank < 0:
        raise ConfigError(f"trainer.lora.rank={cfg.rank}: must be >= 0 (0 = no adapters)")
    if not cfg.alpha > 0:
        raise ConfigError(f"trainer.lora.alpha={cfg.alpha}: must be > 0 (the adapter's scale is alpha/rank)")
    if cfg.dropout != 0.0:
        raise ConfigError(f"trainer.lora.dropout={cfg.dropout}: adapter dropout is not supported yet; use 0.0")
    bad = [t for t in cfg.targets if t not in ALL_TARGETS]
    if bad or not cfg.targets:
        raise ConfigError(f"trainer.lora.targets={cfg.targets}: each must be one of {', '.join(ALL_TARGETS)}")
    if not cfg.parts:
        raise ConfigError("trainer.lora.parts=[]: name the parts that get adapters (llm, or an encoder's name)")


def _part_roots(model: nnx.Module) -> dict[str, nnx.Module]:
    """The modules of each part that can carry adapters: the LLM (plain, pipelined or inside an assembly) and
    each encoder."""
    if hasattr(model, "llm") and hasattr(model, "encoders"):
        return {"llm": model.llm, **{name: enc for name, enc in model.encoders.items()}}
    return {"llm": model}


def adapt(model: nnx.Module, cfg: LoraConfig, seed: int = 0) -> nnx.Module:
    """`model` with adapters on `cfg.targets` of `cfg.parts` (in place; returned for chaining). Call it on the
    model as built, before a layout prepares it; inside a jitted init it creates each adapter in its sharding."""
    check(cfg)
    roots = _part_roots(model)
    for part in cfg.parts:
        if part not in roots:
            raise ConfigError(f"trainer.lora.parts: this model has no part {part!r} that takes adapters; its parts "
                              f"are {', '.join(roots)}")
    quant = "" if cfg.base_dtype == "float32" else cfg.base_dtype
    root_key = jax.random.key(seed + 0x10A)
    wanted = set(cfg.targets)
    for part in cfg.parts:
        found: set[str] = set()
        for path, module in nnx.iter_graph(roots[part]):
            table = TARGETS.get(type(module)) or TARGETS.get(getattr(type(module), "_lora_base_class", None))
            if table is None or not isinstance(module, nnx.Module):
                continue
            names = {n: k for n, k in table.items() if n in wanted}
            if not names or hasattr(type(module), "_lora_base_class"):
                continue
            layer, where = _layer_of(path)
            for name, n_in in names.items():
                key = jax.random.fold_in(root_key, zlib.crc32(f"{part}/{where}/{name}".encode()))
                lora.add_adapter(module, name, n_in, cfg.rank, cfg.alpha, key, layer, quant)
                found.add(name)
            module.__class__ = lora.adapted_class(type(module), names)
        missing = wanted - found
        if part == "llm" and missing or not found:
            raise ConfigError(f"trainer.lora.targets: part {part!r} has no projection named "
                              f"{', '.join(sorted(missing or wanted))} (its projections: "
                              f"{', '.join(sorted(found)) or 'none'})")
    return model


def _layer_of(path: Sequence[Any]) -> tuple[int, str]:
    """(layer index, the module's path without it) of a module inside a part: `blocks/3/attn` and the pipelined
    `stages/attn` both name `blocks/attn` (the stack draws each layer's slice from its own index)."""
    keys = [str(_key(k)) for k in path]
    if keys and keys[0] == "stages":
        return 0, "/".join(["blocks", *keys[1:]])
    for i, k in enumerate(keys[:-1]):
        if k == "blocks" and keys[i + 1].isdigit():
            return int(keys[i + 1]), "/".join(keys[:i + 1] + keys[i + 2:])
    return 0, "/".join(keys)


def attach(model: nnx.Module | Callable[[], nnx.Module], cfg: LoraConfig | None,
           seed: int = 0) -> nnx.Module | Callable[[], nnx.Module]:
    """`model` (a module or a function that builds one) with adapters when `cfg.rank > 0`, else unchanged."""
    if not enabled(cfg):
        return model
    check(cfg)
    if isinstance(model, nnx.Module):
        return adapt(model, cfg, seed)
    return lambda: adapt(model(), cfg, seed)


# ------------------------------------------------------------------------------------- the tree
def _flat(params: Any) -> list[tuple[tuple, Any]]:
    state = params if isinstance(params, nnx.State) else nnx.State(params)
    return [(tuple(p), v) for p, v in nnx.to_flat_state(state)]


def has_adapters(params: Any) -> bool:
    return any(is_adapter(p) for p, _ in _flat(params))


def split(params: Any) -> tuple[nnx.State, list[tuple[tuple, Any]]]:
    """(the Param state without adapters and quantisation scales, the adapter leaves as (path, leaf)): the
    base tree has the plain model's paths, which the Hugging Face readers and exporters know."""
    base, extra = [], []
    for path, leaf in _flat(params):
        last = str(path[-1])
        (extra if is_adapter(path) or last.endswith(lora.SCALE_SUFFIX) else base).append((path, leaf))
    return nnx.from_flat_state(base), extra


def join(base: Any, extra: list[tuple[tuple, Any]]) -> nnx.State:
    """The inverse of `split`."""
    return nnx.from_flat_state(_flat(base) + list(extra))


def quantized(params: Any) -> bool:
    return any(str(p[-1]).endswith(lora.SCALE_SUFFIX) for p, _ in _flat(params))


def with_base(params: Any, fn: Callable[[nnx.State], Any]) -> nnx.State:
    """`params` with its base replaced by `fn(base)` (e.g. a pretrained folder read into the base's shardings),
    the adapters kept. A quantised base is given to `fn` dequantised and stored quantised again."""
    base, extra = split(params)
    if not quantized(params):
        return join(fn(base), extra)
    scales = {p[:-1] + (str(p[-1])[:-len(lora.SCALE_SUFFIX)],): v for p, v in extra
              if str(p[-1]).endswith(lora.SCALE_SUFFIX)}
    flat = []
    for path, var in _flat(base):
        kind = var.get_metadata().get("lora_quant") if isinstance(var, nnx.Variable) else None
        flat.append((path, var.replace(lora.dequantize(var[...], scales[path][...], kind, jnp.float32),
                                       out_sharding=var.get_metadata().get("out_sharding")) if kind else var))
    loaded = _flat(fn(nnx.from_flat_state(flat)))
    out, new_extra = [], {p: v for p, v in extra}
    for (path, var), (_, old) in zip(loaded, _flat(base)):
        kind = old.get_metadata().get("lora_quant") if isinstance(old, nnx.Variable) else None
        if kind:
            codes, scale = jax.jit(lambda w, k=kind: lora.quantize(w, k),
                                   out_shardings=(old[...].sharding, scales[path][...].sharding))(var[...])
            var = old.replace(codes)
            sp = path[:-1] + (str(path[-1]) + lora.SCALE_SUFFIX,)
            new_extra[sp] = new_extra[sp].replace(scale)
        out.append((path, var))
    return join(nnx.from_flat_state(out), list(new_extra.items()))


def merged_base(params: Any) -> nnx.State:
    """The plain model's Param state with every adapter folded in (W + alpha/r·A·B, bases dequantised): what
    a merged export writes, and what the adapted model computes."""
    base, extra = split(params)
    leaves = dict(extra)
    out = []
    for path, var in _flat(base):
        meta = var.get_metadata() if isinstance(var, nnx.Variable) else {}
        a = leaves.get(path[:-1] + (str(path[-1]) + lora.A_SUFFIX,))
        w = var[...]
        if meta.get("lora_quant"):
            w = lora.dequantize(w, leaves[path[:-1] + (str(path[-1]) + lora.SCALE_SUFFIX,)][...],
                                meta["lora_quant"], jnp.float32)
        if a is not None:
            b = leaves[path[:-1] + (str(path[-1]) + lora.B_SUFFIX,)]
            w = lora.LoraArray(w, a[...], b[...], meta["lora_scale"], a[...].ndim - 1).merged()
        out.append((path, var.replace(w) if isinstance(var, nnx.Variable) else w))
    return nnx.from_flat_state(out)


def adapter_bytes(params: Any) -> dict[str, int]:
    """Bytes of the adapters and of the rest of the parameters (for the run's summary and the report)."""
    sizes = {"adapters": 0, "base": 0}
    for path, leaf in _flat(params):
        value = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
        n = int(value.size) * jnp.dtype(value.dtype).itemsize
        sizes["adapters" if is_adapter(path) else "base"] += n
    return sizes
