"""finetune: LLaVA-style training from pretrained parts on your converted shards.

Stage 1 (projector only, from Hugging Face folders):
  python -m recipes finetune init.llm=LLAMA_DIR init.encoders.vision=SIGLIP_DIR init.encoders.audio=WHISPER_DIR \
      trainer.trainable=[projector] data.sources=[shards/train] trainer.run_name=stage1
Stage 2 (LLM + projector, from stage 1's latest checkpoint):
  python -m recipes finetune init.checkpoint=runs/stage1 trainer.trainable=[llm,projector] \
      data.sources=[shards/train] trainer.run_name=stage2

`model.llm` comes from `init.llm`'s config.json, each `model.encoders.NAME` from its folder (SigLIP or
Whisper, with the preprocessing it was trained on); `init.checkpoint` takes the model and the tokenizer
of that run. A whole released MLLM (Qwen2.5-VL / Qwen2-VL) starts from `init.model=DIR` alone (stages:
`trainer.trainable` from vision, merger, llm). The data plane, held-out loss and parallel layouts are the library's multimodal wiring
(`omnijax.train.multimodal`), as in tiny_omni.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from omnijax.data.sources import WORLD
from omnijax.errors import ConfigError
from omnijax.train import multimodal, warmstart

DESCRIPTION = ("LLaVA-style fine-tuning from pretrained HF folders (init.llm, init.encoders.NAME; a whole Qwen2.5-VL: "
               "init.model) or a previous run (init.checkpoint), with frozen parts (trainer.trainable) on your shards")


@dataclass
class FinetuneConfig(multimodal.MultimodalConfig):
    init: warmstart.InitConfig = field(default_factory=warmstart.InitConfig)


def load(argv: list[str], name: str = "finetune", require_data: bool = True) -> FinetuneConfig:
    """recipes/configs/finetune.yaml <- key=value overrides, the model resolved from `init.*`, then checked.
    `require_data=False` (dryrun): no converted shards needed, a dryrun reads no data when capacity.* is given
    and plans from the built-in world's metadata otherwise."""
    from recipes.common import load_config

    cfg = load_config(name, argv, FinetuneConfig, check=None)
    if require_data and (not cfg.data.sources or WORLD in cfg.data.sources):
        raise ConfigError("finetune trains on your converted shards: data.sources=[DIR,...] (from `python -m recipes "
                          "convert input=FILE output=DIR tokenizer.path=LLM_DIR`); the built-in world is tiny_omni's")
    return multimodal.check(warmstart.resolve_init(cfg, argv))


def main(argv: list[str], name: str = "finetune") -> int:
    from recipes.common import setup_devices

    setup_devices(argv)
    cfg = load(argv, name)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()
    t0 = time.perf_counter()

    import jax
    from flax import nnx

    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.models.mllm import MultimodalModel, mm_loss
    from omnijax.train.loop import Trainer

    tok = load_tokenizer(cfg.tokenizer.path)
    warmstart.check_tokenizer(cfg, tok)
    placement = multimodal.placement(cfg)
    warmstart.check_placement(cfg, placement)
    loader = multimodal.train_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = multimodal.held_out_batches(cfg, tok)
    build_model = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    train_model, loss_fn = ((build_model, mm_loss) if placement is None else
                            (lambda: placement.prepare(build_model()), placement.loss_fn))
    trainer = Trainer(cfg, train_model, loss_fn, loader, placement=placement, eval_data=held_out)
    resuming = trainer.checkpointer is not None and trainer.checkpointer.latest_step() is not None
    if not resuming:  # a fresh start: the parameters come from init.*; a resumed run from its own checkpoint
        trainer.state = trainer.state.replace(params=warmstart.initial_params(cfg, trainer.state.params, name))
    result = trainer.fit()
    if result.status != "finished":
        return result.exit_code  # preempted: saved, not finished (EXIT_PREEMPTED)
    held = (f"eval_loss {result.eval['eval_loss']:.4f} over {result.eval['eval_tokens']} held-out tokens"
            if result.eval and "eval_loss" in result.eval else "no data.eval_sources: no held-out loss")
    data = {k: v for k, v in loader.metrics().items() if k.startswith(("skipped", "dropped"))}
    if jax.process_index() == 0:
        import json

        (trainer.run_dir / "eval.json").write_text(json.dumps({"metrics": result.eval or {}, "data": data,
                                                               "steps": cfg.trainer.steps}, indent=2))
    print(f"{held}; {data.get('skipped_bad_records', 0)} bad records skipped ({cfg.trainer.steps} steps, "
          f"{time.perf_counter() - t0:.0f} s) -> {trainer.run_dir}; export it with "
          f"`python -m recipes export {trainer.run_dir} output=DIR`", file=sys.stderr)
    return 0
