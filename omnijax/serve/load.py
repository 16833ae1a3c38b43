"""The model a generation runs: from a run folder (latest checkpoint), an export folder or a Hugging Face LLM folder.

- run folder (`runs/NAME`: `config.json` + `checkpoints/STEP`): the model config of the run, the parameters of
  its latest checkpoint (only the `params` of the saved TrainState are read, never the optimizer state), the
  tokenizer the run trained with (`tokenizer.path`, else the folder of `init.llm`, else byte-level);
- export folder (`DIR/omnijax.json`, written by `recipes export`): read through
  `omnijax.interop.bundle.read_bundle`;
- a Hugging Face Llama/Qwen2 folder (`config.json` with a `model_type`): the LLM alone, with its tokenizer; a
  Qwen2.5-VL / Qwen2-VL folder: the whole multimodal model (`interop.qwen_vl.load_model`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from omnijax.config import LLMConfig, from_dict
from omnijax.errors import UserError


@dataclass
class Served:
    """What generation needs: the module with its parameters, the tokenizer, and end-of-answer ids."""
    model: nnx.Module                 # LLM or MultimodalModel
    tokenizer: Any                    # omnijax.data.tokenizer.Tokenizer
    eos_ids: tuple[int, ...]
    source: str                       # "run" | "export" | "hf"
    info: dict = field(default_factory=dict)


def source_kind(path: str | Path) -> str:
    """'run' | 'export' | 'hf', or a UserError saying what the folder lacks."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{path}: no such folder; give a run folder (runs/NAME), an export folder "
                        "(`python -m recipes export RUN output=DIR`) or a Hugging Face LLM folder")
    if (p / "omnijax.json").is_file():
        return "export"
    if (p / "config.json").is_file():
        try:
            cfg = json.loads((p / "config.json").read_text())
        except ValueError:
            raise UserError(f"{p / 'config.json'}: not valid JSON") from None
        if isinstance(cfg, dict) and "model_type" in cfg:
            return "hf"
        if isinstance(cfg, dict) and "model" in cfg:
            return "run"   # a run without a checkpoint is named by warmstart.latest_step
    raise UserError(f"{path}: neither a run folder (config.json + checkpoints/), an export folder (omnijax.json) "
                    "nor a Hugging Face LLM folder (config.json with model_type)")


def _eos_ids(tok: Any, hf_folder: Path | None = None) -> tuple[int, ...]:
    """The ids an answer ends on: those a Hugging Face folder names (`eos_token_id` of generation_config.json,
    else of config.json: where transformers' generate stops for that folder), else the tokenizer's eos."""
    for name in ("generation_config.json", "config.json"):
        if hf_folder is None or not (hf_folder / name).is_file():
            continue
        try:
            named = json.loads((hf_folder / name).read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            named = None
        ids = {int(i) for i in (named if isinstance(named, list) else [named]) if isinstance(i, int)}
        if ids:
            return tuple(sorted(ids))
    return (int(tok.eos),) if getattr(tok, "eos", None) is not None else ()


def load(path: str | Path, layout: str = "", devices: list | None = None) -> Served:
    """The model, tokenizer and end ids of a run, export or Hugging Face folder (see the module doc), its
    parameters read straight into the shardings of `layout` (``Generator(model, layout=...)``'s): each host
    reads only its shards, no device and no host holds the whole model."""
    kind = source_kind(path)
    if kind == "run":
        return load_run(path, layout, devices)
    if kind == "hf":
        return load_hf(path, layout, devices)
    return load_export(path, layout, devices)


def _target(layout: str, devices: list | None):
    """abstract model -> its Param state as ShapeDtypeStructs in the layout's shardings."""
    from omnijax.serve.generate import param_target

    return lambda model: param_target(model, layout, devices=devices)


def load_hf(path: str | Path, layout: str = "", devices: list | None = None) -> Served:
    """A Llama/Qwen2 folder read with sharded safetensors slices into the layout (``interop.pretrained.load_llm``)."""
    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.interop import pretrained

    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        raise UserError(f"{p}: no tokenizer.json next to the weights; copy the model's tokenizer files into it")
    from omnijax.interop import qwen_vl

    if qwen_vl.is_qwen_vl(p):  # a whole multimodal model (Qwen2.5-VL / Qwen2-VL, e.g. `recipes export`'s)
        model = qwen_vl.load_model(p, _target(layout, devices))
    else:
        model = pretrained.load_llm(p, _target(layout, devices))
    tok = load_tokenizer(str(p))
    return Served(model, tok, _eos_ids(tok, p), "hf", {"folder": str(p)})


def load_export(path: str | Path, layout: str = "", devices: list | None = None) -> Served:
    """An export folder (omnijax.json + llm/ + encoders/ + projector.safetensors) through `bundle.read_bundle`."""
    from omnijax.data.tokenizer import check_llm_vocab, load_tokenizer
    from omnijax.interop import bundle
    from omnijax.models.mllm import MultimodalModel

    target = _target(layout, devices)
    got = bundle.read_bundle(path, lambda cfg: target(nnx.eval_shape(lambda: MultimodalModel(cfg, rngs=nnx.Rngs(0)))))
    graphdef, _, rest = nnx.split(nnx.eval_shape(lambda: MultimodalModel(got.config, rngs=nnx.Rngs(0))),
                                  nnx.Param, ...)
    model = nnx.merge(graphdef, got.params, rest)
    tok = load_tokenizer(got.tokenizer)
    check_llm_vocab(tok, got.config.llm.vocab_size, f"export folder {path}")
    llm_dir = Path(path) / "llm"
    return Served(model, tok, _eos_ids(tok, llm_dir if llm_dir.is_dir() else None), "export",
                  {"folder": str(path), "tokenizer": got.tokenizer or "byte-level"})


def _model_config(model: dict) -> Any:
    """The run's `model` section: a multimodal config (with `llm`) or an LLM config."""
    if "llm" in model:
        from omnijax.mm_config import MMConfig

        return from_dict(MMConfig, model, "model.")
    return from_dict(LLMConfig, model, "model.")


def _tokenizer_path(cfg: dict) -> str:
    tok = (cfg.get("tokenizer") or {}).get("path") or ""
    if not tok:
        tok = (cfg.get("init") or {}).get("llm") or ""
    return str(tok)


def load_run(path: str | Path, layout: str = "", devices: list | None = None) -> Served:
    """A run folder's latest checkpoint (parameters only, through `train.warmstart.params_from_run`) restored
    into the layout's shardings, with the run's model config and tokenizer."""
    from omnijax.data.tokenizer import check_llm_vocab, load_tokenizer
    from omnijax.models.llm import LLM
    from omnijax.models.mllm import MultimodalModel
    from omnijax.train import warmstart

    run = Path(path)
    cfg = warmstart.run_config(run)
    if "model" not in cfg:
        raise UserError(f"{run / 'config.json'}: no model section; is this a training run folder?")
    model_cfg = _model_config(cfg["model"])
    multimodal = not isinstance(model_cfg, LLMConfig)
    build = (lambda: MultimodalModel(model_cfg, rngs=nnx.Rngs(0))) if multimodal else \
        (lambda: LLM(model_cfg, rngs=nnx.Rngs(0)))
    from omnijax.interop.peft import lora_of
    from omnijax.models.adapters import attach

    build = attach(build, lora_of(cfg))  # a LoRA run serves with its adapters (trainer.lora)
    abstract_model = nnx.eval_shape(build)
    graphdef, _, rest = nnx.split(abstract_model, nnx.Param, ...)
    params, step = warmstart.params_from_run(run, _target(layout, devices)(abstract_model), key="DIR")
    model = nnx.merge(graphdef, params, rest)
    tok_path = _tokenizer_path(cfg)
    tok = load_tokenizer(tok_path)
    check_llm_vocab(tok, (model_cfg.llm if multimodal else model_cfg).vocab_size, f"run {run}")
    hf_dir = Path(tok_path) if tok_path and (Path(tok_path) / "config.json").is_file() else None
    return Served(model, tok, _eos_ids(tok, hf_dir), "run", {"folder": str(run), "step": step,
                                                             "tokenizer": tok_path or "byte-level"})
