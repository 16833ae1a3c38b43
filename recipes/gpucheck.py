"""The checks only a GPU can answer, in one command of a few minutes: JSON lines on stdout.

1. attention parity in bf16: cudnn vs blockwise vs the dense reference (forward and gradients) on a
   packed buffer of several causal segments, GQA;
2. `bench attention` (temp bytes and fwd+bwd time per implementation and length);
3. `bench llm_step` on a ~1B LLM in bf16 (tokens/s, MFU against the device's peak);
4. `bench omni` on one device (the multiplexed multimodal step).
Each bench runs in its own process with a time limit; one that fails prints a line with its error and
the rest still run. On a machine without a GPU it prints one line saying so and exits 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DESCRIPTION = "GPU-only checks in ~5 minutes (cuDNN attention parity, bench attention/llm_step at ~1B bf16 with MFU, bench omni); says so and exits 0 without a GPU"

LLM_1B = ["model.vocab_size=32000", "model.embed_dim=2048", "model.num_layers=16", "model.num_heads=16",
          "model.num_kv_heads=8", "model.head_dim=128", "model.mlp_dim=5632", "model.max_seq_len=2048",
          "data.seq_len=2048", "data.batch_size=8", "trainer.compute_dtype=bfloat16"]
BENCHES = [
    ("attention", ["lengths=[1024,4096,16384]", "repeats=3"], 150),
    ("llm_step", LLM_1B + ["bench.steps=10", "bench.warmup=2"], 180),
    ("omni", ["cpu_devices=0", "llm=dp1", "encoder=edp1", "steps=4", "variants=omnijax,coupled"], 150),
]


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def attention_parity(length: int = 2048, segments: int = 4) -> dict:
    """Max |error| of cudnn and blockwise vs the fp32 reference, bf16 inputs, outputs and q/k/v grads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from omnijax.layers.attention import cudnn_available, dot_product_attention

    rng = np.random.default_rng(0)
    b, h, kvh, dh = 2, 8, 2, 128
    q, k, v = (jnp.asarray(rng.standard_normal((b, length, n, dh)), jnp.bfloat16) for n in (h, kvh, kvh))
    seg_len = length // segments
    seg = np.repeat(np.arange(1, segments + 1), seg_len)[None].repeat(b, 0)
    seg[:, -seg_len // 2:] = 0  # padding tail
    pos = np.tile(np.arange(seg_len), segments)[None].repeat(b, 0)
    seg, pos = jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32)
    cot = jnp.asarray(rng.standard_normal((b, length, h, dh)), jnp.float32)

    def loss(impl, q, k, v):
        out = dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                    kv_positions=pos, causal=True, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * cot * (seg > 0)[..., None, None]), out

    def run(impl, dtype):
        args = [x.astype(dtype) for x in (q, k, v)]
        (_, out), grads = jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2), has_aux=True))(*args)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    ref = run("reference", jnp.float32)
    row = {"variant": "attention_parity", "length": length, "segments": segments, "dtype": "bfloat16",
           "cudnn_available": bool(cudnn_available())}
    for impl in ("blockwise", "cudnn") if cudnn_available() else ("blockwise",):
        got = run(impl, jnp.bfloat16)
        errs = [float(np.max(np.abs(g - r)) / max(float(np.max(np.abs(r))), 1e-6)) for g, r in zip(got, ref)]
        row[f"{impl}_rel_err"] = dict(zip(("out", "dq", "dk", "dv"), [round(e, 5) for e in errs]))
        row[f"{impl}_ok"] = all(e < 3e-2 for e in errs)  # bf16: ~8 bits of mantissa
    return row


def main(argv: list[str]) -> int:
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        _emit({"variant": "gpucheck", "skipped": True,
               "reason": f"no GPU here (jax backend: {backend}); run `python -m recipes gpucheck` on a GPU host"})
        return 0
    t0 = time.perf_counter()
    _emit({"variant": "gpucheck", "device": str(jax.devices()[0].device_kind), "devices": jax.device_count(),
           "jax": jax.__version__})
    try:
        _emit(attention_parity())
    except Exception as exc:  # report and go on: the benches below still say something
        _emit({"variant": "attention_parity", "error": f"{exc.__class__.__name__}: {exc}"[:2000]})
    for name, args, limit in BENCHES:
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "recipes", "bench", name, *args], capture_output=True,
                                  text=True, timeout=limit, env=dict(os.environ))
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            for row in rows:
                _emit({"bench": name, **row})
            if proc.returncode != 0 or not rows:
                _emit({"bench": name, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-1500:]})
        except subprocess.TimeoutExpired:
            _emit({"bench": name, "error": f"timed out after {limit} s"})
        _emit({"bench": name, "wall_s": round(time.perf_counter() - started, 1)})
    _emit({"variant": "gpucheck", "wall_s": round(time.perf_counter() - t0, 1)})
    return 0
