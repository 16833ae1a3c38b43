"""tiny_omni: a tiny vision+audio+LLM model trained on the built-in world (then greedy-decoded) or on the
user's own shards (`data.sources=[...]`, held-out loss on `data.eval_sources=[...]`)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from omnijax.config import (Config, DataConfig, MMDataConfig, OptimizerConfig, ParallelConfig, TokenizerConfig,
                            TrainerConfig, build, validate)
from omnijax.data import features, tokenizer
from omnijax.data.sample import BadSample, Sample
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
    # encoder name -> input-row capacity of one global batch (multiples of its reduction)
    capacity: dict[str, Any] = field(default_factory=lambda: {"vision": 2048, "audio": 1024})
    eval: EvalConfig = field(default_factory=EvalConfig)
    # "auto": "packer" for the built-in world alone, "plane" for anything else; "packer": world samples in
    # index order, first-fit; "plane": omnijax's data plane (mixing, grouped reordering by cost, per-rank packing)
    loader: str = "auto"


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
    if cfg.loader not in ("auto", "packer", "plane"):
        raise ConfigError(f"loader={cfg.loader!r}: must be 'auto', 'packer' or 'plane'")
    if cfg.loader == "packer" and d.sources not in ([], [WORLD]):
        raise ConfigError(f"loader=packer reads only the built-in world; data.sources={d.sources} needs loader=plane "
                          f"(or auto)")
    if cfg.loader == "packer" and d.mix is not None:
        raise ConfigError("data.mix needs loader=plane (or auto) and several data.sources")
    if d.sources and WORLD not in d.sources and cfg.eval != EvalConfig():
        raise ConfigError("eval.* scores decoded answers to the built-in world's questions, which this run does "
                          "not train on (data.sources has no 'world'); use data.eval_sources for a held-out loss")
    if cfg.tokenizer.path and not any(p != WORLD for p in d.sources + d.eval_sources):
        raise ConfigError(f"tokenizer.path={cfg.tokenizer.path}: the built-in world is byte-level; a tokenizer is "
                          "for data.sources converted with it")
    encs = encoder_configs(cfg.model)
    for name, enc in encs.items():
        r = enc.merge * enc.merge if hasattr(enc, "merge") else enc.reduction
        cap = cfg.capacity.get(name)
        if not isinstance(cap, int) or cap <= 0 or cap % r:
            raise ConfigError(f"capacity.{name}={cap!r}: must be a positive multiple of {r} (the encoder's reduction)")
    if cfg.model.llm.max_seq_len < cfg.data.seq_len:
        raise ConfigError(f"model.llm.max_seq_len={cfg.model.llm.max_seq_len} must be >= data.seq_len={cfg.data.seq_len}")
    cfg.world.check()
    return cfg


# ------------------------------------------------------------------------------------ packing
class Packer:
    """Host-side packing of Samples into the batch layout of brief/DESIGN (fixed capacities).

    Samples go first-fit into B rows of L LLM tokens; their encoder segments go into one buffer per
    encoder. A sample that can never fit (a segment larger than a capacity) or that fails validation
    is skipped and counted in `skipped`, never a crash.
    """

    def __init__(self, mm_cfg: MMConfig, batch_size: int, seq_len: int, capacity: dict[str, int]):
        self.cfg = mm_cfg
        self.encs = encoder_configs(mm_cfg)
        self.modalities = dict(mm_cfg.modalities)
        self.B, self.L = batch_size, seq_len
        self.capacity = {name: int(capacity[name]) for name in self.encs}
        self.reduction = {name: (e.merge * e.merge if hasattr(e, "merge") else e.reduction) for name, e in self.encs.items()}
        self.skipped: dict[str, int] = {}

    def _skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def sizes(self, sample: Sample) -> tuple[int, dict[str, int]] | None:
        """(LLM tokens, encoder rows per encoder) from metadata, or None (counted) if it can never fit."""
        try:
            meta = sample.meta()
            llm, rows = 0, {}
            for seg in meta.segments:
                n_in, n_llm = features.encoder_tokens(seg.modality, seg.shape, self.cfg)
                llm += n_llm
                if seg.modality != "text":
                    name = self.modalities[seg.modality]
                    rows[name] = rows.get(name, 0) + n_in
        except BadSample:
            self._skip("bad_sample")
            return None
        for name, n in rows.items():
            if n > self.capacity[name]:
                self._skip(f"too_large_for_{name}_capacity")
                return None
        if llm > self.L:
            self._skip("too_long_for_seq_len")
            return None
        return llm, rows

    def empty(self) -> dict[str, np.ndarray]:
        B, L = self.B, self.L
        batch = {"tokens": np.full((B, L), tokenizer.PAD, np.int32), "targets": np.full((B, L), tokenizer.PAD, np.int32),
                 "loss_mask": np.zeros((B, L), np.float32), "segment_ids": np.zeros((B, L), np.int32),
                 "positions": np.zeros((B, L), np.int32)}
        for name, enc in self.encs.items():
            cap, dim = self.capacity[name], self._input_dim(name)
            batch[f"{name}_inputs"] = np.zeros((cap, dim), np.float32)
            batch[f"{name}_segment_ids"] = np.zeros((cap,), np.int32)
            batch[f"{name}_positions"] = np.zeros((cap, 3), np.int32)
            batch[f"{name}_dest"] = np.full((cap // self.reduction[name],), -1, np.int32)
        return batch

    def _input_dim(self, name: str) -> int:
        e = self.encs[name]
        return e.temporal_patch * e.patch * e.patch * 3 if hasattr(e, "patch") else e.n_mels

    def pack(self, samples: Iterable[Sample]) -> tuple[dict[str, np.ndarray], list[int]]:
        """Pack samples in order until the next one does not fit; returns (batch, packed indices into samples).

        Samples skipped as unfit are reported as packed (consumed) so the caller moves on.
        """
        batch = self.empty()
        row_fill = [0] * self.B
        row_docs = [0] * self.B
        enc_fill = {name: 0 for name in self.encs}
        enc_segs = {name: 0 for name in self.encs}
        consumed: list[int] = []
        for k, sample in enumerate(samples):
            sizes = self.sizes(sample)
            if sizes is None:
                consumed.append(k)
                continue
            llm, rows = sizes
            row = next((r for r in range(self.B) if row_fill[r] + llm <= self.L), None)
            if row is None or any(enc_fill[n] + rows[n] > self.capacity[n] for n in rows):
                break
            try:
                payloads = [(seg, features.segment_inputs(seg.modality, seg.data, self.cfg) if seg.modality != "text" else None)
                            for seg in sample.validate().segments]
            except BadSample:
                self._skip("bad_sample")
                consumed.append(k)
                continue
            row_docs[row] += 1
            start = pos = row_fill[row]
            toks, loss = [], []
            for seg, payload in payloads:
                if seg.modality == "text":
                    toks.append(np.asarray(seg.data, np.int32))
                    loss.append(np.full(len(seg.data), seg.loss, bool))
                    continue
                name = self.modalities[seg.modality]
                x, p = payload
                r = self.reduction[name]
                e0 = enc_fill[name]
                enc_segs[name] += 1
                batch[f"{name}_inputs"][e0:e0 + len(x)] = x
                batch[f"{name}_positions"][e0:e0 + len(x)] = p
                batch[f"{name}_segment_ids"][e0:e0 + len(x)] = enc_segs[name]
                n_out = len(x) // r
                flat0 = row * self.L + pos + sum(len(t) for t in toks)
                batch[f"{name}_dest"][e0 // r:e0 // r + n_out] = flat0 + np.arange(n_out)
                enc_fill[name] += len(x)
                toks.append(np.full(n_out, PLACEHOLDER[seg.modality], np.int32))
                loss.append(np.zeros(n_out, bool))
            t, m = np.concatenate(toks), np.concatenate(loss)
            n = len(t)
            batch["tokens"][row, start:start + n] = t
            batch["targets"][row, start:start + n - 1] = t[1:]
            batch["loss_mask"][row, start:start + n - 1] = m[1:]
            batch["segment_ids"][row, start:start + n] = row_docs[row]
            batch["positions"][row, start:start + n] = np.arange(n)
            row_fill[row] += n
            consumed.append(k)
        return batch, consumed


class WorldLoader:
    """Trainer loader over the world's train split: packs samples in index order.

    Its state is the next sample index, so resume is exact.
    """

    def __init__(self, world, packer: Packer, window: int = 96):
        self.world, self.packer, self.window = world, packer, window
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        samples = (self.world.sample(i) for i in range(self.index, self.index + self.window))  # rendered lazily
        batch, consumed = self.packer.pack(samples)
        if not consumed:
            raise ConfigError("tiny_omni: no sample fits a batch; raise data.seq_len or capacity.*")
        self.index += len(consumed)
        return batch

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])

    def metrics(self) -> dict:
        return {f"skipped_{k}": v for k, v in self.packer.skipped.items()}


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
    """Greedy decoding of answers: encoders run once per batch (prefill of the embeddings), then each
    new token's embedding is written at the next position. Shapes are fixed: one program per phase."""

    def __init__(self, graphdef, rest, packer: Packer, max_new: int):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.packer, self.max_new = packer, max_new

        def prefill(params, batch, zero_encoders):
            return nnx.merge(graphdef, params, rest).embed(batch, zero_encoders=zero_encoders)

        def step(params, x, seg, pos, cur):
            model = nnx.merge(graphdef, params, rest)
            logits, _ = model.llm.forward_embeddings(x, seg, pos)
            rows = jnp.arange(x.shape[0])
            nxt = jnp.argmax(logits[rows, cur - 1], axis=-1).astype(jnp.int32)
            emb = model.llm.embed(nxt[:, None])[:, 0].astype(x.dtype)
            safe = jnp.minimum(cur, x.shape[1] - 1)
            return x.at[rows, safe].set(emb), nxt

        self._prefill, self._step = jax.jit(prefill, static_argnums=2), jax.jit(step)

    def answers(self, params, prompts: list[Sample], zero_encoders: bool = False) -> list[str | None]:
        """Decoded answer text per prompt (None: the prompt does not fit and was skipped).

        zero_encoders=True replaces every encoder output by zeros (the ablation of eval.json)."""

        B, L = self.packer.B, self.packer.L
        out: list[str | None] = [None] * len(prompts)
        batch, rows, fill = self.packer.empty(), [], {name: 0 for name in self.packer.reduction}
        for k, prompt in enumerate(prompts):  # one prompt per row, room left for the answer
            if self.packer.sizes(prompt) is None:
                continue
            one, used = self.packer.pack([prompt])
            n = int((one["segment_ids"][0] > 0).sum())
            if not used or n + self.max_new > L:
                self.packer._skip("eval_prompt_too_long")
                continue
            need = {name: int((one[f"{name}_segment_ids"] > 0).sum()) for name in fill}
            if len(rows) == B or any(fill[e] + need[e] > self.packer.capacity[e] for e in fill):
                self._decode(params, batch, rows, out, zero_encoders)  # full: decode and start a new batch
                batch, rows, fill = self.packer.empty(), [], {name: 0 for name in self.packer.reduction}
            self._place(batch, one, len(rows), n, fill)
            rows.append((k, n))
        if rows:
            self._decode(params, batch, rows, out, zero_encoders)
        return out

    def _decode(self, params, batch: dict, rows: list[tuple[int, int]], out: list, zero_encoders: bool) -> None:
        import jax.numpy as jnp

        cur = np.ones(self.packer.B, np.int32)
        for r, (_, n) in enumerate(rows):
            cur[r] = n
        x = self._prefill(params, batch, zero_encoders)
        seg, pos = jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"])
        cur_j = jnp.asarray(cur)
        generated = []
        for _ in range(self.max_new):
            x, nxt = self._step(params, x, seg, pos, cur_j)
            generated.append(np.asarray(nxt))
            cur_j = cur_j + 1
        gen = np.stack(generated, axis=1)
        for r, (k, _) in enumerate(rows):
            ids = list(gen[r])
            ids = ids[:ids.index(tokenizer.EOS)] if tokenizer.EOS in ids else ids
            out[k] = tokenizer.decode([i for i in ids if i < 256])

    def _place(self, batch: dict, one: dict, r: int, n: int, fill: dict[str, int]) -> None:
        """Copy a single-prompt batch (in row 0) into row r of `batch`, appending to encoder buffers."""
        L = self.packer.L
        for k in ("tokens", "segment_ids", "positions"):
            batch[k][r, :n] = one[k][0, :n]
        batch["segment_ids"][r, n:n + self.max_new] = 1
        batch["positions"][r, n:n + self.max_new] = np.arange(n, n + self.max_new)
        for name, red in self.packer.reduction.items():
            used = int((one[f"{name}_segment_ids"] > 0).sum())
            if not used:
                continue
            f0 = fill[name]
            batch[f"{name}_inputs"][f0:f0 + used] = one[f"{name}_inputs"][:used]
            batch[f"{name}_positions"][f0:f0 + used] = one[f"{name}_positions"][:used]
            seg = one[f"{name}_segment_ids"][:used]
            batch[f"{name}_segment_ids"][f0:f0 + used] = seg + (batch[f"{name}_segment_ids"].max() if f0 else 0)
            batch[f"{name}_dest"][f0 // red:(f0 + used) // red] = one[f"{name}_dest"][:used // red] + r * L
            fill[name] = f0 + used


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

    Each window draws 4 samples per row (more than fit: the packer picks, the rest wait for the next window)."""
    import jax

    from omnijax.data.loader import LoaderConfig

    ranks = jax.device_count()
    if cfg.data.batch_size % ranks or any(c % ranks for c in cfg.capacity.values()):
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} and capacity {cfg.capacity} must split over "
                          f"{ranks} data-parallel ranks (one per device)")
    return LoaderConfig(sources=sources, mix=mix, samples_per_step=4 * cfg.data.batch_size,
                        dp=ranks, microbatches=1,
                        window=4, row_len=cfg.data.seq_len, max_rows=cfg.data.batch_size // ranks, fixed_shapes=True,
                        max_encoder_rows={k: v // ranks for k, v in cfg.capacity.items()}, seed=seed)


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
    sources = open_sources(specs, cfg.world, tokenizer=tok, media_cfg=cfg.data.media)
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


def loader_kind(cfg: OmniConfig) -> str:
    if cfg.loader != "auto":
        return cfg.loader
    return "packer" if cfg.data.sources in ([], [WORLD]) and cfg.data.mix is None else "plane"


def make_loader(cfg: OmniConfig, world, packer: Packer, tok=None, placement=None):
    """The training loader (both kinds keep their state in the checkpoint)."""
    if loader_kind(cfg) == "packer":
        return WorldLoader(world, packer)
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
                       interleave=p.interleave_encoders, balance_rows=loader_kind(cfg) != "plane")


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
    packer = Packer(cfg.model, cfg.data.batch_size, cfg.data.seq_len, cfg.capacity)
    placement = multiplexed(cfg)
    # opens (and checks) the data before the model is built
    loader = make_loader(cfg, train_world, packer, tok, placement)
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
    eval_graph, eval_params, eval_rest = nnx.split(model, nnx.Param, ...)
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
        dec = trainer_ref.setdefault("dec", GreedyDecoder(eval_graph, eval_rest, eval_packer, cfg.eval.max_new_tokens))
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
                if "eval_loss" in result.eval else "no data.eval_sources: no held-out loss")
        print(f"{held}; {data.get('skipped_bad_records', 0)} bad records skipped ({cfg.trainer.steps} steps, "
              f"{t_total:.0f} s) -> {trainer.run_dir}/eval.json", file=sys.stderr)
        return 0
    chances = {f"{m}_accuracy": round(float(chance(m)), 4) for m in items}
    report = {"metrics": result.eval, "chance": chances, "per_question": trainer_ref.get("per_question", {}),
              "zeroed_encoders": trainer_ref.get("zeroed", {}), "ablation_items": cfg.eval.ablation_items,
              "examples": trainer_ref.get("examples", {}),
              "eval_items_per_modality": cfg.eval.items, "steps": cfg.trainer.steps,
              "wall_s": round(t_total, 1), "skipped": dict(packer.skipped),
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
