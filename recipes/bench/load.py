"""Sharded loading of a pretrained HF Llama folder: seconds and peak host memory per process.

The bench writes its own Llama folder (random weights, a few hundred MB over several safetensors files
with an index), then loads it with `omnijax.interop.pretrained.load_llm_params` into an fsdp layout
over 8 CPU devices, as one process x 8 devices and as 2 processes x 4 devices (a real `jax.distributed`
job on 127.0.0.1 with gloo). Each process reports its resident-set peak during the load above its
resident set just before it (the peak counter is reset there), over the model's parameter bytes:
a process whose devices hold half of the model should stay near 0.5 (target <= 0.65 for each of the
two processes), which it can only do if it never reads or materialises the other half. Each process also
reports the bytes it read during the load (`/proc/self/io` rchar) against its share (the distinct shards its
devices hold): <= 1.1x, whichever axis the layout splits (fsdp splits HF rows of some weights and columns of
others; a host reads each of its bytes once, not once per local device). Each run then
exports the loaded model again (`export_llm`, one tensor gathered at a time, process 0 writing) and
checks the written tensors against the source files bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DESCRIPTION = ("load: sharded HF Llama loading and export (seconds, peak RSS above baseline / parameter bytes) for "
               "1 process x 8 devices and 2 processes x 4 devices")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BenchConfig:
    embed_dim: int = 512
    num_layers: int = 8
    mlp_dim: int = 1536
    vocab_size: int = 32000
    num_heads: int = 8
    num_kv_heads: int = 8
    file_mb: int = 100           # safetensors files of at most this size (+ model.safetensors.index.json)
    layout: str = "fsdp8"        # parallel.llm layout of the 8 devices
    target: float = 0.65         # each of the 2 processes: peak RSS above baseline <= target x model bytes
    repeats: int = 2             # best of (seconds); the RSS ratio reported is the largest seen
    read_target: float = 1.1     # each process: bytes read (/proc/self/io rchar) <= read_target x its share
    seed: int = 0


def _llm_config(b: BenchConfig):
    from omnijax.config import LLMConfig

    return LLMConfig(vocab_size=b.vocab_size, embed_dim=b.embed_dim, num_layers=b.num_layers, num_heads=b.num_heads,
                     num_kv_heads=b.num_kv_heads, head_dim=b.embed_dim // b.num_heads, mlp_dim=b.mlp_dim,
                     tie_embeddings=False, max_seq_len=2048)


def write_folder(b: BenchConfig, folder: Path) -> int:
    """A Llama folder of random float32 weights written tensor by tensor; returns its parameter bytes."""
    import numpy as np

    from omnijax.interop import hf, layout
    from omnijax.interop.tensors import write_file

    cfg = _llm_config(b)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf.config_to_hf(cfg, "llama", "float32"), indent=2))
    groups, used = [[]], 0
    for t in layout.llm_tensors(cfg):
        size = 4 * int(np.prod(t.hf_shape))
        if groups[-1] and used + size > b.file_mb << 20:
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += size
    rng = np.random.default_rng(b.seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        arrays = (rng.standard_normal(t.hf_shape, dtype=np.float32) * 0.02 for t in group)
        write_file(folder / name, [(t.hf, t.hf_shape, np.float32) for t in group], arrays)
        for t in group:
            weight_map[t.hf] = name
            total += 4 * int(np.prod(t.hf_shape))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _expected(full, kind: str, shape: tuple):
    """omnijax's array from the whole HF tensor, by the layout kinds of omnijax/interop/hf.py's weight_layout
    (written out here from the formats' definitions, not through the loader's own slicing): HF Linear weights
    are [out, in], omnijax kernels [in, *out] ("linear_in") or [*in, out] ("linear_out")."""
    if kind == "same":
        return full
    if kind in ("linear_in", "linear_out"):
        return full.T.reshape(shape)
    if kind == "reshape":
        return full.reshape(shape)
    raise ValueError(f"no independent layout for kind {kind!r}")


def values_match(folder: str | Path, cfg, loaded) -> bool:
    """Every parameter's shards on this process equal the source files' tensors, each read whole by the
    safetensors library (not the loader's reader) and laid out by _expected: every layout, every shard."""
    import numpy as np
    from flax import nnx
    from safetensors import safe_open

    from omnijax.interop import layout

    folder = Path(folder)
    files = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(loaded)}
    tensors = layout.llm_tensors(cfg)
    if {t.path for t in tensors} != set(flat):
        return False
    for t in tensors:
        with safe_open(str(folder / files[t.hf]), "np") as f:
            full = f.get_tensor(t.hf)
        if t.offset or tuple(full.shape) != t.hf_shape:  # a part of a fused tensor: not in a Llama folder
            return False
        want = _expected(full, t.kind, t.shape)
        got = flat[t.path]
        if want.shape != got.shape or not all(np.array_equal(np.asarray(s.data), want[s.index])
                                              for s in got.addressable_shards):
            return False
    return True


def _rchar() -> int:
    """Bytes this process has passed through read syscalls (/proc/self/io `rchar`: page-cache hits count
    too, so a file read twice counts twice even when the disk served it once)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _share_bytes(leaves) -> int:
    """Bytes of the distinct shards this process holds (replicas on its devices counted once): what it must
    read from the files (written float32 like the parameters)."""
    total = 0
    for a in leaves:
        seen = {}
        for s in a.addressable_shards:
            seen[tuple((i.start, i.stop) for i in s.index)] = s.data.nbytes
        total += sum(seen.values())
    return total


def child(folder: str, layout: str) -> None:
    """One process of the load: prints one JSON line with its own figures."""
    import jax
    import numpy as np
    from flax import nnx

    from omnijax.interop import pretrained
    from omnijax.models.llm import LLM
    from omnijax.parallel.engine import LLMParallel
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()
    cfg = pretrained.llm_config_from_folder(folder)
    params = nnx.state(nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = LLMParallel(layout, cfg).state_shardings(params)
    target = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
                          params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    rows = []
    for _ in range(int(os.environ.get("BENCH_REPEATS", "1"))):
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        read0, t0 = _rchar(), time.perf_counter()
        loaded = pretrained.load_llm_params(folder, target)
        leaves = [v.get_value() for _, v in nnx.to_flat_state(loaded)]
        jax.block_until_ready(leaves)
        seconds, read = time.perf_counter() - t0, _rchar() - read0
        peak = _status("VmHWM")
        local = sum(s.data.nbytes for a in leaves for s in a.addressable_shards)
        rows.append((seconds, peak - base, local, base, read, _share_bytes(leaves)))
        ok = values_match(folder, cfg, loaded)
        del leaves
    seconds = min(r[0] for r in rows)
    above = max(r[1] for r in rows)
    # out again: every process takes part in the per-tensor gathers, process 0 writes; then compared with the
    # source files tensor by tensor through the safetensors library
    out = Path(folder).parent / f"export_{jax.process_count()}proc"
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    pretrained.export_llm(loaded, cfg, out, like=folder)
    export_s = time.perf_counter() - t0
    export_above = _status("VmHWM") - base
    same = None
    if jax.process_index() == 0:
        from safetensors import safe_open

        src = json.loads((Path(folder) / "model.safetensors.index.json").read_text())["weight_map"]
        dst = {n: "model.safetensors" for n in src} if (out / "model.safetensors").exists() else json.loads(
            (out / "model.safetensors.index.json").read_text())["weight_map"]
        same = sorted(src) == sorted(dst)
        for name in src:
            with safe_open(str(Path(folder) / src[name]), "np") as a, safe_open(str(out / dst[name]), "np") as b:
                same = same and np.array_equal(a.get_tensor(name), b.get_tensor(name))
    print("BENCH " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                                 "devices": jax.local_device_count(), "seconds": round(seconds, 3),
                                 "rss_base": rows[0][3], "rss_peak_above_base": above, "local_param_bytes": rows[0][2],
                                 "bytes_read": max(r[4] for r in rows), "share_bytes": rows[0][5],
                                 "values_ok": ok, "export_s": round(export_s, 3), "export_rss_peak_above_base":
                                 export_above, "export_bit_exact": same}), flush=True)


def launch(folder: Path, b: BenchConfig, processes: int) -> list[dict]:
    """`processes` processes x 8/processes CPU devices loading (and exporting) `folder`; their JSON rows."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "BENCH_REPEATS": str(b.repeats),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // processes}"}
    cmd = [sys.executable, "-m", "recipes.bench.load", "--child", str(folder), b.layout]
    from omnijax.train.supervisor import free_port

    port = free_port()
    procs = []
    for i in range(processes):
        extra = ({"OMNIJAX_COORDINATOR": f"127.0.0.1:{port}", "OMNIJAX_NUM_PROCESSES": str(processes),
                  "OMNIJAX_PROCESS_ID": str(i)} if processes > 1 else {})
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out = []
    for p in procs:
        text = p.communicate(timeout=1800)[0]
        lines = [ln[6:] for ln in text.splitlines() if ln.startswith("BENCH ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"load child exited {p.returncode}: {text[-2000:]}")
        out.append(json.loads(lines[-1]))
    return out


def run(overrides: list[str]) -> Iterator[dict]:
    from omnijax.config import build

    b = build(BenchConfig, None, overrides, check=None)
    with tempfile.TemporaryDirectory(prefix="omnijax_bench_load_") as tmp:  # the exports land beside the folder
        folder = Path(tmp) / "llama"
        t0 = time.perf_counter()
        total = write_folder(b, folder)
        files = len(list(folder.glob("*.safetensors")))
        yield {"variant": "folder", "param_bytes": total, "files": files, "write_s": round(time.perf_counter() - t0, 2),
               "config": {k: getattr(b, k) for k in ("embed_dim", "num_layers", "mlp_dim", "vocab_size")}}
        for processes in (1, 2):
            rows = launch(folder, b, processes)
            ratios = [r["rss_peak_above_base"] / total for r in rows]
            row = {"variant": f"{processes}proc_x{8 // processes}dev", "layout": b.layout, "processes": processes,
                   "devices_per_process": 8 // processes, "param_bytes": total,
                   "seconds": max(r["seconds"] for r in rows),
                   "peak_rss_above_base_over_params": [round(x, 3) for x in ratios],
                   "local_param_bytes_over_params": [round(r["local_param_bytes"] / total, 3) for r in rows],
                   "bytes_read": [r["bytes_read"] for r in rows], "share_bytes": [r["share_bytes"] for r in rows],
                   "bytes_read_over_share": [round(r["bytes_read"] / max(1, r["share_bytes"]), 4) for r in rows],
                   "read_target": b.read_target,
                   "read_met": all(r["bytes_read"] <= b.read_target * r["share_bytes"] for r in rows),
                   "values_ok": all(r["values_ok"] for r in rows),
                   "export_s": max(r["export_s"] for r in rows),
                   "export_peak_rss_above_base_over_params": [round(r["export_rss_peak_above_base"] / total, 3)
                                                              for r in rows],
                   "export_bit_exact": rows[0]["export_bit_exact"]}
            if processes == 2:
                row.update(target=b.target, met=all(x <= b.target for x in ratios))
            yield row


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    child(sys.argv[2], sys.argv[3])
