"""A multimodal run's wiring from its config: the sections every multimodal recipe shares and their check, the
placement, the training loader and the held-out batches.

tiny_omni, finetune, omni_8b, omni_moe and dryrun call these; a new recipe declares its config as a dataclass
inheriting `MultimodalConfig` (adding its own sections) and calls the same functions with it:

    cfg = build(MyConfig, yaml, argv, check=multimodal.check)   # omnijax.config.build
    placement = multimodal.placement(cfg)                 # None: plain DP on one process
    loader = multimodal.train_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = multimodal.held_out_batches(cfg, tok)       # None without data.eval_sources

The loader sizes `cfg.capacity` (encoders left out or `auto`) from the training sources' metadata and writes
the sized values back into the config, so the compiled step, the evaluation packer and the checkpointed
config agree on them (`data_plane.size_capacities`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from omnijax.config import (Config, DataConfig, MMDataConfig, OptimizerConfig, ParallelConfig, TokenizerConfig,
                            TrainerConfig, validate)
from omnijax.data.sources import WORLD, check_source_path, open_sources, source_specs
from omnijax.data.world import WorldConfig
from omnijax.errors import ConfigError
from omnijax.mm_config import MMConfig, encoder_configs
from omnijax.train import data_plane


@dataclass
class WorldEvalConfig:
    """Greedy-decoded answers to the built-in world's held-out questions (`eval.*`; the world only)."""
    items: int = 150              # held-out questions per modality
    batch_size: int = 32
    max_new_tokens: int = 14
    ablation_items: int = 64      # re-score this many per modality with encoder outputs zeroed (0 = off)


@dataclass
class MultimodalConfig:
    """The config sections of a multimodal run (a recipe's config inherits it and adds its own)."""
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
    eval: WorldEvalConfig = field(default_factory=WorldEvalConfig)


def check(cfg: MultimodalConfig) -> MultimodalConfig:
    """The shared sections checked (a ConfigError naming the key), the LLM's as a text model's would be."""
    d = cfg.data
    validate(Config(model=cfg.model.llm, parallel=cfg.parallel, optimizer=cfg.optimizer, trainer=cfg.trainer,
                    data=DataConfig(source=WORLD, seq_len=d.seq_len, batch_size=d.batch_size, eval_batches=d.eval_batches)))
    if d.media.video_fps <= 0 or d.media.max_video_frames < 0:
        raise ConfigError(f"data.media: video_fps={d.media.video_fps} must be > 0 and "
                          f"max_video_frames={d.media.max_video_frames} >= 0")
    for key, paths in (("data.sources", d.sources), ("data.eval_sources", d.eval_sources)):
        for path in paths:
            check_source_path(key, path)
    if d.sources and WORLD not in d.sources and cfg.eval != WorldEvalConfig():
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


def placement(cfg: MultimodalConfig, devices: list | None = None) -> Any:
    """The joint-step placement of `parallel.*` over `devices` (default: all); None: plain DP on one process."""
    from omnijax.train.placement import multimodal_placement

    placement = multimodal_placement(cfg.parallel, cfg.model, devices=devices)
    if placement is not None and cfg.trainer.grad_accum > 1:
        # the joint step's encoder buffers and routing tables are per device, planned for the whole step: a
        # microbatch split would cut them along devices, not rows
        raise ConfigError(f"trainer.grad_accum={cfg.trainer.grad_accum}: the joint multimodal step (parallel.llm/"
                          "parallel.encoder layouts, or several processes) trains each step whole; use "
                          "trainer.grad_accum=1 and a smaller data.batch_size per step, or plain DP on one process")
    return placement


def _open(cfg: MultimodalConfig, key: str, paths: list[str], split: str, tok: Any, mix: Any, seed: int,
          steps: int = 0, placement: Any = None) -> Any:
    loader, cfg.capacity = data_plane.open_plane(key, paths, split, data=cfg.data, mm_cfg=cfg.model,
                                                 world_cfg=cfg.world, capacity=cfg.capacity, tok=tok, mix=mix,
                                                 seed=seed, steps=steps, placement=placement)
    return loader


def training_capacity(cfg: MultimodalConfig, tok: Any = None) -> dict[str, int]:
    """`capacity.*` as training uses it: explicit values, the rest sized from `data.sources`' metadata
    (for code that packs or traces a step without opening the loader: tests, `dryrun`)."""
    if not data_plane.capacities_known(cfg.capacity, cfg.model):
        specs = source_specs("data.sources", cfg.data.sources or [WORLD], "train")
        sources = open_sources(specs, cfg.world, tokenizer=tok, media_cfg=cfg.data.media)
        cfg.capacity = data_plane.size_capacities(cfg.capacity, sources, cfg.model, cfg.data.batch_size,
                                                  cfg.data.seq_len, "data.sources")
    return dict(cfg.capacity)


def train_loader(cfg: MultimodalConfig, tok: Any = None, placement: Any = None) -> Any:
    """The training loader (`TrainerBatches`): the data plane over `data.sources` (the built-in world by
    default); its small state (window start, draw counts, deferred samples) goes into the checkpoint."""
    from omnijax.data.loader import TrainerBatches

    return TrainerBatches(_open(cfg, "data.sources", cfg.data.sources or [WORLD], "train", tok, cfg.data.mix,
                                cfg.trainer.seed, placement=placement))


def held_out_batches(cfg: MultimodalConfig, tok: Any = None) -> Callable[[], list[dict]] | None:
    """() -> the held-out host batches of `data.eval_sources` (None without them): `data.eval_batches`
    batches, each record at most once (a larger set is evaluated on its first part)."""
    if not cfg.data.eval_sources:
        return None
    loader = _open(cfg, "data.eval_sources", cfg.data.eval_sources, "eval", tok, None, seed=0,
                   steps=cfg.data.eval_batches)
    return data_plane.cached_batches(loader, cfg.data.eval_batches)
