"""LoRA adapters out to PEFT's format, or merged into the Hugging Face folders (`recipes export` of a LoRA run).

`DIR/llm_adapter/` holds `adapter_config.json` and `adapter_model.safetensors` under PEFT's names
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]), so
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), DIR/llm_adapter)` computes what omnijax
computes (PEFT's scale is lora_alpha / r, as ours). `merge=true` writes `W + alpha/r·A·B` into `DIR/llm` in the
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
from omnijax.layers import lora as lora_lib
from omnijax.models import adapters

ADAPTER_DIR = "llm_adapter"
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


def adapter_tensors(llm_params: Any) -> dict[str, np.ndarray]:
    """PEFT's tensors of the LLM's adapters (an unstacked LLM's Param state, `blocks/N/attn/q_lora_a`, ...)."""
    out: dict[str, np.ndarray] = {}
    flat = {tuple(p): v for p, v in nnx.to_flat_state(llm_params if isinstance(llm_params, nnx.State)
                                                       else nnx.State(llm_params))}
    for path, var in sorted(flat.items(), key=lambda kv: tuple(map(str, kv[0]))):
        last = str(path[-1])
        if not last.endswith(lora_lib.A_SUFFIX):
            continue
        if len(path) != 4 or path[0] != "blocks":
            raise ValueError(f"adapter at {'/'.join(map(str, path))}: not a layer projection PEFT knows")
        layer, module, weight = int(path[1]), str(path[2]), last[:-len(lora_lib.A_SUFFIX)]
        hf = f"base_model.model.model.layers.{layer}.{HF_MODULES[(module, weight)]}"
        a = _host(var)
        b = _host(flat[path[:-1] + (weight + lora_lib.B_SUFFIX,)])
        rank = a.shape[-1]
        out[f"{hf}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T.astype(np.float32))
        out[f"{hf}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T.astype(np.float32))
    return out


def adapter_config(cfg: LoraConfig, base_model: str | None) -> dict:
    """PEFT's `adapter_config.json` for these adapters."""
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    targets = sorted({HF_MODULES[k].split(".")[1] for k in HF_MODULES if k[1] in cfg.targets})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": alpha, "lora_dropout": cfg.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "revision": None}


def write_adapter(folder: str | Path, llm_params: Any, cfg: LoraConfig, base_model: str | None) -> Path:
    """`folder/adapter_config.json` + `folder/adapter_model.safetensors` (process 0 writes)."""
    from safetensors.numpy import save_file

    tensors = adapter_tensors(llm_params)
    folder = Path(folder)
    if jax.process_index() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
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
