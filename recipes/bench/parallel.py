"""5D parallelism on the CPU mesh: compile and step time, tokens/s, collectives and bubble per layout."""
from __future__ import annotations

import time
from typing import Iterator

DESCRIPTION = "LLM layouts (pp/dp/fsdp/cp/tp/ep): compile_s, step_s, tokens/s, HLO collectives, bubble fraction"

# variant -> (layout, moe?, options)
VARIANTS = {
    "dp8": ("dp8", False, {}),
    "fsdp8": ("fsdp8", False, {}),
    "dp4xtp2": ("dp4xtp2", False, {}),
    "dp4xcp2": ("dp4xcp2", False, {}),
    "dp4xcp2:allgather": ("dp4xcp2", False, {"cp_impl": "allgather"}),
    "pp2xdp4": ("pp2xdp4", False, {}),
    "pp2xdp4:circular": ("pp2xdp4", False, {"schedule": "circular"}),
    "pp2xdp2xtp2": ("pp2xdp2xtp2", False, {}),
    "fsdp4xcp2": ("fsdp4xcp2", False, {}),
    "pp2xfsdp2xcp2": ("pp2xfsdp2xcp2", False, {}),
    "dp8:moe": ("dp8", True, {}),
    "ep4xdp2": ("ep4xdp2", True, {}),
    "dp2xtp2xep2": ("dp2xtp2xep2", True, {}),
}


def _options(overrides: list[str]) -> tuple[dict, list[str]]:
    opts = {"variants": ",".join(VARIANTS), "steps": "10", "seq_len": "64", "batch": "16", "layers": "4",
            "microbatches": "4"}
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("bench."):
            name = key.split(".", 1)[1]
            if name not in opts:
                from omnijax.errors import ConfigError

                raise ConfigError(f"unknown option {key}; known: {', '.join('bench.' + k for k in opts)}")
            opts[name] = value
        else:
            rest.append(o)
    return opts, rest


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import setup_devices

    opts, overrides = _options(overrides)
    if not any(o.startswith("parallel.cpu_devices=") for o in overrides):
        overrides = [*overrides, "parallel.cpu_devices=8"]
    setup_devices(overrides)

    import jax
    import numpy as np
    import optax
    from flax import nnx

    from omnijax.config import LLMConfig, MoEConfig
    from omnijax.errors import ConfigError
    from omnijax.models.llm import LLM
    from omnijax.parallel.engine import LLMParallel, count_collectives
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    names = [v for v in opts["variants"].split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise ConfigError(f"bench.variants: unknown variant '{v}'; known: {', '.join(VARIANTS)}")
    b, l, steps, nl = int(opts["batch"]), int(opts["seq_len"]), int(opts["steps"]), int(opts["layers"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (b, l)).astype(np.int32)
    seg = np.ones((b, l), np.int32)
    seg[:, l // 2:] = 2  # two packed documents per row
    pos = np.concatenate([np.arange(l // 2), np.arange(l - l // 2)])[None].repeat(b, 0).astype(np.int32)
    batch = dict(tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=seg, positions=pos,
                 loss_mask=np.ones((b, l), np.float32))
    optimizer = optax.adamw(1e-3)
    base: dict[str, float] = {}
    for name in names:
        layout, moe, kw = VARIANTS[name]
        cfg = LLMConfig(vocab_size=256, embed_dim=64, num_layers=nl, num_heads=4, num_kv_heads=2, head_dim=16,
                        mlp_dim=128, moe=MoEConfig(num_experts=4, top_k=2, mlp_dim=64, capacity_factor=1.25,
                                                   every=1 if moe else 0))
        par = LLMParallel(layout, cfg, microbatches=int(opts["microbatches"]), **kw)
        model = par.prepare(LLM(cfg, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        state = par.put_state(init_state(params, optimizer))
        placed = par.put_batch(batch)
        step = par.jit_train_step(make_train_step(graphdef, rest, par.loss_fn, optimizer), state, placed)
        t0 = time.perf_counter()
        state, m = step(state, placed)  # first call: trace + compile + one step
        jax.block_until_ready(m)
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(steps):  # per-step times; the median resists other processes on a shared host
            t0 = time.perf_counter()
            state, m = step(state, placed)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        compile_s = max(first_s - step_s, 0.0)
        collectives = count_collectives(step.fn.lower(state, placed).compile().as_text())
        if name in ("dp8", "dp8:moe"):  # baselines: dense and MoE model on plain data parallelism
            base[name] = step_s
        row = {"variant": name, "layout": str(par.layout), "compile_s": round(compile_s, 3),
               "step_s": round(step_s, 5), "step_s_min": round(min(times), 5), "tokens_per_s": round(b * l / step_s, 1),
               "collectives": collectives, "bubble_fraction": round(par.bubble_fraction, 4),
               "compiled_programs": step.programs, "loss": round(float(m["loss"]), 5),
               "moe_dropped_tokens": float(m.get("moe_dropped_tokens", 0.0)),
               "devices": jax.device_count(), "model": f"{nl} layers x 64 wide{' MoE 4 experts' if moe else ''}",
               "batch": b, "seq_len": l}
        ref = "dp8:moe" if moe else "dp8"
        if ref in base and name != ref:
            row.update({"vs": ref, "speedup": round(base[ref] / step_s, 3)})
        yield row
