"""The checks only a GPU can answer, in one prepared run of at most 8 minutes: JSON lines on stdout.

1. attention parity in bf16: cudnn vs blockwise vs the dense reference (forward and gradients) on a
   packed buffer of several causal segments, GQA;
2. `bench attention` (temp bytes and fwd+bwd time per implementation and length);
3. `bench llm_step` on a ~1B LLM in bf16 (tokens/s, MFU against the device's peak; the device's measured
   peak memory, `memory_stats()["peak_bytes_in_use"]` of the bench's process), beside the same step compiled deviceless for this card (`dryrun tiny_lm target=CARD`,
   on the host's CPUs while the GPU benches run): XLA's planned peak next to `memory_stats()`'s;
4. `bench omni` on one device (the multiplexed multimodal step);
5. `bench generate` on the GPU against transformers on the same GPU: greedy tokens equal and tokens/s,
   with float32 matmuls at full precision on both sides (JAX_DEFAULT_MATMUL_PRECISION=highest; torch's
   default has TF32 off), the parity path; docs/running.md states training's and serving's precision.

Every GPU check runs in its own process with a time limit, so this process never holds the GPU: the H200
run of Dec 4 ran the parity check here first, and jax's client then kept 75% of the card preallocated
while `bench llm_step` ran in a child with the quarter left (its step's temporaries, one buffer, did not
fit). One that fails prints a line with its error and the rest still run. Without a GPU: one line, exit 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DESCRIPTION = ("GPU-only checks in <= 8 minutes (cuDNN attention parity, bench attention, 1B llm_step MFU + measured "
               "vs deviceless-compiled memory, bench omni, generate parity vs transformers); exits 0 without a GPU")

LLM_1B = ["model.vocab_size=32000", "model.embed_dim=2048", "model.num_layers=16", "model.num_heads=16",
          "model.num_kv_heads=8", "model.head_dim=128", "model.mlp_dim=5632", "model.max_seq_len=2048",
          "data.seq_len=2048", "data.batch_size=8", "trainer.compute_dtype=bfloat16"]
PARITY_ENV = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}  # float32 matmuls in full float32, as torch's default
BENCHES = [  # (name, overrides, time limit s, extra environment)
    ("attention", ["lengths=[1024,4096,16384]", "repeats=3"], 120, {}),
    ("llm_step", LLM_1B + ["bench.steps=10", "bench.warmup=2", "bench.repeats=3"], 150, {}),
    ("omni", ["cpu_devices=0", "llm=dp1", "encoder=edp1", "steps=4", "variants=omnijax,coupled"], 100, {}),
    ("generate", ["torch_device=cuda", "lengths=[32,256]", "repeats=2"], 60, PARITY_ENV),
]
BUDGET_S = 470.0  # the whole run, dryrun included (<= 8 minutes)
CARDS = {"h100": "h100", "h200": "h200", "a100": "a100"}


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


def probe() -> dict:
    """The accelerator as a fresh process sees it (this process never starts a GPU client of its own)."""
    code = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'backend': jax.default_backend(), "
            "'kind': str(d.device_kind), 'count': jax.device_count(), 'jax': jax.__version__}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return {"backend": "unknown", "kind": "", "count": 0}


def card_of(kind: str) -> str | None:
    """The omnijax target card of a device kind ("NVIDIA H100 80GB HBM3" -> h100), None if none fits."""
    kind = kind.lower()
    return next((card for key, card in CARDS.items() if key in kind), None)


def _rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def main(argv: list[str]) -> int:
    if argv[:1] == ["part=parity"]:  # the child that holds the GPU for the parity check
        try:
            _emit(attention_parity())
        except Exception as exc:  # report and go on: the benches still say something
            _emit({"variant": "attention_parity", "error": f"{exc.__class__.__name__}: {exc}"[:2000]})
        return 0
    if argv[:1] == ["part=bench"]:  # a child running one bench, then its device's measured peak memory
        from recipes.__main__ import cmd_bench

        code = cmd_bench(argv[1], argv[2:])
        import jax

        _emit({"device_peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")})
        return code
    t0 = time.perf_counter()
    info = probe()
    if info.get("backend") != "gpu":
        _emit({"variant": "gpucheck", "skipped": True,
               "reason": f"no GPU here (jax backend: {info.get('backend')}); run `python -m recipes gpucheck` on a GPU host"})
        return 0
    _emit({"variant": "gpucheck", "device": info["kind"], "devices": info["count"], "jax": info.get("jax")})
    left = lambda: BUDGET_S - (time.perf_counter() - t0)  # noqa: E731
    card = card_of(info["kind"])
    compile_proc = None
    if card:  # the deviceless compile runs on the host's CPUs beside the GPU benches
        compile_proc = subprocess.Popen([sys.executable, "-m", "recipes", "dryrun", "tiny_lm", f"target={card}", *LLM_1B],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    measured_peak = None
    for name, args, limit, env in [("parity", [], 90, {})] + BENCHES:
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "recipes", "gpucheck", *(["part=parity"] if name == "parity" else
                                                             ["part=bench", name, *args])]
        timeout = max(10.0, min(limit, left() - 30))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
            rows = _rows(proc.stdout)
            for row in rows:
                _emit(row if name == "parity" else {"bench": name, **row})
                if name == "llm_step" and "device_peak_bytes" in row:
                    measured_peak = row["device_peak_bytes"]
            if proc.returncode != 0 or not rows:
                _emit({"bench": name, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-1500:]})
        except subprocess.TimeoutExpired:
            _emit({"bench": name, "error": f"timed out after {timeout:.0f} s"})
        _emit({"bench": name, "wall_s": round(time.perf_counter() - started, 1)})
    if compile_proc is not None:
        try:
            out, err = compile_proc.communicate(timeout=max(10.0, left()))
            compiled = (_rows(out) or [{}])[-1]
            row = {"variant": "memory_1b", "target": card, "compiled_peak_bytes": compiled.get("peak_bytes_per_device"),
                   "compiled_temp_bytes": compiled.get("temp_bytes"), "measured_peak_bytes": measured_peak,
                   "attention_kernels": compiled.get("attention_kernels")}
            if row["compiled_peak_bytes"] and measured_peak:
                row["measured_over_compiled"] = round(measured_peak / row["compiled_peak_bytes"], 3)
            if not compiled:
                row["error"] = err[-1500:]
            _emit(row)
        except subprocess.TimeoutExpired:
            compile_proc.kill()
            _emit({"variant": "memory_1b", "error": "the deviceless compile did not finish within the budget"})
    _emit({"variant": "gpucheck", "wall_s": round(time.perf_counter() - t0, 1)})
    return 0
