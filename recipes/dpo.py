"""dpo: preference training (sigmoid DPO) after SFT, on pair records or the built-in world's pairs.

  python -m recipes dpo init.checkpoint=runs/sft data.sources=[pairs_shards] dpo.beta=0.1
  python -m recipes dpo init.checkpoint=runs/tiny_omni data.sources=[world] data.seq_len=128   # the world's pairs

A pair record (`python -m recipes convert`: `{"segments": [...], "chosen": "...", "rejected": "..."}` or a
conversation with chosen/rejected answers, docs/data.md) is one sample of two documents that the data plane
mixes, plans and packs whole into one row; `models/preference.py` is the loss. The reference: `dpo.reference=
adapters` (default; trainer.lora's adapters train and the reference is the model with them off: the SFT model,
no second copy) or `precompute` (the initial weights' answer log-probabilities computed once before training,
`omnijax/train/reference.py`; works without adapters: full fine-tuning). The model, tokenizer and init.* are
finetune's (`omnijax.train.warmstart`), the data wiring the library's (`omnijax.train.multimodal`). On the
built-in world the world's settings follow init.checkpoint's run and its held-out questions are decoded at the
end (eval.json, per-modality accuracy). One process, plain data parallelism.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field

from omnijax.errors import ConfigError
from omnijax.train import multimodal, warmstart

DESCRIPTION = ("DPO (sigmoid, beta) after SFT on preference pairs (pair records of your shards, or the built-in "
               "world's: the correct answer chosen, a wrong one rejected); reference = adapters off or precomputed")


@dataclass
class DPOSection:
    beta: float = 0.1
    reference: str = "adapters"  # adapters: trainer.lora's adapters off; precompute: log-probabilities computed once
    rpo_alpha: float = 0.0       # > 0: add this weight x the chosen answers' token NLL (TRL's rpo_alpha)


@dataclass
class DPOConfig(multimodal.MultimodalConfig):
    init: warmstart.InitConfig = field(default_factory=warmstart.InitConfig)
    dpo: DPOSection = field(default_factory=DPOSection)


def load(argv: list[str], name: str = "dpo") -> DPOConfig:
    """recipes/configs/dpo.yaml <- key=value overrides, the model from init.* (as finetune's), then checked."""
    from omnijax.config import from_dict, merge, parse_overrides
    from omnijax.data.sources import WORLD
    from omnijax.data.world import WorldConfig
    from recipes.common import load_config

    cfg = load_config(name, argv, DPOConfig, check=None)
    d, t = cfg.dpo, cfg.trainer
    if d.reference not in ("adapters", "precompute"):
        raise ConfigError(f"dpo.reference={d.reference!r}: adapters (the model with trainer.lora's adapters off) or "
                          "precompute (the initial weights' log-probabilities, computed once)")
    if not d.beta > 0 or d.rpo_alpha < 0:
        raise ConfigError(f"dpo.beta={d.beta}, dpo.rpo_alpha={d.rpo_alpha}: beta must be > 0, rpo_alpha >= 0")
    if d.reference == "adapters" and t.lora.rank <= 0:
        raise ConfigError("dpo.reference=adapters is the model with its LoRA adapters off: set trainer.lora.rank > 0, "
                          "or dpo.reference=precompute to train the whole model")
    if t.grad_accum != 1 or t.staleness != "sync":
        raise ConfigError(f"trainer.grad_accum={t.grad_accum}, trainer.staleness={t.staleness}: DPO averages over the "
                          "step's pairs as one batch; use trainer.grad_accum=1 and trainer.staleness=sync")
    if cfg.parallel.llm or cfg.parallel.encoder:
        raise ConfigError(f"parallel.llm={cfg.parallel.llm!r} parallel.encoder={cfg.parallel.encoder!r}: DPO runs "
                          "with plain data parallelism over one process's devices for now; drop parallel.*")
    if not cfg.data.sources:
        raise ConfigError("data.sources=[...]: shards of preference pairs (`python -m recipes convert`), or [world]")
    if WORLD in cfg.data.sources:  # the world's pairs, in the world the SFT run trained on
        if cfg.init.checkpoint:
            prev = warmstart.run_config(cfg.init.checkpoint).get("world")
            if prev:  # the command line's world.* still hold over the SFT run's (coerced like any override)
                given = parse_overrides([a for a in argv if a.partition("=")[0].strip().startswith("world.")])
                cfg.world = from_dict(WorldConfig, merge(prev, given.get("world", {})), prefix="world.")
        cfg.world.pairs = True
    return multimodal.check(warmstart.resolve_init(cfg, argv))


def main(argv: list[str], name: str = "dpo") -> int:
    from recipes.common import setup_devices

    setup_devices(argv)
    cfg = load(argv, name)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()
    t0 = time.perf_counter()

    import jax
    import jax.numpy as jnp

    if jax.process_count() > 1:
        raise ConfigError("DPO runs in one process for now (plain data parallelism over its devices)")
    from flax import nnx

    from omnijax.data import world_eval
    from omnijax.data.sources import WORLD
    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.data.world import World
    from omnijax.models import adapters, preference
    from omnijax.models.mllm import MultimodalModel
    from omnijax.serve.evaluate import WorldAccuracy, eval_packer
    from omnijax.train import multimodal, reference, warmstart
    from omnijax.train.loop import Trainer

    tok = load_tokenizer(cfg.tokenizer.path)
    warmstart.check_tokenizer(cfg, tok)
    loader = multimodal.train_loader(cfg, tok)  # opens (and checks) the data before the model is built
    held_out = multimodal.held_out_batches(cfg, tok)
    build_model = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    precompute = cfg.dpo.reference == "precompute"
    if precompute:
        loader = reference.WithReference(loader)
    evaluate = items = None
    if WORLD in cfg.data.sources:  # greedy-decoded answers to the world's held-out questions (plain, not pairs)
        items = world_eval.eval_items(World(dataclasses.replace(cfg.world, pairs=False), "eval"), cfg.eval.items)
        packer = eval_packer(cfg.model, cfg.eval.batch_size, cfg.data.seq_len, cfg.data.batch_size, cfg.capacity)
        abstract = nnx.eval_shape(adapters.attach(build_model, cfg.trainer.lora, cfg.trainer.seed))
        evaluate = WorldAccuracy(abstract, packer, items, cfg.eval.max_new_tokens, cfg.eval.ablation_items)
    loss_fn = preference.dpo_loss(cfg.dpo.beta, rpo_alpha=cfg.dpo.rpo_alpha)
    trainer = Trainer(cfg, build_model, loss_fn, loader, eval_fn=evaluate, eval_data=held_out)
    params = warmstart.initial_params(cfg, trainer.state.params, name)  # the SFT model (and fresh adapters)
    resuming = trainer.checkpointer is not None and trainer.checkpointer.latest_step() is not None
    if precompute:  # from the initial weights, also when resuming (the same batches come again)
        dtype = jnp.dtype(cfg.trainer.compute_dtype)
        put = trainer.placement.put_batch
        loader.table = reference.precompute(multimodal.train_loader(cfg, tok), cfg.trainer.steps, trainer.graphdef,
                                            params, trainer.rest, put, dtype)
        if held_out is not None:
            batches = held_out()
            table = reference.precompute(iter(batches), len(batches), trainer.graphdef, params, trainer.rest, put,
                                         dtype, log=False)
            trainer.eval_data = lambda: list(reference.WithReference(iter(batches), table))
    if not resuming:
        trainer.state = trainer.state.replace(params=params)
    del params
    result = trainer.fit()
    if result.status != "finished":
        return result.exit_code  # preempted: saved, not finished (EXIT_PREEMPTED)
    last = result.history[-1] if result.history else {}
    dpo = {k: last[k] for k in ("loss", "dpo_accuracy", "dpo_reward_margin", "dpo_reward_chosen",
                                "dpo_reward_rejected") if k in last}
    data = {k: v for k, v in loader.metrics().items() if k.startswith(("skipped", "dropped"))}
    report = {"metrics": result.eval or {}, "dpo_last_logged": dpo, "data": data, "steps": cfg.trainer.steps,
              "beta": cfg.dpo.beta, "reference": cfg.dpo.reference, "wall_s": round(time.perf_counter() - t0, 1)}
    summary = ", ".join(f"{k} {v:.4f}" for k, v in dpo.items())
    if evaluate is not None:
        report.update({"chance": world_eval.chances(list(items)), **evaluate.report()})
        summary = world_eval.accuracy_table(result.eval, report["chance"], evaluate.zeroed, list(items)) + "\n" + summary
    elif result.eval and "eval_loss" in result.eval:
        summary += f"; held-out DPO loss {result.eval['eval_loss']:.4f}"
    (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"{summary} ({cfg.trainer.steps} steps, {report['wall_s']:.0f} s) -> {trainer.run_dir}/eval.json",
          file=sys.stderr)
    return 0

