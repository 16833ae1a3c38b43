"""Convert JSONL (+ media files) or the built-in world into ArrayRecord shards with metadata sidecars."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DESCRIPTION = "JSONL (+ .npy/.png/.wav media) or the built-in world -> ArrayRecord shards with cheap metadata sidecars"


@dataclass
class ConvertConfig:
    input: str = ""          # a .jsonl file, or "world" / "world:eval"
    output: str = ""         # folder for the shards (default runs/<run_name>/shards)
    name: str = ""           # shard file prefix (default: the input's stem)
    shards: int = 1
    samples: int = 1000      # world only: how many samples
    seed: int = 0            # world only
    run_name: str = "convert"


def _samples(cfg: ConvertConfig, counts: dict):
    """(index, Sample) pairs of the input; bad JSONL lines are skipped, counted and reported."""
    from omnijax.data.sample import BadSample
    from omnijax.data.sources import JsonlSource, WorldSource
    from omnijax.data.world import WorldConfig
    from omnijax.errors import UserError

    if cfg.input.startswith("world"):
        split = cfg.input.partition(":")[2] or "train"
        src = WorldSource("world", cfg.samples, split, WorldConfig(seed=cfg.seed))
    else:
        src = JsonlSource(Path(cfg.input).stem, cfg.input)
    for i in range(len(src)):
        try:
            yield src.get(i).validate()
        except (BadSample, UserError) as exc:
            counts["bad"] += 1
            print(f"skipped {src.name}[{i}]: {exc}", file=sys.stderr)


def main(argv: list[str]) -> int:
    from omnijax.config import build
    from omnijax.data import records
    from omnijax.errors import ConfigError

    cfg = build(ConvertConfig, None, argv, check=None)
    if not cfg.input:
        raise ConfigError("input=...: a .jsonl file or 'world' is required, e.g. input=data.jsonl output=shards/")
    if not cfg.input.startswith("world") and not os.path.exists(cfg.input):
        raise ConfigError(f"input={cfg.input}: file not found")
    if cfg.shards <= 0:
        raise ConfigError(f"shards={cfg.shards}: must be > 0")
    out = Path(cfg.output or Path(os.environ.get("OMNIJAX_RUNS", "runs")) / cfg.run_name / "shards")
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.name or (cfg.input.replace(":", "_") if cfg.input.startswith("world") else Path(cfg.input).stem)
    t0 = time.perf_counter()
    counts = {"bad": 0}
    samples = list(_samples(cfg, counts))  # small inputs; shards are balanced by count
    paths, written = [], 0
    for k in range(cfg.shards):
        path = out / f"{name}-{k:05d}-of-{cfg.shards:05d}.arrayrecord"
        written += records.write_shard(path, samples[k:: cfg.shards])
        paths.append(str(path))
    summary = {"shards": paths, "records": written, "skipped_bad": counts["bad"],
               "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(summary))
    return 0
