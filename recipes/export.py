"""export: a run's latest checkpoint out to the formats its parts came from.

`python -m recipes export RUN_DIR output=DIR`: DIR/llm an HF Llama/Qwen2 folder with the tokenizer,
DIR/encoders/NAME an HF folder per pretrained encoder (SigLIP / Whisper names), DIR/projector.safetensors,
DIR/omnijax.json (the model config; `recipes generate DIR` reads it). A run started from a whole model's folder
(`init.model`, Qwen2.5-VL / Qwen2-VL) is written back as that kind of folder instead, under its names, shapes
and dtypes, with its config, processor, chat template and tokenizer (what transformers, vLLM and SGLang load).
A LoRA run (trainer.lora) also writes DIR/llm_adapter in PEFT's format over the base in DIR/llm (a Qwen run: over
DIR itself, under the names PEFT gives the LLM inside Qwen2_5_VLForConditionalGeneration), or with merge=true its
adapters merged into DIR/llm (DIR); encoder adapters are always merged into their encoder's weights
(omnijax/interop/peft.py). Written tensor by tensor from the parameters restored sharded over this machine's
devices, into a temporary folder renamed when complete.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnijax.config import ParallelConfig, build
from omnijax.errors import ConfigError

DESCRIPTION = "a run's latest checkpoint -> HF folders (LLM + tokenizer, SigLIP/Whisper encoders) + projector: export RUN_DIR output=DIR"


@dataclass
class ExportConfig:
    output: str = ""                 # the export folder (must not exist)
    merge: bool = False              # a LoRA run: adapters merged into DIR/llm, not written to DIR/llm_adapter (PEFT)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def main(argv: list[str]) -> int:
    from recipes.common import setup_devices

    if not argv or "=" in argv[0]:
        raise ConfigError("usage: python -m recipes export RUN_DIR output=DIR (RUN_DIR: runs/<trainer.run_name>)")
    run_dir, rest = Path(argv[0]), argv[1:]
    cfg = build(ExportConfig, None, rest, check=None)
    if not cfg.output:
        raise ConfigError("export needs output=DIR (a new folder)")
    out = Path(cfg.output)
    if out.exists():
        raise ConfigError(f"output={out} exists; choose a new folder or remove it (nothing was written)")
    setup_devices(rest)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()  # one process of a multi-host job: every process restores and gathers, 0 writes
    t0 = time.perf_counter()
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from omnijax.config import from_dict
    from omnijax.interop.bundle import write_bundle
    from omnijax.mm_config import MMConfig
    from omnijax.models.mllm import MultimodalModel
    from omnijax.train import warmstart

    saved = warmstart.run_config(run_dir)
    if "model" not in saved or not isinstance(saved["model"], dict) or "llm" not in saved["model"]:
        raise ConfigError(f"{run_dir}: not a multimodal run (its config.json has no model.llm); export reads "
                          "finetune / tiny_omni runs")
    model_cfg = from_dict(MMConfig, saved["model"], prefix="model.")
    from omnijax.interop import peft
    from omnijax.models import adapters

    lora = peft.lora_of(saved)  # a LoRA run: its adapters restored too (interop/peft.py writes them)
    if cfg.merge and lora is None:
        raise ConfigError(f"merge=true: {run_dir} has no adapters (trainer.lora); drop merge")
    abstract = nnx.state(nnx.eval_shape(lambda: adapters.attach(MultimodalModel(model_cfg, rngs=nnx.Rngs(0)), lora)),
                         nnx.Param)
    schedule = _pipeline_schedule(saved, model_cfg)
    saved_as = abstract if schedule is None else _stacked(abstract, model_cfg, lora, schedule)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = mesh.size

    def sharded(x):  # each tensor split over every device along its first divisible axis
        axis = next((i for i, d in enumerate(x.shape) if d % n == 0), None)
        spec = P(*([None] * axis + ["x"])) if axis is not None and n > 1 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params, step = warmstart.params_from_run(run_dir, jax.tree.map(sharded, saved_as), key="RUN_DIR")
    if schedule is not None:  # a pipelined run's LLM blocks, stacked [stage, repeat, layer, ...]: one per layer
        from omnijax.parallel.engine import unstack_params

        pure = nnx.to_pure_dict(params)
        pure["llm"] = unstack_params(params["llm"], schedule)
        nnx.replace_by_pure_dict(abstract, pure)  # in place: the unpipelined model's state, restored values
        params = abstract
    src = warmstart.origins(run_dir)
    trained, params = params, (peft.export_params(params, cfg.merge) if lora else params)
    if src.get("model"):  # a whole released model in, the same kind of folder out
        from omnijax.interop import qwen_vl

        qwen_vl.export(params, out, like=src["model"])
        if lora and not cfg.merge:  # the LLM's adapters over this folder, the tower's merged into it
            peft.write_adapter(out / peft.ADAPTER_DIR, trained["llm"], lora, str(out), qwen_vl=True)
        print(f"exported {run_dir} step {step} -> {out} (a Hugging Face folder like {src['model']}, "
              f"{time.perf_counter() - t0:.0f} s); generate with `python -m recipes generate {out} prompts=FILE "
              "output=OUT.jsonl`", file=sys.stderr)
        return 0
    write_bundle(out, model_cfg, params, llm_from=src["llm"], encoders_from=src["encoders"],
                 tokenizer=src["tokenizer"] or None,
                 extra={"run": str(run_dir.resolve()), "step": step, "tokenizer_from": src["tokenizer"]})
    if lora and not cfg.merge:
        peft.write_adapter(out / peft.ADAPTER_DIR, trained["llm"], lora, src["llm"])
    print(f"exported {run_dir} step {step} -> {out} ({time.perf_counter() - t0:.0f} s); generate with "
          f"`python -m recipes generate {out} prompts=FILE output=OUT.jsonl`", file=sys.stderr)
    return 0


def _pipeline_schedule(saved: dict, model_cfg) -> "object | None":
    """The pipeline schedule a run trained under (its `parallel.*`), None without pp: its checkpoint holds the
    LLM's blocks stacked as that schedule stacks them."""
    from omnijax.parallel.engine import layout_schedule
    from omnijax.parallel.mesh import parse_layout

    par = saved.get("parallel") or {}
    text = str(par.get("llm") or "")
    if "pp" not in text.lower():
        return None
    return layout_schedule(parse_layout(text), model_cfg.llm.num_layers, microbatches=int(par.get("microbatches") or 0),
                           schedule=par.get("pipeline_schedule") or "gpipe")


def _stacked(abstract, model_cfg, lora, schedule):
    """The Param state a pipelined run saved: the model's, its LLM prepared for `schedule`."""
    from flax import nnx

    from omnijax.models import adapters
    from omnijax.models.mllm import MultimodalModel
    from omnijax.parallel.engine import PipelinedLLM

    def build():
        model = adapters.attach(MultimodalModel(model_cfg, rngs=nnx.Rngs(0)), lora)
        model.llm = PipelinedLLM(model.llm, schedule)
        return model
    return nnx.state(nnx.eval_shape(build), nnx.Param)
