"""The export folder of a multimodal model: every part in the format it came from, plus what rebuilds the model.

    DIR/omnijax.json            the model config (MMConfig as a dict), where each part was initialised from,
                                the tokenizer folder (DIR/llm), the run and step it was exported from
    DIR/llm/                    Hugging Face Llama/Qwen2 folder incl. tokenizer.json / tokenizer_config.json
    DIR/encoders/NAME/          Hugging Face folder per encoder (SigLIP vision tower, Whisper encoder), or, for an
                                encoder of omnijax's own kinds, `omnijax.safetensors` under omnijax names
    DIR/projector.safetensors   the projectors under omnijax names (`NAME.fc1.kernel`, ...)

`write_bundle` writes it tensor by tensor from the (sharded) parameter state into a temporary folder that is
renamed into place when complete; `read_bundle` reads it back into a parameter state in any shardings
(`recipes generate` serves it). Format-specific work is the interop exporters' (omnijax/interop/pretrained.py).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from omnijax.errors import UserError
from omnijax.mm_config import MMConfig, encoder_configs
from omnijax.utils import AtomicFolder

FORMAT = 1
MANIFEST = "omnijax.json"
PROJECTOR_FILE = "projector.safetensors"
NATIVE_FILE = "omnijax.safetensors"
HF_KINDS = ("vit", "whisper")  # encoder kinds with a Hugging Face form (vit: when SigLIP-shaped)


@dataclass
class Bundle:
    config: MMConfig            # rebuilds the model: MultimodalModel(config, ...)
    params: Any                 # its Param state (nnx.State), in the shardings asked for
    tokenizer: str              # tokenizer folder (DIR/llm when it has tokenizer.json)
    manifest: dict              # omnijax.json as written


# --------------------------------------------------------------------------------- helpers
def _name(path: tuple) -> str:
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
    return ".".join(str(k) for k in keys if k != "value")


def _host(x: Any) -> np.ndarray:
    """One tensor on the host: gathered across processes when its shards live on several."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_native(params: Any, file: Path, write: bool) -> None:
    """A parameter subtree as one safetensors file under omnijax names. Every process takes part in each
    tensor's gather, one tensor after another; the writing process keeps them all and writes the file at the
    end (safetensors' `save_file` takes the whole dict), so it holds the subtree whole in host memory."""
    from safetensors.numpy import save_file

    tensors = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = _host(leaf)
        if write:
            tensors[_name(path)] = np.ascontiguousarray(arr)
    if write:
        save_file(tensors, str(file), metadata={"format": "omnijax"})


def load_native(file: Path, target: Any, where: str) -> Any:
    """`target` (leaves ShapeDtypeStructs with shardings, or arrays) filled from a `save_native` file: each
    device's shard built from the stored tensor (a missing or mis-shaped tensor is a one-line error)."""
    from safetensors import safe_open

    if not file.is_file():
        raise UserError(f"{where}: {file} is missing")
    with safe_open(str(file), framework="np") as f:
        names = set(f.keys())
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        wanted = [_name(p) for p, _ in flat]
        missing = [n for n in wanted if n not in names]
        if missing:
            raise UserError(f"{file}: lacks {len(missing)} tensor(s), e.g. {missing[0]!r} (written for another model?)")
        out = []
        for name, (_, t) in zip(wanted, flat):
            arr = f.get_tensor(name)
            if tuple(arr.shape) != tuple(t.shape):
                raise UserError(f"{file}: tensor {name!r} has shape {tuple(arr.shape)}, the model needs {tuple(t.shape)}")
            arr = arr.astype(t.dtype)
            sharding = getattr(t, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
            out.append(jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx]))
    return jax.tree.unflatten(jax.tree.structure(target), out)


def _hf_encoder(cfg: Any, origin: str | None) -> bool:
    """Does this encoder get a Hugging Face folder? Whisper always; a vit when it was initialised from SigLIP."""
    return cfg.kind == "whisper" or (cfg.kind == "vit" and origin is not None)


# ------------------------------------------------------------------------------------ write
def write_bundle(out_dir: str | Path, cfg: MMConfig, params: Any, *, llm_from: str | None = None,
                 encoders_from: dict[str, str] | None = None, tokenizer: str | None = None,
                 extra: dict | None = None) -> Path:
    """Write the export folder of a MultimodalModel's Param state (`params`: llm / encoders / projectors).

    `llm_from` / `encoders_from`: the HF folders the parts were initialised from (names, dtypes and config
    fields are kept); `tokenizer`: the tokenizer folder copied into DIR/llm. An existing DIR is an error."""
    from omnijax.interop import pretrained

    out = Path(out_dir)
    encoders_from = dict(encoders_from or {})
    encs = encoder_configs(cfg)
    write = jax.process_index() == 0
    parts: dict[str, Any] = {}
    with AtomicFolder(out) as folder:   # an existing DIR is one line, before anything is written
        pretrained.export_llm(params["llm"], cfg.llm, folder / "llm", like=llm_from, tokenizer_dir=tokenizer)
        parts["llm"] = {"folder": "llm", "from": llm_from, "format": "hf"}
        for name, enc in encs.items():
            origin = encoders_from.get(name)
            sub = folder / "encoders" / name
            if _hf_encoder(enc, origin):
                if write:
                    sub.parent.mkdir(parents=True, exist_ok=True)
                pretrained.export_encoder(params["encoders"][name], enc, sub, like=origin)
                parts[f"encoders.{name}"] = {"folder": f"encoders/{name}", "from": origin, "format": "hf"}
            else:
                if write:
                    sub.mkdir(parents=True, exist_ok=True)
                save_native(params["encoders"][name], sub / NATIVE_FILE, write)
                parts[f"encoders.{name}"] = {"folder": f"encoders/{name}", "from": origin, "format": "omnijax"}
        save_native(params["projectors"], folder / PROJECTOR_FILE, write)
        if write:
            has_tok = (folder / "llm" / "tokenizer.json").is_file()
            manifest = {"format": FORMAT, "model": dataclasses.asdict(cfg), "parts": parts,
                        "tokenizer": "llm" if has_tok else "", **(extra or {})}
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"bundle {out}")
    return out


# ------------------------------------------------------------------------------------- read
def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise UserError(f"{path}: no {MANIFEST} (not an export folder; write one with "
                        "`python -m recipes export RUN_DIR output=DIR`)")
    try:
        manifest = json.loads(file.read_text())
    except ValueError as exc:
        raise UserError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{file}: not an export manifest (a JSON object with format, model and parts)")
    if manifest.get("format") != FORMAT:
        raise UserError(f"{file}: format {manifest.get('format')!r}, this omnijax reads format {FORMAT}")
    for key in ("model", "parts"):
        if not isinstance(manifest.get(key), dict):
            raise UserError(f"{file}: no {key!r} mapping (damaged or hand-edited; export the run again)")
    for name, part in manifest["parts"].items():
        if not isinstance(part, dict) or not isinstance(part.get("folder"), str):
            raise UserError(f"{file}: parts.{name} has no folder")
        _inside(path, part["folder"], f"{file}: parts.{name}.folder")
    tok = manifest.get("tokenizer") or ""
    if not isinstance(tok, str):
        raise UserError(f"{file}: tokenizer={tok!r} is not a folder name")
    if tok:
        _inside(path, tok, f"{file}: tokenizer")
    return manifest


def _inside(root: Path, rel: str, where: str) -> Path:
    """`root / rel` when it names a place inside `root` (after links are followed); else one line: a manifest
    never sends a read outside its own folder."""
    target = (root / rel).resolve()
    if Path(rel).is_absolute() or not target.is_relative_to(root.resolve()):
        raise UserError(f"{where}={rel!r} points outside the export folder {root}; a bundle holds its parts inside it")
    return root / rel


def bundle_config(path: str | Path) -> MMConfig:
    """The model config of an export folder (to build the model and its shardings before reading weights)."""
    from omnijax.config import from_dict

    return from_dict(MMConfig, read_manifest(path)["model"], prefix="model.")


def read_bundle(path: str | Path, target: Any | Callable[[MMConfig], Any] | None = None) -> Bundle:
    """The export folder back as (config, parameters, tokenizer folder).

    `target`: the model's Param state with the shardings to read into (leaves ShapeDtypeStruct with .sharding,
    or arrays), or a function config -> such a state; None: every tensor on the first device."""
    from omnijax.interop import pretrained
    from omnijax.models.mllm import MultimodalModel

    path = Path(path)
    manifest = read_manifest(path)
    cfg = bundle_config(path)
    if callable(target):
        target = target(cfg)
    if target is None:
        abstract = nnx.state(nnx.eval_shape(lambda: MultimodalModel(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    params = target
    params["llm"] = pretrained.load_llm_params(path / manifest["parts"].get("llm", {}).get("folder", "llm"),
                                               target["llm"])
    for name in encoder_configs(cfg):
        part = manifest["parts"].get(f"encoders.{name}", {})
        sub = path / part.get("folder", f"encoders/{name}")  # (checked inside the folder by read_manifest)
        if part.get("format") == "hf":
            params["encoders"][name] = pretrained.load_encoder_params(sub, target["encoders"][name])
        else:
            params["encoders"][name] = load_native(sub / NATIVE_FILE, target["encoders"][name], f"encoder {name}")
    params["projectors"] = load_native(path / PROJECTOR_FILE, target["projectors"], "projectors")
    tok = manifest.get("tokenizer") or ""
    return Bundle(config=cfg, params=params, tokenizer=str(path / tok) if tok else "", manifest=manifest)
