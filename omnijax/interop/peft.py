"""LoRA adapters out to PEFT's format, or merged into the Hugging Face folders (`recipes export` of a LoRA run).

`DIR/llm_adapter/` holds `adapter_config.json` and `adapter_model.safetensors` under PEFT's names
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]), so
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), DIR/llm_adapter)` computes what omnijax
computes (PEFT's scale is lora_alpha / r, as ours). A Qwen2-VL/Qwen2.5-VL model's LLM sits at
`model.language_model.layers.N` inside `Qwen2_5_VLForConditionalGeneration` (transformers >= 4.52, 5.x), so
its adapter's names are `base_model.model.model.language_model.layers.N...` and its config excludes the vision
tower (whose MLP names match `gate_proj`/`up_proj`/`down_proj` too): `PeftModel.from_pretrained(
Qwen2_5_VLForConditionalGeneration.from_pretrained(DIR), DIR/llm_adapter)`. Reading an adapter back
(`load_adapter`) takes either spelling. `merge=true` writes `W + alpha/r·A·B` into `DIR/llm` in the
original layout instead (PEFT's `merge_and_unload`). Encoder adapters are always merged into their encoder's
folder: vLLM and PEFT's LLM loaders serve LLM adapters only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from omnijax.config import LoraConfig, from_dict
from omnijax.models import adapters

ADAPTER_DIR = "llm_adapter"
# PEFT's prefix of the LLM's layers: a Llama/Qwen2 causal LM, and the LLM inside a Qwen2-VL/Qwen2.5-VL model
LLM_LAYERS = "base_model.model.model.layers."
QWEN_VL_LAYERS = "base_model.model.model.language_model.layers."
QWEN_VL_EXCLUDE = r".*visual.*"   # the vision tower: its adapters are merged into the folder, not PEFT's
# omnijax (module, weight) -> the Hugging Face Llama/Qwen2 submodule PEFT targets
HF_MODULES = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj",
              ("attn", "v"): "self_attn.v_proj", ("attn", "o"): "self_attn.o_proj",
              ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj", ("mlp", "down"): "mlp.down_proj"}


def lora_of(run_config: dict) -> LoraConfig | None:
    """The `trainer.lora` a run was trained with, or None when it has no adapters."""
    raw = ((run_config.get("trainer") or {}).get("lora")) or {}
    cfg = from_dict(LoraConfig, raw, prefix="trainer.lora.") if raw else None
    return cfg if adapters.enabled(cfg) else None


def _host(x: Any) -> np.ndarray:
    """One array whole on this host (gathered from every process when it is split across them)."""
    x = x[...] if isinstance(x, nnx.Variable) else x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def adapter_tensors(llm_params: Any, layers: str = LLM_LAYERS) -> dict[str, np.ndarray]:
    """PEFT's tensors of the LLM's adapters (an unstacked LLM's Param state, `blocks/N/attn/q_lora_a`, ...), named
    `layers` + `N.self_attn.q_proj.lora_A.weight`."""
    out: dict[str, np.ndarray] = {}
    flat = {tuple(p): v for p, v in nnx.to_flat_state(llm_params if isinstance(llm_params, nnx.State)
                                                       else nnx.State(llm_params))}
    for path, var in sorted(flat.items(), key=lambda kv: tuple(map(str, kv[0]))):
        last = str(path[-1])
        if not last.endswith(adapters.A_SUFFIX):
            continue
        if len(path) != 4 or path[0] != "blocks":
            raise ValueError(f"adapter at {'/'.join(map(str, path))}: not a layer projection PEFT knows")
        layer, module, weight = int(path[1]), str(path[2]), last[:-len(adapters.A_SUFFIX)]
        hf = f"{layers}{layer}.{HF_MODULES[(module, weight)]}"
        a = _host(var)
        b = _host(flat[path[:-1] + (weight + adapters.B_SUFFIX,)])
        rank = a.shape[-1]
        out[f"{hf}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T.astype(np.float32))
        out[f"{hf}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T.astype(np.float32))
    return out


def adapter_config(cfg: LoraConfig, base_model: str | None, exclude: str | None = None) -> dict:
    """PEFT's `adapter_config.json` for these adapters (`exclude`: PEFT's exclude_modules, a regex)."""
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    targets = sorted({HF_MODULES[k].split(".")[1] for k in HF_MODULES if k[1] in cfg.targets})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": alpha, "lora_dropout": cfg.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "revision": None, **({"exclude_modules": exclude} if exclude else {})}


def write_adapter(folder: str | Path, llm_params: Any, cfg: LoraConfig, base_model: str | None,
                  qwen_vl: bool = False) -> Path:
    """`folder/adapter_config.json` + `folder/adapter_model.safetensors` (process 0 writes); `qwen_vl`: the
    LLM of a Qwen2-VL/Qwen2.5-VL model (its names, the vision tower excluded)."""
    from safetensors.numpy import save_file

    tensors = adapter_tensors(llm_params, QWEN_VL_LAYERS if qwen_vl else LLM_LAYERS)
    folder = Path(folder)
    if jax.process_index() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = adapter_config(cfg, base_model, QWEN_VL_EXCLUDE if qwen_vl else None)
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def export_params(params: Any, merge: bool) -> nnx.State:
    """The plain model's Param state an export writes: every adapter merged (`merge`), or the LLM's base as it
    is (its adapters go to PEFT's folder) with the encoders' adapters merged."""
    merged = adapters.merged_base(params)
    if merge:
        return merged
    base = adapters.merged_base(_without(params, "llm"))  # dequantises a quantised LLM base, adds nothing
    base["encoders"] = merged["encoders"]
    return base


def _without(params: Any, part: str) -> nnx.State:
    """`params` with the adapters of `part` dropped (so merging leaves that part's base as it is)."""
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(params)
            if not (adapters.is_adapter(p) and adapters.base_part(p) == part)]
    return nnx.from_flat_state(flat)


def read_config(folder: str | Path) -> dict:
    """A PEFT adapter folder's `adapter_config.json` (one line when it is missing or not LoRA)."""
    from omnijax.errors import UserError

    path = Path(folder) / "adapter_config.json"
    if not path.is_file():
        raise UserError(f"init.adapter={folder}: no adapter_config.json (expected a PEFT LoRA adapter folder)")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise UserError(f"{path}: a {cfg.get('peft_type')} adapter{' with DoRA/rsLoRA' if cfg.get('peft_type') == 'LORA' else ''}"
                        "; omnijax reads plain LoRA adapters")
    return cfg


def lora_config(folder: str | Path) -> LoraConfig:
    """`trainer.lora` that matches a PEFT adapter folder (rank, alpha, targets), on the LLM."""
    from omnijax.errors import UserError

    cfg = read_config(folder)
    names = {HF_MODULES[k].split(".")[1]: k[1] for k in HF_MODULES}
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise UserError(f"init.adapter={folder}: target_modules {unknown} are not Llama/Qwen2 projections "
                        f"({', '.join(sorted(names))})")
    return LoraConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=[names[t] for t in targets],
                      parts=["llm"])


def load_adapter(folder: str | Path, params: Any) -> nnx.State:
    """`params` (the model's Param state with adapters, arrays in their shardings) with the LLM's adapters read
    from a PEFT folder, each put in the sharding of the array it replaces (the inverse of `adapter_tensors`)."""
    from safetensors.numpy import load_file

    from omnijax.errors import UserError

    folder = Path(folder)
    read_config(folder)
    files = sorted(folder.glob("adapter_model.safetensors"))
    if not files:
        raise UserError(f"init.adapter={folder}: no adapter_model.safetensors")
    # a Qwen-VL model's LLM layers read under the plain LLM's names
    tensors = {k.replace(".default", "").replace(QWEN_VL_LAYERS, LLM_LAYERS): v
               for k, v in load_file(str(files[0])).items()}
    flat = []
    for path, var in nnx.to_flat_state(params if isinstance(params, nnx.State) else nnx.State(params)):
        path = tuple(path)
        last = str(path[-1])
        if adapters.is_adapter(path) and adapters.base_part(path) == "llm":
            keys = [str(k) for k in path if str(k) != "llm"]
            layer, module, weight = int(keys[1]), keys[2], last[:-len(adapters.A_SUFFIX)]
            side = "A" if last.endswith(adapters.A_SUFFIX) else "B"
            name = f"base_model.model.model.layers.{layer}.{HF_MODULES[(module, weight)]}.lora_{side}.weight"
            if name not in tensors:
                raise UserError(f"init.adapter={folder}: no tensor {name} (the adapter does not cover this model's "
                                "targets: set trainer.lora.targets to its target_modules)")
            value = tensors[name].T  # A: [r, in] -> [in, r]; B: [out, r] -> [r, out]
            shape = tuple(var[...].shape)
            if value.size != int(np.prod(shape)):
                raise UserError(f"init.adapter={folder}: {name} has shape {list(tensors[name].shape)}, this model's "
                                f"adapter {'/'.join(keys)} needs {list(shape)} (rank or width differ)")
            value = value.reshape(shape).astype(np.dtype(var[...].dtype))
            var = var.replace(jax.device_put(value, var[...].sharding))
        flat.append((path, var))
    return nnx.from_flat_state(flat)
