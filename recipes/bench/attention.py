"""Attention implementations side by side: compiled temporary memory, fwd+bwd time and error vs the reference."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

from omnijax import allocator

DESCRIPTION = ("attention impls (reference, blockwise, cudnn on GPUs): temp bytes, fwd+bwd s, max error, "
               "by length (1k-16k causal) and on an encoder buffer of 16 segments x 256")


@dataclass
class AttentionBench:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384])
    heads: int = 4
    kv_heads: int = 2                  # GQA: 2 query heads per kv head
    head_dim: int = 64
    dtype: str = "auto"                # auto: float32 on CPU, bfloat16 on GPU
    block_q: int = 128
    block_k: int = 128
    reference_max_gib: float = 3.0     # the dense reference runs only where its compiled temporaries fit
    repeats: int = 3                   # timed runs up to 2048 rows; one fewer to 8192, one above (median)
    segments: int = 16
    segment_len: int = 256


def run(overrides: list[str]) -> Iterator[dict]:
    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(AttentionBench, None, overrides, check=None)
    if cfg.heads % cfg.kv_heads or min(cfg.lengths + [cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.repeats]) <= 0:
        raise ConfigError("bench attention: lengths, heads, kv_heads, head_dim, repeats must be > 0 and heads a "
                          "multiple of kv_heads")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from omnijax.layers.attention import cudnn_available, dot_product_attention

    on_gpu = cudnn_available()
    dtype = {"auto": jnp.bfloat16 if on_gpu else jnp.float32, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}.get(cfg.dtype)
    if dtype is None:
        raise ConfigError(f"bench attention: dtype={cfg.dtype!r}: must be auto, float32 or bfloat16")
    impls = ["reference", "blockwise"] + (["cudnn"] if on_gpu else [])
    common = {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "batch": 1,
              "dtype": jnp.dtype(dtype).name, "block_q": cfg.block_q, "block_k": cfg.block_k,
              "device": jax.devices()[0].device_kind, "allocator": allocator.in_use()}

    def inputs(n: int, seed: int = 0):
        ks = jax.random.split(jax.random.key(seed), 4)
        q = jax.random.normal(ks[0], (1, n, cfg.heads, cfg.head_dim), dtype)
        k = jax.random.normal(ks[1], (1, n, cfg.kv_heads, cfg.head_dim), dtype)
        v = jax.random.normal(ks[2], (1, n, cfg.kv_heads, cfg.head_dim), dtype)
        r = jax.random.normal(ks[3], q.shape, jnp.float32)  # output cotangent
        return q, k, v, r

    def program(impl: str, seg, pos, causal: bool):
        def fwd_bwd(q, k, v, r):
            f = lambda q, k, v: dot_product_attention(  # noqa: E731
                q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=causal,
                impl=impl, block_q=cfg.block_q, block_k=cfg.block_k)
            out, vjp = jax.vjp(f, q, k, v)
            return (out, *vjp(r.astype(out.dtype)))
        return jax.jit(fwd_bwd)

    def measure(impl: str, n: int, seg, pos, causal: bool, repeats: int):
        """(row fields, outputs) of one implementation; outputs None where the reference does not fit."""
        args = inputs(n)
        compiled = program(impl, seg, pos, causal).lower(*args).compile()
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        row = {"temp_bytes": temp}
        if impl == "reference" and temp > cfg.reference_max_gib * 2 ** 30:
            return {**row, "skipped": f"temporaries {temp / 2 ** 30:.1f} GiB > reference_max_gib"}, None
        times, outs = [], None
        for _ in range(repeats):  # already compiled: every run is timed
            t0 = time.perf_counter()
            outs = jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        return {**row, "fwd_bwd_s": round(statistics.median(times), 4), "runs": repeats}, outs

    def err(a, b) -> float:
        return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(a, b))

    # --- one causal segment, growing length
    temps: dict = {}
    for n in cfg.lengths:
        seg = jnp.ones((1, n), jnp.int32)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        repeats = cfg.repeats if n <= 2048 else max(1, cfg.repeats - 1) if n <= 8192 else 1
        ref_out = None
        for impl in impls:
            row, outs = measure(impl, n, seg, pos, True, repeats)
            if impl == "reference":
                ref_out = outs
            elif ref_out is not None and outs is not None:
                row["max_abs_err"] = err(outs, ref_out)
                row["vs"] = f"reference_L{n}"
            temps[(impl, n)] = row["temp_bytes"]
            extra = {}
            first = cfg.lengths[0]
            if impl != "reference" and n != first and (impl, first) in temps:
                # temp bytes per row relative to the shortest length: 1.0 = exactly linear
                extra = {"temp_growth_vs_linear": round(row["temp_bytes"] / temps[(impl, first)] / (n / first), 3),
                         "growth_vs": f"{impl}_L{first}"}
            yield {"variant": f"{impl}_L{n}", "length": n, "causal": True, "segments": 1, **row, **extra, **common}
            del outs

    # --- an encoder buffer: many short segments, bidirectional
    s, m = cfg.segments, cfg.segment_len
    n = s * m
    seg = jnp.repeat(jnp.arange(1, s + 1, dtype=jnp.int32), m)[None]
    pos = jnp.zeros((1, n), jnp.int32)
    name = f"segments{s}x{m}"
    ref_row, ref_out = measure("reference", n, seg, pos, False, max(1, cfg.repeats - 1))
    yield {"variant": f"reference_{name}", "length": n, "causal": False, "segments": s, **ref_row, **common}
    for impl in impls[1:]:
        row, outs = measure(impl, n, seg, pos, False, max(1, cfg.repeats - 1))
        if ref_out is not None:
            row["max_abs_err"] = err(outs, ref_out)
            row["speedup"] = round(ref_row["fwd_bwd_s"] / row["fwd_bwd_s"], 2)
            row["vs"] = f"reference_{name}"
        yield {"variant": f"{impl}_{name}", "length": n, "causal": False, "segments": s, **row, **common}
