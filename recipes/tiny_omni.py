"""tiny_omni: a tiny vision+audio+LLM model trained on the built-in world (then greedy-decoded) or on the
user's own shards (`data.sources=[...]`, held-out loss on `data.eval_sources=[...]`)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from omnijax.config import (Config, DataConfig, MMDataConfig, OptimizerConfig, ParallelConfig, TokenizerConfig,
                            TrainerConfig, build, validate)
from omnijax.data.sources import WORLD, check_source_path, source_specs
from omnijax.data.world import WorldConfig
from omnijax.errors import ConfigError
from omnijax.mm_config import MMConfig, encoder_configs
from omnijax.train import data_plane

DESCRIPTION = ("tiny vision+audio+LLM on the built-in multimodal world (CPU, minutes; per-modality answer accuracy "
               "vs chance) or on your own shards (data.sources=[...])")


@dataclass
class EvalConfig:
    items: int = 150              # held-out questions per modality
    batch_size: int = 32
    max_new_tokens: int = 14
    ablation_items: int = 64      # re-score this many per modality with encoder outputs zeroed (0 = off)


@dataclass
class OmniConfig:
    model: MMConfig = field(default_factory=MMConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: MMDataConfig = field(default_factory=MMDataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    # encoder name -> input rows of one global batch (multiples of its reduction); an encoder left out (or
    # `auto`) is sized at start from the sources' metadata (`data_plane.step_capacities`)
    capacity: dict[str, Any] = field(default_factory=dict)
    eval: EvalConfig = field(default_factory=EvalConfig)


def check(cfg: OmniConfig) -> OmniConfig:
    # the shared sections, with the LLM section checked as a text model's would be
    d = cfg.data
    validate(Config(model=cfg.model.llm, parallel=cfg.parallel, optimizer=cfg.optimizer, trainer=cfg.trainer,
                    data=DataConfig(source=WORLD, seq_len=d.seq_len, batch_size=d.batch_size, eval_batches=d.eval_batches)))
    if d.media.video_fps <= 0 or d.media.max_video_frames < 0:
        raise ConfigError(f"data.media: video_fps={d.media.video_fps} must be > 0 and "
                          f"max_video_frames={d.media.max_video_frames} >= 0")
    for key, paths in (("data.sources", d.sources), ("data.eval_sources", d.eval_sources)):
        for path in paths:
            check_source_path(key, path)
    if d.sources and WORLD not in d.sources and cfg.eval != EvalConfig():
        raise ConfigError("eval.* scores decoded answers to the built-in world's questions, which this run does "
                          "not train on (data.sources has no 'world'); use data.eval_sources for a held-out loss")
    if cfg.tokenizer.path and not any(p != WORLD for p in d.sources + d.eval_sources):
        raise ConfigError(f"tokenizer.path={cfg.tokenizer.path}: the built-in world is byte-level; a tokenizer is "
                          "for data.sources converted with it")
    encs = encoder_configs(cfg.model)
    unknown = sorted(set(cfg.capacity) - set(encs))
    if unknown:
        raise ConfigError(f"capacity.{unknown[0]}: no such encoder; this model's encoders: {sorted(encs)}")
    for name, enc in encs.items():
        r = enc.merge * enc.merge if hasattr(enc, "merge") else enc.reduction
        cap = cfg.capacity.get(name)
        if cap not in (None, "auto") and (not isinstance(cap, int) or cap <= 0 or cap % r):
            raise ConfigError(f"capacity.{name}={cap!r}: must be a positive multiple of {r} (the encoder's reduction), "
                              "or auto to size it from the data")
    if cfg.model.llm.max_seq_len < cfg.data.seq_len:
        raise ConfigError(f"model.llm.max_seq_len={cfg.model.llm.max_seq_len} must be >= data.seq_len={cfg.data.seq_len}")
    cfg.world.check()
    return cfg


def load(argv: list[str], name: str = "tiny_omni") -> OmniConfig:
    """recipes/configs/<name>.yaml <- key=value overrides, checked."""
    from recipes.common import CONFIGS

    named = any(o.startswith("trainer.run_name=") for o in argv)
    return build(OmniConfig, CONFIGS / f"{name}.yaml", argv,
                 defaults=None if named else {"trainer": {"run_name": name}}, check=check)


def _open(cfg: OmniConfig, key: str, paths: list[str], split: str, tok, mix, seed: int, steps: int = 0,
          placement=None):
    loader, cfg.capacity = data_plane.open_plane(key, paths, split, data=cfg.data, mm_cfg=cfg.model,
                                                 world_cfg=cfg.world, capacity=cfg.capacity, tok=tok, mix=mix,
                                                 seed=seed, steps=steps, placement=placement)
    return loader


def training_capacity(cfg: OmniConfig, tok=None) -> dict[str, int]:
    """`capacity.*` as training uses it: explicit values, the rest sized from `data.sources`' metadata
    (for code that packs or traces a step without opening the loader: tests, `dryrun`)."""
    from omnijax.data.sources import open_sources

    if not data_plane.capacities_known(cfg.capacity, cfg.model):
        specs = source_specs("data.sources", cfg.data.sources or [WORLD], "train")
        sources = open_sources(specs, cfg.world, tokenizer=tok, media_cfg=cfg.data.media)
        cfg.capacity = data_plane.size_capacities(cfg.capacity, sources, cfg.model, cfg.data.batch_size,
                                                  cfg.data.seq_len, "data.sources")
    return dict(cfg.capacity)


def make_loader(cfg: OmniConfig, tok=None, placement=None):
    """The training loader: the data plane over `data.sources` (the built-in world by default); its small
    state (window start, draw counts, deferred samples) goes into the checkpoint."""
    from omnijax.data.loader import TrainerBatches

    return TrainerBatches(_open(cfg, "data.sources", cfg.data.sources or [WORLD], "train", tok, cfg.data.mix,
                                cfg.trainer.seed, placement=placement))


def held_out_batches(cfg: OmniConfig, tok=None):
    """() -> the held-out host batches of `data.eval_sources` (None without them): `data.eval_batches`
    batches, each record at most once (a larger set is evaluated on its first part)."""
    if not cfg.data.eval_sources:
        return None
    loader = _open(cfg, "data.eval_sources", cfg.data.eval_sources, "eval", tok, None, seed=0,
                   steps=cfg.data.eval_batches)
    return data_plane.cached_batches(loader, cfg.data.eval_batches)


def multiplexed(cfg: OmniConfig):
    """The joint-step placement of `parallel.*` (None: plain DP on one process)."""
    from omnijax.train.placement import multimodal_placement

    return multimodal_placement(cfg.parallel, cfg.model)


def main(argv: list[str], name: str = "tiny_omni") -> int:
    from recipes.common import setup_devices

    setup_devices(argv)
    cfg = load(argv, name)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()  # --coordinator/--num-processes/--process-id, or Slurm/MPI/k8s: one job
    t0 = time.perf_counter()

    import jax
    from flax import nnx

    from omnijax.data import world_eval
    from omnijax.data.world import World, token_report
    from omnijax.models.mllm import MultimodalModel, describe, mm_loss
    from omnijax.serve.evaluate import WorldAccuracy, eval_packer
    from omnijax.train.loop import Trainer
    from omnijax.train.metrics import FlopCounter

    tok = None
    if cfg.tokenizer.path:
        from omnijax.data.tokenizer import check_vocab, load_tokenizer

        tok = load_tokenizer(cfg.tokenizer.path)
        check_vocab(tok, cfg.model.llm.vocab_size)
    # greedy-decoded accuracy needs the built-in world's questions; other data get the held-out loss
    world_eval_on = WORLD in (cfg.data.sources or [WORLD])

    placement = multiplexed(cfg)
    loader = make_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = held_out_batches(cfg, tok)
    build = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    model = nnx.eval_shape(build)  # shapes only: the trainer creates the parameters in their shardings
    counts = describe(model)
    print(f"{name}: params {counts}", file=sys.stderr)
    flops = FlopCounter.for_model(cfg.model.llm, encoder_configs(cfg.model),
                                  {k.partition(".")[2]: v for k, v in counts.items() if k.startswith("encoder.")},
                                  {k.partition(".")[2]: v for k, v in counts.items() if k.startswith("projector.")})
    train_model, loss_fn = ((build, mm_loss) if placement is None else
                            (lambda: placement.prepare(build()), placement.loss_fn))
    evaluate = None
    if world_eval_on:  # decodes with the single-device model; a parallel layout's params are mapped back to it
        items = world_eval.eval_items(World(cfg.world, "eval"), cfg.eval.items)
        packer = eval_packer(cfg.model, cfg.eval.batch_size, cfg.data.seq_len, cfg.data.batch_size, cfg.capacity)
        evaluate = WorldAccuracy(model, packer, items, cfg.eval.max_new_tokens, cfg.eval.ablation_items, placement)
    trainer = Trainer(cfg, train_model, loss_fn, loader, placement=placement, eval_fn=evaluate, eval_data=held_out,
                      step_flops=flops)
    result = trainer.fit()
    if result.status != "finished":
        return result.exit_code  # preempted: saved, not finished (EXIT_PREEMPTED)
    if jax.process_index() != 0:  # process 0 decoded the world's questions and reports for the job
        return 0
    t_total = time.perf_counter() - t0
    data = {k: v for k, v in loader.metrics().items() if k.startswith(("skipped", "dropped", "split"))}
    if evaluate is None:
        report = {"metrics": result.eval, "steps": cfg.trainer.steps, "wall_s": round(t_total, 1), "data": data,
                  "sources": cfg.data.sources, "eval_sources": cfg.data.eval_sources}
        held = (f"eval_loss {result.eval['eval_loss']:.4f} over {result.eval['eval_tokens']} held-out tokens"
                if "eval_loss" in (result.eval or {}) else "no data.eval_sources: no held-out loss")
        summary = f"{held}; {data.get('skipped_bad_records', 0)} bad records skipped "
    else:
        chances = world_eval.chances(list(items))
        report = {"metrics": result.eval, "chance": chances, **evaluate.report(),
                  "eval_items_per_modality": cfg.eval.items, "steps": cfg.trainer.steps,
                  "wall_s": round(t_total, 1), "data": data,
                  "tokens": token_report(World(cfg.world, "train"), 1000, cfg.model)}
        summary = world_eval.accuracy_table(result.eval, chances, evaluate.zeroed, list(items)) + "\n"
    (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"{summary}({cfg.trainer.steps} steps, {t_total:.0f} s) -> {trainer.run_dir}/eval.json", file=sys.stderr)
    return 0
