"""`recipes convert` memory and speed: peak RSS must not grow with the input (N vs scale*N records).

Each size is a LLaVA-style JSONL (image and audio conversations and text documents, small media files)
converted by `python -m recipes convert` in a fresh process, with the same records per shard and
workers, while this process samples the RSS of that process and all its descendants (psutil, every
20 ms). One row per size, the larger one with its ratios to the smaller (`vs`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DESCRIPTION = "convert: peak RSS of N vs 10N records (streaming: ratio ~1), records/s, workers=2"


@dataclass
class BenchConfig:
    records: int = 1000           # N
    scale: int = 10               # the second run converts scale * N records
    workers: int = 2
    records_per_shard: int = 250
    image_px: int = 32
    audio_samples: int = 4000
    seed: int = 0


def _write_input(folder: Path, n: int, b: BenchConfig) -> Path:
    """n records over a few shared media files (written with Pillow / soundfile)."""
    import numpy as np
    import soundfile as sf
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(b.seed)
    for k in range(8):
        Image.fromarray(rng.integers(0, 256, (b.image_px, b.image_px, 3), dtype=np.uint8)).save(folder / f"i{k}.png")
    for k in range(4):
        sf.write(folder / f"a{k}.wav", (0.3 * np.sin(np.arange(b.audio_samples) * (k + 1) / 9)).astype(np.float32), 16000)
    path = folder / "data.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            if i % 3 == 0:
                rec = {"image": f"i{i % 8}.png", "conversations": [
                    {"from": "human", "value": f"<image>\nWhat is in picture {i}?"},
                    {"from": "gpt", "value": f"Picture {i} shows pattern {i % 8}."}]}
            elif i % 3 == 1:
                rec = {"audio": f"a{i % 4}.wav", "conversations": [
                    {"from": "human", "value": "Which tone is this?"}, {"from": "gpt", "value": f"Tone {i % 4}."},
                    {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]}
            else:
                rec = {"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 5)}
            f.write(json.dumps(rec) + "\n")
    return path


def _convert(inp: Path, out: Path, b: BenchConfig) -> dict:
    """Run convert in a fresh process; peak RSS of it alone and of it plus its descendants."""
    import psutil
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import json, resource, sys; from recipes import convert; rc = convert.main(sys.argv[1:]); "
            "print(json.dumps({'self_peak_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))")
    args = [f"input={inp}", f"output={out}", f"workers={b.workers}", f"records_per_shard={b.records_per_shard}"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=root)
    top = psutil.Process(proc.pid)
    peak_tree = peak_one = 0.0
    while proc.poll() is None:
        try:
            procs = [top] + top.children(recursive=True)
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss / 2 ** 20)
                except psutil.Error:
                    pass
            peak_tree, peak_one = max(peak_tree, sum(rss)), max([peak_one] + rss[1:])
        except psutil.Error:
            pass
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"convert failed: {stderr[-2000:]}")
    lines = stdout.strip().splitlines()
    summary, peak = json.loads(lines[-2]), json.loads(lines[-1])
    return {**summary, "parent_peak_mb": peak["self_peak_mb"], "tree_peak_mb": peak_tree, "worker_peak_mb": peak_one}


def run(overrides: list[str]) -> Iterator[dict]:
    from omnijax.config import build
    b = build(BenchConfig, None, overrides, check=None)
    tmp = Path(tempfile.mkdtemp(prefix="omnijax_bench_convert_"))
    try:
        base = None
        for n in (b.records, b.scale * b.records):
            inp = _write_input(tmp / f"in{n}", n, b)
            r = _convert(inp, tmp / f"out{n}", b)
            row = {"variant": f"records_{n}", "records": r["records"], "shards": len(r["shards"]),
                   "skipped_bad": r["skipped_bad"], "seconds": r["seconds"],
                   "records_per_s": round(r["records"] / max(r["seconds"], 1e-9), 1), "workers": b.workers,
                   "parent_peak_rss_mb": round(r["parent_peak_mb"], 1),
                   "tree_peak_rss_mb": round(r["tree_peak_mb"], 1), "worker_peak_rss_mb": round(r["worker_peak_mb"], 1),
                   "input_mb": round(os.path.getsize(inp) / 2 ** 20, 2)}
            if base is None:
                base = row
            else:
                row.update({"vs": base["variant"], "target_ratio": 1.2,
                            **{f"{k}_ratio": round(row[k] / max(base[k], 1e-9), 3)
                               for k in ("parent_peak_rss_mb", "tree_peak_rss_mb", "worker_peak_rss_mb")}})
            yield row
            shutil.rmtree(tmp / f"out{n}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
