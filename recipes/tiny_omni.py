"""tiny_omni: a tiny vision+audio+LLM model trained on the built-in world (then greedy-decoded) or on the
user's own shards (`data.sources=[...]`, held-out loss on `data.eval_sources=[...]`)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnijax.config import (Config, DataConfig, MMDataConfig, OptimizerConfig, ParallelConfig, TokenizerConfig,
                            TrainerConfig, build, validate)
from omnijax.data import tokenizer
from omnijax.data.packing import SamplePacker
from omnijax.data.sample import Sample
from omnijax.data.world import WorldConfig
from omnijax.errors import ConfigError
from omnijax.mm_config import MMConfig, encoder_configs

DESCRIPTION = ("tiny vision+audio+LLM on the built-in multimodal world (CPU, minutes; per-modality answer accuracy "
               "vs chance) or on your own shards (data.sources=[...])")
WORLD = "world"  # the built-in world's name among data.sources

PLACEHOLDER = {"image": tokenizer.IMAGE, "video": tokenizer.VIDEO, "audio": tokenizer.AUDIO}


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
    # `auto`) is sized at start from the sources' metadata (`loader.step_capacities`)
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


# ordered first-fit packing of one batch (greedy-decoding prompts; tests build known batches with it)
Packer = SamplePacker


# ----------------------------------------------------------------------------------- decoding
def eval_items(world, per_modality: int) -> dict[str, list]:
    """Held-out scored questions: the first `per_modality` of each media modality in index order."""
    weights = world.cfg.weights
    out: dict[str, list] = {m: [] for m in ("image", "video", "audio") if weights.get(m, 0) > 0}
    i = 0
    while any(len(v) < per_modality for v in out.values()):
        s = world.spec(i)
        if s["qtype"] != "caption" and s["modality"] in out and len(out[s["modality"]]) < per_modality:
            out[s["modality"]].append(world.item(i))
        i += 1
        if i > 100 * per_modality + 1000:
            raise ConfigError("world.weights leave too few held-out samples to evaluate; raise them or lower eval.items")
    return out


class GreedyDecoder:
    """Greedy answers through the library generator (`omnijax.serve.generate`): encoders and the LLM run once
    over each batch of prompts (prefill), then one token per step against the KV cache. A prompt that does
    not fit the eval packer (an encoder capacity, or seq_len with room for the answer) is skipped (None)."""

    def __init__(self, model, packer: Packer, max_new: int):
        from omnijax.serve.generate import Generator, SamplingConfig

        self.packer, self.max_new = packer, max_new
        self.sampling = SamplingConfig(max_new_tokens=max_new)
        self.generator = Generator(model, eos_ids=(tokenizer.EOS,), pad_id=tokenizer.PAD)

    def answers(self, params, prompts: list[Sample], zero_encoders: bool = False) -> list[str | None]:
        """Decoded answer text per prompt (None: the prompt does not fit and was skipped).

        zero_encoders=True replaces every encoder output by zeros (the ablation of eval.json)."""
        keep = []
        for k, prompt in enumerate(prompts):
            sizes = self.packer.sizes(prompt)
            if sizes is None:
                continue
            if sizes[0] + self.max_new > self.packer.L:
                self.packer._skip("eval_prompt_too_long")
                continue
            keep.append(k)
        out: list[str | None] = [None] * len(prompts)
        results = self.generator.generate([prompts[k] for k in keep], self.sampling, batch_size=self.packer.B,
                                          zero_encoders=zero_encoders, params=params)
        for k, r in zip(keep, results):
            out[k] = tokenizer.decode([i for i in r.tokens if i < 256])
        return out


def accuracy_by_modality(decoder: GreedyDecoder, params, items: dict[str, list],
                         zero_encoders: bool = False, examples: dict | None = None) -> tuple[dict, dict]:
    """Exact-match accuracy of the decoded answers per modality, and per question type."""
    acc, per_q = {}, {}
    examples = {} if examples is None else examples
    for modality, its in items.items():
        answers = decoder.answers(params, [it.prompt() for it in its], zero_encoders)
        hits = [a is not None and a.strip() == it.answer for a, it in zip(answers, its)]
        acc[f"{modality}_accuracy"] = float(np.mean(hits)) if hits else 0.0
        for it, a, h in zip(its, answers, hits):
            per_q.setdefault(it.qtype, []).append(h)
            examples.setdefault(it.qtype, [])
            if len(examples[it.qtype]) < 4:
                examples[it.qtype].append({"expected": it.answer, "decoded": a})
    return acc, {q: round(float(np.mean(v)), 3) for q, v in sorted(per_q.items())}


def load(argv: list[str], name: str = "tiny_omni") -> OmniConfig:
    """recipes/configs/<name>.yaml <- key=value overrides, checked."""
    from recipes.common import CONFIGS

    named = any(o.startswith("trainer.run_name=") for o in argv)
    return build(OmniConfig, CONFIGS / f"{name}.yaml", argv,
                 defaults=None if named else {"trainer": {"run_name": name}}, check=check)


def check_source_path(key: str, path: str) -> None:
    """One clear line for a data path that cannot be read, before anything is loaded."""
    import glob
    import os

    if path == WORLD:
        return
    if any(ch in path for ch in "*?["):
        if not glob.glob(path):
            raise ConfigError(f"{key}: {path} matches no files")
    elif not os.path.exists(path):
        raise ConfigError(f"{key}: {path}: no such folder; write it first with "
                          f"`python -m recipes convert input=YOUR.jsonl output={path}`")


def source_specs(key: str, paths: list[str], split: str) -> list:
    """Sources of `paths`: the built-in world by name, otherwise folders/globs of converted shards.

    A source is named after its folder (the names `data.mix` uses)."""
    from omnijax.data.sources import SourceSpec

    specs = []
    for path in paths:
        if path == WORLD:
            specs.append(SourceSpec(name=WORLD, kind="world", split=split))
            continue
        p = Path(path.rstrip("/"))
        while any(ch in p.name for ch in "*?[") and p.parent != p:
            p = p.parent
        specs.append(SourceSpec(name=p.name or path, kind="arrayrecord", path=path))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{key}: two sources are named {dup[0]!r} (a source is named after its folder); "
                          "give each source its own folder")
    return specs


def plane_config(cfg: OmniConfig, sources: list, mix, seed: int):
    """The data plane's config for this recipe: one dp rank per device, fixed shapes (one program).

    A step's samples are chosen against the whole batch (`data.batch_size` rows, `capacity.*` encoder
    rows), not a device's share: the same samples on every layout. Each window draws 4 samples per row
    (more than fit: the packer picks, the rest wait for the next window)."""
    import jax

    from omnijax.data.loader import LoaderConfig

    ranks = jax.device_count()
    if cfg.data.batch_size % ranks:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must split over {ranks} data-parallel ranks "
                          f"(one per device): use a multiple of {ranks}")
    return LoaderConfig(sources=sources, mix=mix, samples_per_step=4 * cfg.data.batch_size,
                        dp=ranks, microbatches=1,
                        window=4, row_len=cfg.data.seq_len, max_rows=cfg.data.batch_size // ranks, fixed_shapes=True,
                        encoder_rows=dict(cfg.capacity), seed=seed)


def open_plane(cfg: OmniConfig, key: str, paths: list[str], split: str, tok, mix, seed: int, steps: int = 0,
               placement=None):
    """A data-plane Loader over `paths` (sources opened once, checked against the tokenizer).

    steps > 0: the loader will serve only `steps` steps and draws no more than the sources hold, so no
    record repeats (the held-out set). With a joint-step `placement`, every host lays the whole step out
    from metadata but reads only the token rows its devices hold and decodes only the media segments the
    plan places on its devices."""
    from omnijax.data.loader import Loader
    from omnijax.data.sources import open_sources

    specs = source_specs(key, paths, split)
    sources = open_sources(specs, cfg.world, tokenizer=tok, media_cfg=cfg.data.media, bad_shards=cfg.data.bad_shards)
    if key == "data.sources" or not _capacities_known(cfg):
        size_capacities(cfg, sources, key)
    plane = plane_config(cfg, specs, mix, seed)
    if steps:
        windows = -(-steps // plane.window)
        plane.samples_per_step = max(1, min(plane.samples_per_step,
                                            sum(len(s) for s in sources) // (plane.window * windows)))
    if placement is None:
        return Loader(plane, mm_cfg=cfg.model, world_cfg=cfg.world, sources=sources, tokenizer=tok)
    rows = plane.max_rows  # bin r holds global rows [r*rows, (r+1)*rows)
    text_ranks = sorted({int(r) // rows for r in placement.host_rows(cfg.data.batch_size)})
    return Loader(plane, mm_cfg=cfg.model, world_cfg=cfg.world, sources=sources, tokenizer=tok, lazy_media=True,
                  text_ranks=text_ranks)


def size_capacities(cfg: OmniConfig, sources: list, key: str) -> None:
    """`cfg.capacity` completed from the sources' metadata (the training sources' also check explicit
    values: one that cannot hold the largest sample is a ConfigError naming the value that fits)."""
    import jax

    from omnijax.data.loader import data_bounds, step_capacities

    bounds = data_bounds(sources, cfg.model)
    given = {k: v for k, v in cfg.capacity.items() if v != "auto"}
    cfg.capacity = step_capacities(bounds, cfg.data.batch_size, cfg.data.seq_len, cfg.model, explicit=given)
    derived = {k: v for k, v in cfg.capacity.items() if k not in given}
    if derived and jax.process_index() == 0:
        largest = {k: v[0] for k, v in bounds.largest.items()}
        print(f"capacity sized from {key} ({bounds.scanned} records' metadata{'' if bounds.complete else ', a prefix'}; "
              f"largest sample {largest}): {derived}", file=sys.stderr)


def _capacities_known(cfg: OmniConfig) -> bool:
    encs = encoder_configs(cfg.model)
    return all(isinstance(cfg.capacity.get(n), int) for n in encs)


def training_capacity(cfg: OmniConfig, tok=None) -> dict[str, int]:
    """`capacity.*` as training uses it: explicit values, the rest sized from `data.sources`' metadata
    (for code that packs or traces a step without opening the loader: tests, `dryrun`)."""
    from omnijax.data.sources import open_sources

    if not _capacities_known(cfg):
        specs = source_specs("data.sources", cfg.data.sources or [WORLD], "train")
        size_capacities(cfg, open_sources(specs, cfg.world, tokenizer=tok, media_cfg=cfg.data.media), "data.sources")
    return dict(cfg.capacity)


def make_loader(cfg: OmniConfig, tok=None, placement=None):
    """The training loader: the data plane over `data.sources` (the built-in world by default); its small
    state (window start, draw counts, deferred samples) goes into the checkpoint."""
    from omnijax.data.loader import TrainerBatches

    return TrainerBatches(open_plane(cfg, "data.sources", cfg.data.sources or [WORLD], "train", tok, cfg.data.mix,
                                     cfg.trainer.seed, placement=placement))


def held_out_batches(cfg: OmniConfig, tok=None):
    """() -> the held-out host batches of `data.eval_sources` (planned once, packed like training, then cached).

    `data.eval_batches` batches, each record at most once (a larger set is evaluated on its first part)."""
    if not cfg.data.eval_sources:
        return None
    loader = open_plane(cfg, "data.eval_sources", cfg.data.eval_sources, "eval", tok, None, seed=0,
                        steps=cfg.data.eval_batches)
    cache: list[dict] = []

    def batches() -> list[dict]:
        if not cache:
            cache.extend(loader.host_batch(step)["microbatches"][0] for step in range(cfg.data.eval_batches))
        return cache
    return batches


def multiplexed(cfg: OmniConfig):
    """The joint-step placement for `parallel.llm`/`parallel.encoder` layouts (None: plain DP on one process).

    Several processes always take the joint step (all devices on dp/edp when no layout is named): its
    placement is fed the global batch every host plans identically, where plain DP expects host rows."""
    import jax

    p = cfg.parallel
    if not (p.llm or p.encoder) and jax.process_count() == 1:
        return None
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer

    engine = LLMParallel(p.llm, cfg.model.llm, rules=p.rules, microbatches=p.microbatches,
                         schedule=p.pipeline_schedule, remat=p.remat)
    # the data plane balanced its rows over the ranks already (and laid them out per host): not again
    return Multiplexer(engine, cfg.model, encoder_layout=p.encoder, encoder_rules=p.encoder_rules,
                       interleave=p.interleave_encoders, balance_rows=False)


def main(argv: list[str], name: str = "tiny_omni") -> int:
    from recipes.common import setup_devices

    setup_devices(argv)
    cfg = load(argv, name)
    from omnijax.train.launch import maybe_initialize_distributed

    maybe_initialize_distributed()  # --coordinator/--num-processes/--process-id, or Slurm/MPI/k8s: one job
    t0 = time.perf_counter()

    import jax
    from flax import nnx

    from omnijax.data.world import World, chance, token_report
    from omnijax.models.mllm import MultimodalModel, describe, mm_loss
    from omnijax.train.loop import Trainer
    from omnijax.train.metrics import FlopCounter

    tok = None
    if cfg.tokenizer.path:
        from omnijax.data.tokenizer import check_vocab, load_tokenizer

        tok = load_tokenizer(cfg.tokenizer.path)
        check_vocab(tok, cfg.model.llm.vocab_size)
    # greedy-decoded accuracy needs the built-in world's questions; other data get the held-out loss
    world_eval = WORLD in (cfg.data.sources or [WORLD])

    train_world = World(cfg.world, "train")
    placement = multiplexed(cfg)
    loader = make_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = held_out_batches(cfg, tok)
    eval_world = World(cfg.world, "eval")
    scale = -(-cfg.eval.batch_size // cfg.data.batch_size)
    eval_packer = Packer(cfg.model, cfg.eval.batch_size, cfg.data.seq_len,
                         {k: v * scale for k, v in cfg.capacity.items()})
    build = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    model = nnx.eval_shape(build)  # shapes only: the trainer creates the parameters in their shardings
    counts = describe(model)
    print(f"{name}: params {counts}", file=sys.stderr)
    flops = FlopCounter.for_model(cfg.model.llm, encoder_configs(cfg.model),
                                  {k.partition(".")[2]: v for k, v in counts.items() if k.startswith("encoder.")},
                                  {k.partition(".")[2]: v for k, v in counts.items() if k.startswith("projector.")})
    # Evaluation decodes with the single-device model; a parallel layout's params are mapped back to it.
    _, eval_params, _ = nnx.split(model, nnx.Param, ...)
    train_model, loss_fn = ((build, mm_loss) if placement is None else
                            (lambda: placement.prepare(build()), placement.loss_fn))

    def single_device(params):
        if placement is None:
            return params
        from omnijax.parallel.engine import unstack_params

        pure = nnx.to_pure_dict(params)
        if placement.engine.schedule is not None:
            pure["llm"] = unstack_params(params["llm"], placement.engine.schedule)
        nnx.replace_by_pure_dict(eval_params, jax.device_get(pure))
        return eval_params
    items = eval_items(eval_world, cfg.eval.items) if world_eval else {}
    trainer_ref: dict[str, Any] = {}

    def evaluate(params) -> dict:
        dec = trainer_ref.setdefault("dec", GreedyDecoder(model, eval_packer, cfg.eval.max_new_tokens))
        params = single_device(params)
        acc, per_q = accuracy_by_modality(dec, params, items, examples=trainer_ref.setdefault("examples", {}))
        trainer_ref["per_question"] = per_q
        if cfg.eval.ablation_items:  # the same questions with every encoder output zeroed
            few = {m: its[:cfg.eval.ablation_items] for m, its in items.items()}
            trainer_ref["zeroed"], _ = accuracy_by_modality(dec, params, few, zero_encoders=True)
        return acc

    trainer = Trainer(cfg, train_model, loss_fn, loader, placement=placement,
                      eval_fn=evaluate if world_eval else None, eval_data=held_out, step_flops=flops)
    trainer_ref["t"] = trainer
    result = trainer.fit()
    if result.status != "finished":
        return 0
    t_total = time.perf_counter() - t0
    if not world_eval:
        data = {k: v for k, v in loader.metrics().items() if k.startswith(("skipped", "dropped", "split"))}
        report = {"metrics": result.eval, "steps": cfg.trainer.steps, "wall_s": round(t_total, 1), "data": data,
                  "sources": cfg.data.sources, "eval_sources": cfg.data.eval_sources}
        if jax.process_index() == 0:
            (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
        held = (f"eval_loss {result.eval['eval_loss']:.4f} over {result.eval['eval_tokens']} held-out tokens"
                if "eval_loss" in (result.eval or {}) else "no data.eval_sources: no held-out loss")
        print(f"{held}; {data.get('skipped_bad_records', 0)} bad records skipped ({cfg.trainer.steps} steps, "
              f"{t_total:.0f} s) -> {trainer.run_dir}/eval.json", file=sys.stderr)
        return 0
    chances = {f"{m}_accuracy": round(float(chance(m)), 4) for m in items}
    report = {"metrics": result.eval, "chance": chances, "per_question": trainer_ref.get("per_question", {}),
              "zeroed_encoders": trainer_ref.get("zeroed", {}), "ablation_items": cfg.eval.ablation_items,
              "examples": trainer_ref.get("examples", {}),
              "eval_items_per_modality": cfg.eval.items, "steps": cfg.trainer.steps,
              "wall_s": round(t_total, 1), "data": {k: v for k, v in loader.metrics().items()
                                                  if k.startswith(("skipped", "dropped", "split"))},
              "tokens": token_report(train_world, 1000, cfg.model)}
    if jax.process_index() == 0:
        (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    lines = [f"{'modality':<8} {'accuracy':>9} {'chance':>7} {'zeroed encoders':>15}"]
    for m in items:
        k = f"{m}_accuracy"
        zeroed = trainer_ref.get("zeroed", {}).get(k)
        lines.append(f"{m:<8} {result.eval[k]:>9.3f} {chances[k]:>7.3f}" + (f" {zeroed:>15.3f}" if zeroed is not None else ""))
    print("\n".join(lines) + f"\n({cfg.trainer.steps} steps, {t_total:.0f} s) -> {trainer.run_dir}/eval.json",
          file=sys.stderr)
    return 0
