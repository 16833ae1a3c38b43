"""Pretrained Hugging Face folders in and out: Llama/Qwen2 LLMs, SigLIP vision towers, Whisper encoders.

In: `*_config_from_folder` translate `config.json` (+ `preprocessor_config.json` for encoders) into
omnijax configs; `load_*_params(path, target)` fill a parameter state whose leaves carry their
shardings (`jax.ShapeDtypeStruct(..., sharding=)` or arrays): every process builds only its own
devices' shards (`jax.make_array_from_callback`) from the slices of the safetensors files that those
shards need, so no host ever holds the whole model. Out: `export_llm` / `export_encoder` write HF
folders under the original names, shapes and dtypes, gathering one tensor at a time (process 0
writes) into a temporary folder that is renamed into place when complete.

Each weight has a layout kind that says how omnijax's array relates to the HF tensor, so one reader
and one writer serve every format (omnijax shape S, HF shape T):
  same        S == T (or S = T[offset : offset + S[0]] for parts of a packed tensor)
  reshape     same elements, other shape (small tensors: biases, probes); read whole
  linear_in   omnijax [in, *out] = HF [offset + prod(out), in].T
  linear_out  omnijax [*in, out] = HF [out, prod(in)].T
  conv_patch  omnijax [p*p*C, d] rows (y, x, c) = HF Conv2d [d, C, p, p]
  conv1d      omnijax [k, in, out] = HF Conv1d [out, in, k]
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.errors import UserError
from omnijax.interop import hf, siglip, whisper
from omnijax.interop.tensors import CHUNK_BYTES, TensorIndex, write_file
from omnijax.mm_config import VisionConfig, WhisperConfig

KINDS = {"llama": "llama", "qwen2": "qwen2", "siglip": "siglip", "siglip_vision_model": "siglip",
         "whisper": "whisper"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                    "generation_config.json")
MAX_FILE_BYTES = 5 << 30  # exports split into model-0000i-of-0000n.safetensors beyond this (as transformers)


@dataclass(frozen=True)
class Tensor:
    """One omnijax parameter and the HF tensor (or part of one) it comes from."""
    hf: str
    path: tuple
    kind: str
    shape: tuple[int, ...]      # omnijax shape
    hf_shape: tuple[int, ...]   # the whole HF tensor's shape
    offset: int = 0             # rows of the HF tensor before this part


# ------------------------------------------------------------------------------ folders
def _folder(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"pretrained folder not found: {path}")
    if not (path / "config.json").exists():
        raise UserError(f"{path}: no config.json (expected a Hugging Face model folder from save_pretrained)")
    return path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def folder_kind(path: str | Path) -> str:
    """"llama" | "qwen2" | "siglip" | "whisper" from config.json's model_type."""
    path = _folder(path)
    model_type = _json(path / "config.json").get("model_type")
    if model_type not in KINDS:
        raise UserError(f"{path}: model_type {model_type!r} is not supported; omnijax reads "
                        f"{', '.join(sorted(KINDS))} folders")
    return KINDS[model_type]


def llm_config_from_folder(path: str | Path) -> LLMConfig:
    kind = folder_kind(path)
    if kind not in hf.SUPPORTED:
        raise UserError(f"{path}: a {kind} folder is not an LLM (expected llama or qwen2)")
    return hf.config_from_hf(_json(Path(path) / "config.json"))


def encoder_config_from_folder(path: str | Path) -> VisionConfig | WhisperConfig:
    """The encoder config of a SigLIP or Whisper folder, preprocessing included (its preprocessor_config.json)."""
    kind = folder_kind(path)
    path = Path(path)
    pre = _json(path / "preprocessor_config.json") if (path / "preprocessor_config.json").exists() else {}
    if kind == "siglip":
        return siglip.config_from_folder(_json(path / "config.json"), pre)
    if kind == "whisper":
        return whisper.config_from_hf(_json(path / "config.json"), pre)
    raise UserError(f"{path}: a {kind} folder is not an encoder (expected siglip or whisper)")


# ------------------------------------------------------------------------------ layouts
def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "same":
        return shape
    if kind == "linear_in":
        return (math.prod(shape[1:]), shape[0])
    if kind == "linear_out":
        return (shape[-1], math.prod(shape[:-1]))
    if kind == "conv1d":
        return (shape[2], shape[1], shape[0])
    if kind == "bias":
        return (math.prod(shape),)
    raise ValueError(kind)


def _layout(module: nnx.Module, entries: Iterable[tuple]) -> list[Tensor]:
    """Tensors from (HF name, variable, kind[, HF shape, offset]) entries of an abstract module."""
    paths = {id(v): tuple(p) for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}
    out = []
    for name, var, kind, *rest in entries:
        shape = tuple(var.shape)
        hf_shape = tuple(rest[0]) if rest and rest[0] is not None else _hf_shape(kind, shape)
        if kind == "bias":
            kind = "reshape"
        out.append(Tensor(name, paths[id(var)], kind, shape, hf_shape, rest[1] if len(rest) > 1 else 0))
    return out


def llm_tensors(cfg: LLMConfig) -> list[Tensor]:
    from omnijax.models.llm import LLM

    model = nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0)))
    return _layout(model, hf.weight_layout(model))


def encoder_tensors(cfg: VisionConfig | WhisperConfig, prefix: str | None = None) -> list[Tensor]:
    if isinstance(cfg, WhisperConfig):
        from omnijax.models.whisper import WhisperEncoder

        model = nnx.eval_shape(lambda: WhisperEncoder(cfg, rngs=nnx.Rngs(0)))
        return _layout(model, whisper.weight_layout(model, "encoder." if prefix is None else prefix))
    if isinstance(cfg, VisionConfig):
        if cfg.position != "learned" or cfg.merge != 1 or cfg.temporal_patch != 1 or not cfg.post_norm \
                or not cfg.patch_bias:
            raise UserError("this vision encoder has no Hugging Face counterpart: only SigLIP-shaped towers "
                            "(position=learned, merge=1, temporal_patch=1, post_norm, patch_bias) export")
        from omnijax.models.vision import VisionEncoder

        model = nnx.eval_shape(lambda: VisionEncoder(cfg, rngs=nnx.Rngs(0)))
        return _layout(model, siglip.weight_layout(model, "vision_model." if prefix is None else prefix))
    raise UserError(f"encoder config {type(cfg).__name__} has no Hugging Face format")


# ------------------------------------------------------------------------------ reading
def _ranges(idx: tuple, shape: tuple[int, ...]) -> list[range]:
    out = []
    for s, n in zip(tuple(idx) + (slice(None),) * (len(shape) - len(idx)), shape):
        r = range(*s.indices(n))
        if r.step != 1:
            raise ValueError(f"strided shard index {s}")
        out.append(r)
    return out


def _flat_rows(ranges: list[range], shape: tuple[int, ...]) -> np.ndarray:
    grids = np.ix_(*[np.arange(r.start, r.stop) for r in ranges])
    return np.ravel_multi_index(grids, shape).reshape(-1) if shape else np.zeros(1, np.int64)


def read_part(index: TensorIndex, t: Tensor, idx: tuple, read: Callable | None = None) -> np.ndarray:
    """omnijax's array of `t` at `idx` (a shard's slices), reading only what that shard needs.

    ``read(name, rows, rest)`` returns ``tensor[rows][:, *rest]`` (default: ``index.read``); every kind
    but the conv kernels makes exactly one such request."""
    read = read or index.read
    r = _ranges(idx, t.shape)
    sl = tuple(slice(x.start, x.stop) for x in r)
    n = tuple(len(x) for x in r)
    if t.kind == "same":
        if not t.shape:
            return read(t.hf).reshape(())
        return read(t.hf, (t.offset + r[0].start, t.offset + r[0].stop), sl[1:])
    if t.kind == "reshape":
        return read(t.hf).reshape(t.shape)[sl]
    if t.kind == "linear_in":
        rows = _flat_rows(r[1:], t.shape[1:]) + t.offset
        lo, hi = int(rows.min()), int(rows.max()) + 1
        block = read(t.hf, (lo, hi), (sl[0],))
        return block[rows - lo].T.reshape(n)
    if t.kind == "linear_out":
        cols = _flat_rows(r[:-1], t.shape[:-1])
        lo, hi = int(cols.min()), int(cols.max()) + 1
        block = read(t.hf, (r[-1].start, r[-1].stop), (slice(lo, hi),))
        return block[:, cols - lo].T.reshape(n)
    if t.kind == "conv_patch":
        block = read(t.hf, (r[1].start, r[1].stop))  # [d', C, p, p]
        return block.transpose(2, 3, 1, 0).reshape(-1, n[1])[sl[0]]
    if t.kind == "conv1d":
        return read(t.hf, (r[2].start, r[2].stop), (sl[1], sl[0])).transpose(2, 1, 0)
    raise ValueError(t.kind)


def _leaf(var: Any) -> Any:
    return var.get_value() if isinstance(var, (nnx.Variable, _LayerOf)) else var


def _sharding(value: Any) -> jax.sharding.Sharding:
    sharding = getattr(value, "sharding", None)
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _key(idx: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple((r.start, r.stop) for r in _ranges(idx, shape))


def _check(index: TensorIndex, tensors: list[Tensor], where: str) -> None:
    missing = sorted({t.hf for t in tensors if t.hf not in index})
    if missing:
        raise UserError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the config implies, e.g. "
                        f"{', '.join(repr(m) for m in missing[:3])}")
    for t in tensors:
        info = index.info(t.hf)
        if info.shape != t.hf_shape:
            raise UserError(f"{where}: tensor {t.hf!r} in {info.file.name} has shape {list(info.shape)}, "
                            f"config.json implies {list(t.hf_shape)}")


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


class _Request(Exception):
    """What ``read_part`` would read, caught before any byte is read."""


def _request(index: TensorIndex, t: Tensor, idx: tuple) -> tuple | None:
    """(rows, columns) of the 2-D view of `t`'s HF tensor that the shard at `idx` reads, or None (kinds or
    ranks read otherwise)."""
    info = index.info(t.hf)
    if len(info.shape) > 2 or t.kind in ("conv_patch", "conv1d") or (t.kind == "same" and not t.shape):
        return None
    seen = []

    def record(name, rows=None, rest=()):
        seen.append(_box(info, rows, rest))
        raise _Request

    try:
        read_part(index, t, idx, record)
    except _Request:
        pass
    return seen[0] if len(seen) == 1 and seen[0] is not None else None


def _box(info: Any, rows: tuple[int, int] | None, rest: tuple) -> tuple | None:
    """``read(name, rows, rest)`` as a block of the 2-D view [rows, columns] (None: not one block)."""
    n_rows = info.shape[0] if info.shape else 1
    width = int(np.prod(info.shape[1:], dtype=np.int64)) if info.shape else 1
    if len(rest) > 1 or (rest and len(info.shape) != 2):
        return None
    cols = (0, width)
    if rest:
        a, b, step = rest[0].indices(width)
        if step != 1:
            return None
        cols = (a, max(a, b))
    return (tuple(rows) if rows is not None else (0, n_rows)), cols


def _box_reader(index: TensorIndex, blocks: dict | None = None) -> Callable:
    """A ``read`` for ``read_part`` that reads only the requested block of a 2-D (or 1-D) tensor, or takes it
    from ``blocks`` (``{(rows, columns): array}``, filled ahead by ``_fill_boxes``)."""
    def read(name, rows=None, rest=()):
        info = index.info(name)
        box = _box(info, rows, rest) if info.shape and len(info.shape) <= 2 else None
        if box is None:
            return index.read(name, rows, rest)
        (r0, r1), (c0, c1) = box
        out = blocks.get(box) if blocks else None
        if out is None:
            out = index.read_box(name, (r0, r1), (c0, c1))
        return out.reshape((r1 - r0,) + ((c1 - c0,) if rest else info.shape[1:]))
    return read


def _fill_boxes(index: TensorIndex, name: str, boxes: list[tuple]) -> dict:
    """{box: array} for blocks (rows, columns) of one tensor, reading their union once: band by band of rows
    (between the boxes' edges), each band's merged column intervals in pieces of bounded size, each piece
    copied into every box it overlaps. Several local shards that split a row's columns share one read of it."""
    info = index.info(name)
    out = {box: np.empty((box[0][1] - box[0][0], box[1][1] - box[1][0]), info.dtype) for box in boxes}
    cuts = sorted({e for (r, _) in boxes for e in r})
    for a, b in zip(cuts, cuts[1:]):
        inside = [box for box in boxes if box[0][0] <= a and b <= box[0][1] and box[1][1] > box[1][0]]
        merged: list[list[int]] = []
        for c0, c1 in sorted(box[1] for box in inside):
            if merged and c0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], c1)
            else:
                merged.append([c0, c1])
        for c0, c1 in merged:
            step = max(1, CHUNK_BYTES // max(1, (c1 - c0) * info.dtype.itemsize))
            for ra in range(a, b, step):
                rb = min(b, ra + step)
                piece = index.read_box(name, (ra, rb), (c0, c1))
                for (r, c) in inside:
                    lo, hi = max(c[0], c0), min(c[1], c1)
                    if lo < hi:
                        out[r, c][ra - r[0]: rb - r[0], lo - c[0]: hi - c[0]] = piece[:, lo - c0: hi - c0]
    return out


def _read(index: TensorIndex, t: Tensor | Stacked, idx: tuple, read: Callable | None = None) -> np.ndarray:
    if isinstance(t, Tensor):
        return read_part(index, t, idx, read or _box_reader(index))
    r = _ranges(idx, t.shape)
    rest = tuple(idx)[3:]
    read = _box_reader(index)  # each layer's block of this shard only
    return np.stack([np.stack([np.stack([read_part(index, t.layers[s_, q, j], rest, read) for j in r[2]])
                               for q in r[1]]) for s_ in r[0]])


def _build(index: TensorIndex, t: Tensor | Stacked, dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """One global array of `t` in `sharding`, built from this process's device shards one at a time (each
    put on its device and dropped before the next). A plain tensor's blocks for all of this host's shards
    are filled first from their union (each byte read once, none outside it: several local devices that
    split a row's columns share one read of the row); host memory holds this host's share of one tensor
    beyond the devices', each block dropped once its shard is made. A pipelined stack reads each shard's
    own block of every layer."""
    per_device = sharding.addressable_devices_indices_map(t.shape)
    keys = {d: _key(idx, t.shape) for d, idx in per_device.items()}
    left = {k: list(keys.values()).count(k) for k in set(keys.values())}
    cache: dict = {}
    shards = []
    read, filled, box_of = None, {}, {}
    if isinstance(t, Tensor):  # this host's blocks of the tensor read together: each byte once
        first = {keys[d]: idx for d, idx in per_device.items()}
        box_of = {k: _request(index, t, idx) for k, idx in first.items()}
        if box_of and all(b is not None for b in box_of.values()):
            filled = _fill_boxes(index, t.hf, sorted(set(box_of.values())))
            read = _box_reader(index, filled)
    for device, idx in per_device.items():
        key = keys[device]
        if key not in cache:  # replicas of one shard on this host are read once
            cache[key] = np.asarray(_read(index, t, idx, read), dtype=dtype)
            if read is not None and not any(box_of[k] == box_of[key] for k in left if k != key and left[k]):
                filled.pop(box_of[key], None)  # its block is in the shard now
        shards.append(jax.device_put(cache[key], device))
        left[key] -= 1
        if not left[key]:
            jax.block_until_ready(shards[-1])
            del cache[key]
    return jax.make_array_from_single_device_arrays(t.shape, sharding, shards)


def load_params(index: TensorIndex, tensors: list[Tensor], target: Any, where: str) -> nnx.State:
    """`target` (Param state, leaves with shardings) filled from `index`, each process reading its shards only.

    A pipelined LLM's stacked blocks (`stages/...`, [stage, repeat, layer, ...]) are read layer by layer
    into the stack, each device taking the layers of its own stage."""
    flat = list(nnx.to_flat_state(target)) if isinstance(target, nnx.State) else list(
        nnx.to_flat_state(nnx.State(target)))
    by_path = {t.path: t for t in tensors}
    wanted: list[Tensor | Stacked] = []
    for path, var in flat:
        path = tuple(path)
        if path in by_path:
            wanted.append(by_path[path])
        elif path and path[0] == "stages" and len(_leaf(var).shape) >= 3:
            wanted.append(Stacked.of(path, tuple(_leaf(var).shape), by_path))
        else:
            raise UserError(f"{where}: target parameter {'/'.join(map(str, path))} has no tensor in this "
                            "checkpoint format")
    _check(index, [u for w in wanted for u in (w.layers.values() if isinstance(w, Stacked) else [w])], where)
    out = []
    for (path, var), t in zip(flat, wanted):
        value = _leaf(var)
        expect = t.shape if isinstance(t, Tensor) else t.shape[:3] + next(iter(t.layers.values())).shape
        if tuple(value.shape) != expect:
            raise UserError(f"{where}: target parameter {'/'.join(map(str, path))} has shape {list(value.shape)}, "
                            f"the checkpoint's config implies {list(expect)}")
        arr = _build(index, t, np.dtype(value.dtype), _sharding(value))
        out.append((path, var.replace(arr) if isinstance(var, nnx.Variable) else arr))
    return nnx.from_flat_state(out)


def _source_llm_tensors(path: Path) -> tuple[LLMConfig, TensorIndex, list[Tensor]]:
    cfg = llm_config_from_folder(path)
    index = TensorIndex(path)
    tensors = llm_tensors(cfg)
    known = {t.hf for t in tensors}
    extra = [n for n in index.tensors if n not in known and not n.endswith(hf._IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if extra:
        raise UserError(f"{path}: unexpected tensor(s) for a {cfg.num_layers}-layer "
                        f"{'tied' if cfg.tie_embeddings else 'untied'} model, e.g. {extra[0]!r}")
    return cfg, index, tensors


def load_llm_params(path: str | Path, target: Any) -> nnx.State:
    """The LLM's Param state (`target`: leaves ShapeDtypeStruct with .sharding, or arrays) from a Llama/Qwen2 folder."""
    path = _folder(path)
    _, index, tensors = _source_llm_tensors(path)
    return load_params(index, tensors, target, str(path))


def _whisper_prefix(index: TensorIndex) -> str:
    return "model.encoder." if "model.encoder.conv1.weight" in index else "encoder."


def _siglip_prefix(index: TensorIndex) -> str:
    """SiglipModel and older SiglipVisionModel files say `vision_model.`; transformers 5 saves a
    SiglipVisionModel bare."""
    return "" if "embeddings.patch_embedding.weight" in index else "vision_model."


def _prefix(cfg: Any, index: TensorIndex | None) -> str:
    if isinstance(cfg, WhisperConfig):
        return _whisper_prefix(index) if index is not None else "encoder."
    return _siglip_prefix(index) if index is not None else "vision_model."


def load_encoder_params(path: str | Path, target: Any) -> nnx.State:
    """A SigLIP vision tower's or a Whisper encoder's Param state from its folder (the rest is ignored)."""
    path = _folder(path)
    cfg = encoder_config_from_folder(path)
    index = TensorIndex(path)
    prefix = _prefix(cfg, index)
    flat = nnx.to_flat_state(target if isinstance(target, nnx.State) else nnx.State(target))
    has_head = any(p and p[0] == "head" for p, _ in flat)
    if isinstance(cfg, VisionConfig) and has_head != cfg.head:  # a target built without (or with) the head
        cfg = VisionConfig(**{**cfg.__dict__, "head": has_head})
    return load_params(index, encoder_tensors(cfg, prefix), target, str(path))


# ------------------------------------------------------------------------------ writing
def to_hf(t: Tensor, arr: np.ndarray) -> np.ndarray:
    """The HF rows of `t` (its whole tensor, or its rows of a packed one) from omnijax's full array."""
    if t.kind == "same":
        return arr
    if t.kind == "reshape":
        return arr.reshape(t.hf_shape)
    if t.kind == "linear_in":
        return arr.reshape(t.shape[0], -1).T
    if t.kind == "linear_out":
        return arr.reshape(-1, t.shape[-1]).T
    if t.kind == "conv_patch":
        d, c, p, _ = t.hf_shape
        return arr.reshape(p, p, c, d).transpose(3, 2, 0, 1)
    if t.kind == "conv1d":
        return arr.transpose(2, 1, 0)
    raise ValueError(t.kind)


def _gather(x: Any) -> np.ndarray:
    """One parameter as a host numpy array on every process (one tensor at a time).

    Assembled from the addressable shards (`np.asarray` of the whole array would cache a host copy on it
    for as long as the parameter lives). Across processes the tensor is first laid out whole on every
    process, split over that process's own devices, so each host holds it once, not once per device."""
    x = _leaf(x)
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not x.is_fully_addressable:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        local = jax.local_device_count()
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.array(devices).reshape(jax.process_count(), local), ("process", "local"))
        spec = PartitionSpec("local") if x.ndim and x.shape[0] % local == 0 else PartitionSpec()
        x = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, spec))(x)
    out = np.empty(x.shape, x.dtype)
    seen = set()
    for shard in x.addressable_shards:
        key = _key(shard.index, x.shape)
        if key not in seen:
            seen.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def _flat_params(params: Any) -> dict[tuple, Any]:
    """path -> parameter; a pipelined LLM's stacked blocks also answer ('blocks', i, ...) paths lazily."""
    state = params if isinstance(params, nnx.State) else nnx.State(params)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    stacked = {p: v for p, v in flat.items() if p and p[0] == "stages"}
    for path, var in stacked.items():
        shape = _leaf(var).shape
        stages, repeats, per = shape[:3]
        for s_ in range(stages):
            for r in range(repeats):
                for j in range(per):
                    flat[("blocks", (r * stages + s_) * per + j, *path[1:])] = _LayerOf(var, (s_, r, j))
    return flat


@dataclass(frozen=True)
class _LayerOf:
    """Layer (s, r, j) of a stacked parameter, sliced on the devices when gathered (one layer at a time)."""
    var: Any
    at: tuple[int, int, int]

    def get_value(self) -> jax.Array:
        return _take_layer(_leaf(self.var), *self.at)

    @property
    def dtype(self):
        return _leaf(self.var).dtype


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype if isinstance(x, _LayerOf) else _leaf(x).dtype)


@jax.jit
def _take_layer(stack: jax.Array, s_, r, j) -> jax.Array:
    return stack[s_, r, j]


def _grouped(tensors: list[Tensor]) -> list[tuple[str, list[Tensor]]]:
    groups: dict[str, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.hf, []).append(t)
    return list(groups.items())


def _hf_arrays(groups: list[tuple[str, list[Tensor]]], params: dict[tuple, Any],
               dtypes: dict[str, np.dtype]) -> Iterator[np.ndarray]:
    for name, parts in groups:
        if len(parts) == 1 and parts[0].offset == 0:
            yield np.asarray(to_hf(parts[0], _gather(params[parts[0].path])), dtypes[name])
            continue
        out = np.zeros(parts[0].hf_shape, dtypes[name])
        for t in parts:
            rows = to_hf(t, _gather(params[t.path]))
            out[t.offset:t.offset + rows.shape[0]] = rows
        yield out


def _write_weights(folder: Path, tensors: list[Tensor], params: Any, like: TensorIndex | None,
                   write: bool) -> None:
    """safetensors files (+ index when several) of `tensors`, every process gathering, process 0 writing."""
    flat = _flat_params(params)
    missing = [t for t in tensors if t.path not in flat]
    if missing:
        raise UserError(f"parameters lack {'/'.join(map(str, missing[0].path))} (for {missing[0].hf}); "
                        "they do not match the config being exported")
    groups = _grouped(tensors)
    dtypes = {}
    for name, parts in groups:
        if like is not None and name in like:
            dtypes[name] = like.info(name).dtype
        else:
            dtypes[name] = np.dtype(_dtype(flat[parts[0].path]))
    sizes = {name: math.prod(parts[0].hf_shape) * dtypes[name].itemsize for name, parts in groups}
    files: list[list[tuple[str, list[Tensor]]]] = [[]]
    used = 0
    for g in groups:
        if files[-1] and used + sizes[g[0]] > MAX_FILE_BYTES:
            files.append([])
            used = 0
        files[-1].append(g)
        used += sizes[g[0]]
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for fname, part in zip(names, files):
        arrays = _hf_arrays(part, flat, dtypes)
        header = [(name, parts[0].hf_shape, dtypes[name]) for name, parts in part]
        if write:
            write_file(folder / fname, header, arrays)
        else:
            for _ in arrays:  # every process takes part in each gather
                pass
    if write and len(files) > 1:
        index = {"metadata": {"total_size": int(sum(sizes.values()))},
                 "weight_map": {name: fname for fname, part in zip(names, files) for name, _ in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class AtomicFolder:
    """A folder written under a temporary name next to `out` and renamed to `out` when complete."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        if self.out.exists():
            raise UserError(f"{self.out} exists; choose a new output folder or remove it (nothing was written)")
        self.write = jax.process_index() == 0
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        if self.write:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp if self.tmp is not None else self.out

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp is not None:
            if exc_type is None:
                os.rename(self.tmp, self.out)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        if jax.process_count() > 1 and exc_type is None:
            from jax.experimental import multihost_utils

            # named by the folder's own name: process 0 writes a nested folder under its temporary parent, the
            # others name it under the final one, and every process must pass the same name
            multihost_utils.sync_global_devices(f"export {self.out.name}")


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _same_llm(a: LLMConfig, b: LLMConfig) -> bool:
    keys = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "qkv_bias",
            "tie_embeddings", "norm_eps", "rope")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def export_llm(params: Any, cfg: LLMConfig, out_dir: str | Path, *, like: str | Path | None = None,
               tokenizer_dir: str | Path | None = None) -> None:
    """An HF Llama/Qwen2 folder of the LLM's Param state: config.json, safetensors under HF names/shapes (the
    dtypes of `like`'s tensors when given, else the params'), tokenizer files; written atomically."""
    like_index = None
    if like is not None:
        like = _folder(like)
        like_cfg = _json(like / "config.json")
        model_type = folder_kind(like)
        if model_type not in hf.SUPPORTED:
            raise UserError(f"{like}: a {model_type} folder is not an LLM")
        config = like_cfg if _same_llm(hf.config_from_hf(like_cfg), cfg) else {
            **like_cfg, **hf.config_to_hf(cfg, model_type, like_cfg.get("dtype") or like_cfg.get("torch_dtype")
                                          or "float32")}
        like_index = TensorIndex(like)
    else:
        model_type = "qwen2" if cfg.qkv_bias else "llama"
        dtypes = {str(_dtype(v)) for v in _flat_params(params).values()}
        config = hf.config_to_hf(cfg, model_type, dtypes.pop() if len(dtypes) == 1 else "float32")
    hf.config_from_hf(config)  # what transformers would build must be what omnijax can: fail before writing
    tensors = llm_tensors(cfg)
    with AtomicFolder(out_dir) as folder:
        _write_weights(folder, tensors, params, like_index, jax.process_index() == 0)
        if jax.process_index() == 0:
            _dump(folder / "config.json", config)
            for src in (like, tokenizer_dir):
                if src is None:
                    continue
                for name in _TOKENIZER_FILES:
                    if (Path(src) / name).exists() and not (folder / name).exists():
                        shutil.copy2(Path(src) / name, folder / name)


def export_encoder(params: Any, cfg: VisionConfig | WhisperConfig, out_dir: str | Path, *,
                   like: str | Path | None = None) -> None:
    """An HF folder of an encoder's Param state: SigLIP -> SiglipVisionModel names (`vision_model.*`),
    Whisper -> the `encoder.*` tensors (under `like`'s prefix), config.json and preprocessor_config.json."""
    like_index = None
    if like is not None:
        like = _folder(like)
        like_index = TensorIndex(like)
    if isinstance(cfg, WhisperConfig):
        prefix = _prefix(cfg, like_index)
        config = _json(like / "config.json") if like is not None else whisper.config_to_hf(cfg)
        preprocessor = whisper.preprocessor_to_hf(cfg)
    elif isinstance(cfg, VisionConfig):
        prefix = _prefix(cfg, like_index)
        config = siglip.config_to_hf(cfg, _json(like / "config.json") if like is not None else None)
        preprocessor = siglip.preprocessor_to_hf(cfg)
    else:
        raise UserError(f"encoder config {type(cfg).__name__} has no Hugging Face format")
    flat = _flat_params(params)
    if isinstance(cfg, VisionConfig) and cfg.head != any(p and p[0] == "head" for p in flat):
        cfg = VisionConfig(**{**cfg.__dict__, "head": not cfg.head})
    tensors = encoder_tensors(cfg, prefix)
    with AtomicFolder(out_dir) as folder:
        _write_weights(folder, tensors, params, like_index, jax.process_index() == 0)
        if jax.process_index() == 0:
            _dump(folder / "config.json", config)
            if like is not None and (like / "preprocessor_config.json").exists():
                shutil.copy2(like / "preprocessor_config.json", folder / "preprocessor_config.json")
            else:
                _dump(folder / "preprocessor_config.json", preprocessor)
