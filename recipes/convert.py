"""Convert JSONL / LLaVA .json (+ media files) or the built-in world into ArrayRecord shards with metadata sidecars.

`python -m recipes convert input=FILE output=DIR [tokenizer.path=DIR] [workers=N] [shards=N] [media.video_fps=F]`

Preference pairs (DPO) are records like any other (omnijax/data/formats.py: `{"segments": [...], "chosen": ...,
"rejected": ...}`, or a conversation with chosen/rejected answers): each becomes one sample of two documents;
a pair with a missing or empty answer is skipped, counted and described like any bad record.
`input=world pairs=true` writes the built-in world's pairs (the correct answer chosen, a wrong one rejected).

Streaming: the input's record byte ranges are indexed once (16 bytes per record), then each shard
(a contiguous range of records: shard k of S holds records [k*n/S, (k+1)*n/S)) is converted by one of
`workers` processes, one record at a time; no list of samples exists anywhere. Each shard is written
under a temporary name and renamed, then a small manifest (`x.arrayrecord.manifest.json`: what it was
made from, record count, file sizes) is written last. A rerun skips shards whose shard, sidecar and
manifest agree and were made from the same input, range, tokenizer and media settings, and redoes the
rest. `DIR/omnijax_dataset.json` records the tokenizer (fingerprint, vocabulary size, placeholder ids),
the input and the counts; readers refuse shards made with another tokenizer.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnijax.config import MediaConfig, TokenizerConfig

DESCRIPTION = ("JSONL / LLaVA .json (+ image/video/audio files) or the built-in world -> ArrayRecord shards "
               "(streaming, workers=N, resumable)")
FORMAT = 1


@dataclass
class ConvertConfig:
    input: str = ""          # a .jsonl or LLaVA-style .json file, or "world" / "world:eval"
    output: str = ""         # folder for the shards (default runs/<run_name>/shards)
    name: str = ""           # shard file prefix (default: the input's stem)
    shards: int = 0          # 0: ceil(records / records_per_shard)
    records_per_shard: int = 10000
    workers: int = 1         # processes converting shards in parallel
    media_root: str = ""     # folder media paths are relative to (default: the input file's folder)
    samples: int = 1000      # world only: how many samples
    seed: int = 0            # world only
    pairs: bool = False      # world only: preference pairs (the correct answer chosen, a wrong one rejected) for DPO
    run_name: str = "convert"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    media: MediaConfig = field(default_factory=MediaConfig)


# ------------------------------------------------------------------------------ worker side
_W: dict = {}


def _open_source(setup: dict):
    from omnijax.data.sources import JsonlSource, WorldSource
    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.data.world import WorldConfig

    tok = load_tokenizer(setup["tokenizer"])
    if setup["kind"] == "world":
        world = WorldConfig(seed=setup["seed"], pairs=setup.get("pairs", False))
        return WorldSource(setup["name"], setup["samples"], setup["split"], world), tok
    return JsonlSource(setup["name"], setup["input"], tok, setup["media"], setup["media_root"], index=setup["index"]), tok


def _init_worker(setup: dict, counter) -> None:
    """Pool initializer: open the input once per process (the index comes from the parent, no rescan).
    `counter`: a shared integer of records done (pool) or a function taking a count (in-process)."""
    _W["src"], _W["tok"] = _open_source(setup)
    _W["progress"], _W["input"] = (counter if callable(counter) else lambda n: _bump(counter, n)), setup["input"]


def _convert_shard(task: dict) -> dict:
    """Write one shard (records task["lo"]..task["hi"]); bad records are skipped, counted and described."""
    from omnijax.data import records
    from omnijax.errors import UserError

    src, tok, progress = _W["src"], _W["tok"], _W["progress"]
    reasons: list[str] = []

    def samples():
        pending = 0
        for i in range(task["lo"], task["hi"]):
            try:
                s = src.get(i).validate(tok.vocab_size)
            except (UserError, ValueError, OSError) as exc:  # BadSample/BadRecord, and a decoder's own errors
                reasons.append(f"skipped record {i} of {_W['input']}: {exc}")
                s = None
            pending += 1
            if pending == 16 or i == task["hi"] - 1:
                progress(pending)
                pending = 0
            if s is not None:
                yield s

    manifest = records.write_shard_atomic(task["path"], samples(), task["spec"],
                                          extra=lambda: {"skipped_bad": len(reasons)})
    return {"k": task["k"], "manifest": manifest, "reasons": reasons}


def _bump(counter, n: int) -> None:
    with counter.get_lock():
        counter.value += n


# ------------------------------------------------------------------------------ parent side
def _setup(cfg: ConvertConfig, tok) -> dict:
    """What every worker needs to open the input: kind, paths, tokenizer folder, and the record index."""
    if cfg.input.startswith("world"):
        split = cfg.input.partition(":")[2] or "train"
        return {"kind": "world", "input": cfg.input, "name": "world", "split": split, "samples": cfg.samples,
                "seed": cfg.seed, "pairs": cfg.pairs, "tokenizer": cfg.tokenizer.path}
    from omnijax.data.sources import JsonlSource
    media_cfg = None if cfg.media == MediaConfig() else cfg.media  # None: the media readers' defaults
    src = JsonlSource(Path(cfg.input).stem, cfg.input, tok, media_cfg, cfg.media_root)
    return {"kind": "jsonl", "input": cfg.input, "name": src.name, "media": media_cfg, "media_root": cfg.media_root,
            "tokenizer": cfg.tokenizer.path, "index": src.index}


def _input_id(cfg: ConvertConfig) -> dict:
    """What identifies the input for the shard manifests (a changed file invalidates its shards)."""
    if cfg.input.startswith("world"):
        return {"input": cfg.input, "samples": cfg.samples, "seed": cfg.seed, **({"pairs": True} if cfg.pairs else {})}
    st = os.stat(cfg.input)
    return {"input": os.path.abspath(cfg.input), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "media_root": os.path.abspath(cfg.media_root) if cfg.media_root else ""}


def _remove_stale(out: Path, name: str, keep: set[str]) -> None:
    """Shards of an earlier run with another shard count would be read with this run's: remove them."""
    from omnijax.data import records
    mine = re.compile(re.escape(name) + r"-\d{5}-of-\d{5}\.arrayrecord")
    for p in glob.glob(str(out / f"{glob.escape(name)}-*-of-*.arrayrecord")):
        if mine.fullmatch(os.path.basename(p)) and p not in keep:
            for q in (p, p + records.META_SUFFIX, p + records.MANIFEST_SUFFIX):
                if os.path.exists(q):
                    os.remove(q)
            print(f"removed stale shard {p} (written with another shard count)", file=sys.stderr)


def _run(tasks: list[dict], setup: dict, workers: int, bar) -> list[dict]:
    """Convert the shards of `tasks`: in this process, or in a pool of spawned processes."""
    if workers <= 1 or len(tasks) <= 1:
        _init_worker(setup, bar.update)
        out = []
        for t in tasks:
            out.append(_convert_shard(t))
            _report(out[-1], bar)
        return out
    import multiprocessing as mp
    # Workers fork from a clean server process that imported this module once: never fork the caller,
    # which may hold threads (tokenizers, grain, jax), and do not pay an import per worker (spawn).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    counter = ctx.Value("q", 0)
    out, seen = [], 0
    with ctx.Pool(min(workers, len(tasks)), initializer=_init_worker, initargs=(setup, counter)) as pool:
        results = pool.imap_unordered(_convert_shard, tasks)
        while len(out) < len(tasks):
            try:
                out.append(results.next(timeout=0.5))
                _report(out[-1], bar)
            except mp.TimeoutError:
                pass
            now = counter.value
            bar.update(now - seen)
            seen = now
    return out


def _report(result: dict, bar) -> None:
    for line in result["reasons"]:
        bar.write(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    from tqdm import tqdm

    from omnijax.config import build
    from omnijax.data import formats, records
    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.errors import ConfigError, UserError

    cfg = build(ConvertConfig, None, argv, check=None)
    if not cfg.input:
        raise ConfigError("input=...: a .jsonl/.json file or 'world' is required, e.g. input=data.jsonl output=shards/")
    if not cfg.input.startswith("world") and not os.path.isfile(cfg.input):
        raise ConfigError(f"input={cfg.input}: file not found")
    if cfg.shards < 0 or cfg.records_per_shard <= 0 or cfg.workers <= 0:
        raise ConfigError(f"shards={cfg.shards}, records_per_shard={cfg.records_per_shard}, workers={cfg.workers}: "
                          f"shards must be >= 0 (0 = automatic), the others > 0")
    if cfg.media.video_fps <= 0 or cfg.media.max_video_frames < 0:
        raise ConfigError(f"media.video_fps={cfg.media.video_fps} must be > 0 and media.max_video_frames="
                          f"{cfg.media.max_video_frames} >= 0 (0 = no cap)")
    if cfg.media_root and not os.path.isdir(cfg.media_root):
        raise ConfigError(f"media_root={cfg.media_root}: folder not found")
    if cfg.pairs and not cfg.input.startswith("world"):
        raise ConfigError("pairs=true is for input=world; a JSONL file's pair records ({\"segments\": [...], \"chosen\": "
                          "..., \"rejected\": ...}) are read as pairs by themselves")
    if cfg.input.startswith("world") and cfg.tokenizer.path:
        raise ConfigError(f"tokenizer.path={cfg.tokenizer.path}: the built-in world is byte-level; drop tokenizer.path "
                          f"for input={cfg.input}")
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.tokenizer.path)
    formats.check_template(tok)
    out = Path(cfg.output or Path(os.environ.get("OMNIJAX_RUNS", "runs")) / cfg.run_name / "shards")
    out.mkdir(parents=True, exist_ok=True)
    before = records.read_dataset_info(out)
    here = cfg.input if cfg.input.startswith("world") else os.path.abspath(cfg.input)
    if before is not None and before.get("input") not in (None, here):
        raise ConfigError(f"output={out} already holds the shards of {before.get('input')} (one dataset per folder: "
                          f"readers take every shard in it); choose another output folder for {cfg.input}")
    name = cfg.name or (cfg.input.replace(":", "_") if cfg.input.startswith("world") else Path(cfg.input).stem)
    setup = _setup(cfg, tok)
    n = cfg.samples if setup["kind"] == "world" else len(setup["index"][0])
    if n <= 0:
        raise UserError(f"input={cfg.input}: no records to convert")
    shards = cfg.shards or -(-n // cfg.records_per_shard)
    shards = max(1, min(shards, n))  # no empty shards
    ident = {"format": FORMAT, **_input_id(cfg), "tokenizer": tok.fingerprint,
             "media": dataclasses.asdict(cfg.media), "shards": shards}
    plan = []
    for k in range(shards):
        lo, hi = k * n // shards, (k + 1) * n // shards
        path = str(out / f"{name}-{k:05d}-of-{shards:05d}.arrayrecord")
        plan.append({"k": k, "lo": lo, "hi": hi, "path": path, "spec": {**ident, "range": [lo, hi]}})
    _remove_stale(out, name, {t["path"] for t in plan})
    done = {t["k"]: m for t in plan if (m := records.shard_complete(t["path"], t["spec"])) is not None}
    todo = [t for t in plan if t["k"] not in done]
    reused = sum(plan[k]["hi"] - plan[k]["lo"] for k in done)
    bar = tqdm(total=n, initial=reused, file=sys.stderr, unit="rec", mininterval=1.0, desc=f"convert {name}")
    try:
        for r in _run(todo, setup, cfg.workers, bar):
            done[r["k"]] = r["manifest"]
    finally:
        bar.close()
    written = sum(m["records"] for m in done.values())
    bad = sum(m.get("skipped_bad", 0) for m in done.values())
    paths = [t["path"] for t in plan]
    info = {"format": FORMAT, "created_by": "python -m recipes convert", "input": ident.get("input"),
            "records": written, "skipped_bad": bad, "shards": [os.path.basename(p) for p in paths],
            "media": dataclasses.asdict(cfg.media),
            "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                          "bos": tok.bos, "eos": tok.eos, "pad": tok.pad, "placeholder": dict(tok.placeholder)}}
    records.write_json_atomic(out / records.DATASET_JSON, info)
    summary = {"shards": paths, "records": written, "skipped_bad": bad, "reused_shards": len(plan) - len(todo),
               "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(summary))
    return 0
