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
built-in world the world's settings follow init.checkpoint's run, and at the end its held-out questions are decoded
(eval.json: per-modality accuracy and its standard error) and scored as pairs before and after training
(`held_out_pairs`: preference and reward accuracy, `omnijax/train/reference.py`).

Every layout finetune runs on: plain data parallelism on one process, else (`parallel.llm` / `parallel.encoder`,
and every multi-process run) the trainer's joint step (`omnijax.parallel.multiplex`), whose hidden states
(`Multiplexer.hidden_states`: encoder outputs routed in, the LLM in its layout) go through the LLM head a chunk at
a time (`preference.hidden_logps`). Pairs stay whole in one row whatever the layout, and the loss is the mean over
the step's pairs under any trainer.grad_accum (`preference.global_counts`).
"""
from __future__ import annotations

import dataclasses
import json
import math
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
    dpop_lambda: float = 0.0     # > 0: DPO-Positive, the margin less lambda x max(0, ref - policy) of the chosen answer


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
    if not d.beta > 0 or d.rpo_alpha < 0 or d.dpop_lambda < 0:
        raise ConfigError(f"dpo.beta={d.beta}, dpo.rpo_alpha={d.rpo_alpha}, dpo.dpop_lambda={d.dpop_lambda}: beta "
                          "must be > 0, rpo_alpha and dpop_lambda >= 0")
    if d.reference == "adapters" and t.lora.rank <= 0:
        raise ConfigError("dpo.reference=adapters is the model with its LoRA adapters off: set trainer.lora.rank > 0, "
                          "or dpo.reference=precompute to train the whole model")
    if t.staleness != "sync":
        raise ConfigError(f"trainer.staleness={t.staleness}: DPO averages over the step's pairs; use "
                          "trainer.staleness=sync")
    if t.grad_accum > 1 and (cfg.parallel.llm or cfg.parallel.encoder):
        raise ConfigError(f"trainer.grad_accum={t.grad_accum} with parallel.llm/parallel.encoder: the joint step plans "
                          "its encoder routing per step, not per microbatch; use trainer.grad_accum=1 (or plain data "
                          "parallelism on one process)")
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
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    if jax.process_count() > 1 and cfg.trainer.grad_accum > 1:
        raise ConfigError(f"trainer.grad_accum={cfg.trainer.grad_accum} on {jax.process_count()} processes: several "
                          "processes take the joint step, which plans its encoder routing per step; use "
                          "trainer.grad_accum=1")

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
    placement = multimodal.placement(cfg)  # None: plain data parallelism on one process; else the joint step
    warmstart.check_placement(cfg, placement)
    loader = multimodal.train_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = multimodal.held_out_batches(cfg, tok)
    build_model = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    logps_fn, replicated = preference.model_logps, None
    if placement is not None:  # the joint step's hidden states through its LLM's head
        logps_fn = preference.hidden_logps(lambda m, b: (placement.hidden_states(m, b)[0], m.llm))
        replicated = NamedSharding(placement.mesh, PartitionSpec())  # scores every process reads whole
    precompute = cfg.dpo.reference == "precompute"
    if precompute:
        loader = reference.WithReference(loader)
    evaluate = items = pairs = None
    if WORLD in cfg.data.sources and cfg.eval.items > 0:  # greedy-decoded answers to the held-out questions
        items = world_eval.eval_items(World(dataclasses.replace(cfg.world, pairs=False), "eval"), cfg.eval.items)
        packer = eval_packer(cfg.model, cfg.eval.batch_size, cfg.data.seq_len, cfg.data.batch_size, cfg.capacity)
        abstract = nnx.eval_shape(adapters.attach(build_model, cfg.trainer.lora, cfg.trainer.seed))
        evaluate = WorldAccuracy(abstract, packer, items, cfg.eval.max_new_tokens, cfg.eval.ablation_items,
                                 placement)
        # the same held-out questions as preference pairs (the correct answer vs the world's wrong one)
        pair_world = World(dataclasses.replace(cfg.world, pairs=True), "eval")
        pair_packer = eval_packer(cfg.model, cfg.eval.batch_size, cfg.data.seq_len, cfg.data.batch_size, cfg.capacity)
        pairs = {m: reference.pack_all(pair_packer, [pair_world.sample(it.sample.index) for it in its])
                 for m, its in items.items() if its}  # eval.items=0: none
    loss_fn = preference.dpo_loss(cfg.dpo.beta, rpo_alpha=cfg.dpo.rpo_alpha, dpop_lambda=cfg.dpo.dpop_lambda,
                                  logps_fn=logps_fn)
    train_model = build_model if placement is None else (lambda: placement.prepare(build_model()))
    trainer = Trainer(cfg, train_model, loss_fn, loader, placement=placement, eval_fn=evaluate, eval_data=held_out)
    params = warmstart.initial_params(cfg, trainer.state.params, name)  # the SFT model (and fresh adapters)
    resuming = trainer.checkpointer is not None and trainer.checkpointer.latest_step() is not None
    if precompute:  # from the initial weights, also when resuming (the same batches come again)
        dtype = jnp.dtype(cfg.trainer.compute_dtype)
        put = trainer.placement.put_batch
        # the joint step's prefetcher reads whole data-plane windows ahead (to size their encoder buffers
        # together): the table covers the run's steps rounded up to a window
        window = max(int(getattr(loader, "window", 1) or 1), 1) if placement is not None else 1
        loader.table = reference.precompute(multimodal.train_loader(cfg, tok, placement),
                                            -(-cfg.trainer.steps // window) * window,
                                            trainer.graphdef, params, trainer.rest, put, dtype, logps_fn=logps_fn,
                                            out_sharding=replicated)
        if held_out is not None:
            batches = held_out()
            table = reference.precompute(iter(batches), len(batches), trainer.graphdef, params, trainer.rest, put,
                                         dtype, log=False, logps_fn=logps_fn, out_sharding=replicated)
            trainer.eval_data = lambda: list(reference.WithReference(iter(batches), table))
    dtype = jnp.dtype(cfg.trainer.compute_dtype)
    ref_pairs = {}
    if pairs:  # the held-out pairs under the reference (the initial weights, adapters off)
        ref_pairs = {m: reference.pair_logps(b, trainer.graphdef, params, trainer.rest, trainer.placement.put_batch,
                                             dtype, adapters_off=True, logps_fn=logps_fn, out_sharding=replicated)
                     for m, b in pairs.items()}
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
    if evaluate is not None and jax.process_index() == 0:  # decoding runs on process 0 (the others get no figures)
        report.update({"chance": world_eval.chances(list(items)), **evaluate.report()})
        report["accuracy_se"] = {f"{m}_accuracy": round(math.sqrt(max(a * (1 - a), 0.0) / len(items[m])), 4)
                                 for m in items for a in [result.eval[f"{m}_accuracy"]]}
        summary = world_eval.accuracy_table(result.eval, report["chance"], evaluate.zeroed, list(items)) + "\n" + summary
    if pairs:  # held-out preference pairs: before (the reference) and after training
        held = {}
        for m, b in pairs.items():
            policy = reference.pair_logps(b, trainer.graphdef, trainer.state.params, trainer.rest,
                                          trainer.placement.put_batch, dtype, logps_fn=logps_fn,
                                          out_sharding=replicated)
            held[m] = {"start": reference.pair_report(ref_pairs[m], ref_pairs[m], cfg.dpo.beta),
                       "end": reference.pair_report(policy, ref_pairs[m], cfg.dpo.beta)}
        report["held_out_pairs"] = held
        summary += "\nheld-out pairs (correct vs wrong answer): preference accuracy start -> end, reward accuracy, " \
                   "log p(chosen) / log p(rejected) start -> end"
        for m, h in held.items():
            a, e = h["start"], h["end"]
            summary += (f"\n  {m:<6} {a['preference_accuracy']:.3f} -> {e['preference_accuracy']:.3f} "
                        f"(se {e['preference_accuracy_se']:.3f}), reward {e['reward_accuracy']:.3f}, "
                        f"{a['logps_chosen']:.2f} / {a['logps_rejected']:.2f} -> "
                        f"{e['logps_chosen']:.2f} / {e['logps_rejected']:.2f} ({e['pairs']} pairs)")
    elif result.eval and "eval_loss" in result.eval:
        summary += f"; held-out DPO loss {result.eval['eval_loss']:.4f}"
    if jax.process_index() == 0:
        (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"{summary} ({cfg.trainer.steps} steps, {report['wall_s']:.0f} s) -> {trainer.run_dir}/eval.json",
          file=sys.stderr)
    return 0

