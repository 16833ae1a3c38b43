"""Joint multimodal step on a dynamic mix: omnijax's decoupled multiplexing vs its baselines.

All variants train the same model on the same batches from the built-in world (images of varied
resolutions, long videos, audio, text-only samples; the mix changes over steps) on one LLM layout
(default pp2xdp2xtp2 with encoders edp4xesp2), interleaved step by step in one process so that
machine noise hits them alike:
- omnijax:       decoupled encoders, cost-balanced placement, long-short SP, LLM rows balanced;
- coupled:       encoders follow the LLM layout (pp stage 0 only, replicated over tp/cp), arrival order;
- no_reorder:    decoupled, but segments and rows in arrival order;
- no_long_short: decoupled and balanced, every segment data-parallel.
"""
from __future__ import annotations

import time
from typing import Iterator

DESCRIPTION = "multimodal joint step: tokens/s, padding, encoder/LLM imbalance of omnijax vs coupled and ablations"

VARIANTS = {  # mode, long_short, balance LLM rows
    "omnijax": ("balanced", True, True),
    "coupled": ("coupled", False, False),
    "no_reorder": ("arrival", True, False),
    "no_long_short": ("balanced", False, True),
}

MM = {"llm": {"vocab_size": 512, "embed_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 16, "mlp_dim": 128, "max_seq_len": 128},
      "encoders": {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 64,
                              "embed_dim": 64, "num_layers": 2, "num_heads": 4, "mlp_dim": 128},
                   "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 64, "num_layers": 2,
                             "num_heads": 4, "mlp_dim": 128}}}

# Mix phases (curriculum): the share of each modality changes every few steps.
PHASES = [{"image": 0.5, "video": 0.2, "audio": 0.2, "text": 0.1},
          {"image": 0.2, "video": 0.4, "audio": 0.2, "text": 0.2},
          {"image": 0.1, "video": 0.1, "audio": 0.3, "text": 0.5}]


def _options(overrides: list[str]) -> dict:
    opts = {"steps": 6, "llm": "pp2xdp2xtp2", "encoder": "edp4xesp2", "batch_size": 16, "seq_len": 128,
            "cpu_devices": 8, "variants": ",".join(VARIANTS)}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.removeprefix("bench.").removeprefix("parallel.")
        if key not in opts:
            from omnijax.errors import ConfigError

            raise ConfigError(f"bench omni: unknown option '{key}'; known: {', '.join(opts)}")
        opts[key] = type(opts[key])(value)
    return opts


def batches(cfg, steps: int, batch_size: int, seq_len: int) -> list[dict]:
    from omnijax.data.world import Tail, World, WorldConfig
    from recipes.tiny_omni import Packer

    packer = Packer(cfg, batch_size, seq_len, {"vision": 4096, "audio": 1024})
    out = []
    for step in range(steps):
        world = World(WorldConfig(seed=step, weights=PHASES[step * len(PHASES) // steps],
                                  image_side=Tail(16, 64, 1.2), video_side=Tail(16, 32, 1.3),
                                  video_frames=Tail(2, 24, 1.1), audio_items=Tail(1, 12, 1.1),
                                  text_words=Tail(2, 48, 1.0)))
        batch, _ = packer.pack(world.sample(i) for i in range(10_000))
        out.append(batch)
    return out


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import setup_devices

    opts = _options(overrides)
    setup_devices([f"parallel.cpu_devices={opts['cpu_devices']}"])
    import jax
    import numpy as np
    from flax import nnx

    from omnijax.config import OptimizerConfig, from_dict
    from omnijax.models import mllm
    from omnijax.models.mm_config import MMConfig
    from omnijax.parallel import routing
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer
    from omnijax.train.optimizer import make_optimizer
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    cfg = from_dict(MMConfig, MM)
    host = batches(cfg, opts["steps"] + 1, opts["batch_size"], opts["seq_len"])  # +1: compile step
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), opts["steps"] + 1)
    names = [v for v in opts["variants"].split(",") if v]
    runs = {}
    for name in names:
        mode, long_short, balance = VARIANTS[name]
        engine = LLMParallel(opts["llm"], cfg.llm)
        mx = Multiplexer(engine, cfg, encoder_layout=opts["encoder"], mode=mode, long_short=long_short,
                         balance_rows=balance)
        model = mx.prepare(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0)))
        g, params, rest = nnx.split(model, nnx.Param, ...)
        mx.reserve(host)  # capacities for the whole run up front: timed steps reuse one program
        step = jax.jit(make_train_step(g, rest, mx.loss_fn, opt), donate_argnums=0)
        runs[name] = {"mx": mx, "step": step, "state": mx.put_state(init_state(params, opt)), "batches": host,
                      "time": 0.0, "plan_s": 0.0, "tokens": 0, "stats": [], "losses": []}
    for i in range(opts["steps"] + 1):
        for name in names:  # interleaved: the same noise for every variant
            r = runs[name]
            t0 = time.perf_counter()
            dev = r["mx"].put_batch(r["batches"][i])
            t1 = time.perf_counter()
            r["state"], m = r["step"](r["state"], dev)
            jax.block_until_ready(m["loss"])
            t2 = time.perf_counter()
            if i == 0:
                r["compile_s"] = t2 - t1
                continue
            r["plan_s"] += t1 - t0
            r["time"] += t2 - t1
            r["tokens"] += int((np.asarray(r["batches"][i]["segment_ids"]) > 0).sum())
            plan = r["mx"].last_plan
            traffic = routing.route_traffic(plan, hosts=2, bytes_per_token=4 * cfg.llm.embed_dim)
            r["stats"].append({**plan.stats, **traffic})
            r["losses"].append(float(m["loss"]))
    # Encoder share of the omnijax step: the same program on the same batches with every encoder
    # segment removed (lax.cond skips empty buffers; capacities are unchanged, so no recompile).
    share = None
    if "omnijax" in runs:
        r = runs["omnijax"]
        programs = int(r["step"]._cache_size())
        bare = []
        for b in host[1:]:
            b = dict(b)
            for enc in ("vision", "audio"):
                b[f"{enc}_segment_ids"] = np.zeros_like(b[f"{enc}_segment_ids"])
                b[f"{enc}_dest"] = np.full_like(b[f"{enc}_dest"], -1)
            bare.append(b)
        t_bare = 0.0
        for b in bare:
            dev = r["mx"].put_batch(b)
            t0 = time.perf_counter()
            r["state"], m = r["step"](r["state"], dev)
            jax.block_until_ready(m["loss"])
            t_bare += time.perf_counter() - t0
        share = {"encoder_share_of_step": round(1.0 - t_bare / r["time"], 3),
                 "step_s_without_encoder_work": round(t_bare / len(bare), 3),
                 "recompiled_for_text_only": int(r["step"]._cache_size()) - programs}
    rows = {}
    for name in names:
        r = runs[name]
        mean = lambda key: float(np.mean([s[key] for s in r["stats"]]))  # noqa: E731
        rows[name] = {"variant": name, "tokens_per_s": round(r["tokens"] / r["time"], 1),
                      "padded_fraction": round(mean("padded_fraction"), 4),
                      "enc_cost_max_over_mean": round(mean("enc_cost_max_over_mean"), 3),
                      "llm_cost_max_over_mean": round(mean("llm_cost_max_over_mean"), 3),
                      "compiled_programs": int(r["step"]._cache_size()),
                      "step_s": round(r["time"] / opts["steps"], 3), "plan_ms": round(1e3 * r["plan_s"] / opts["steps"], 1),
                      "compile_s": round(r["compile_s"], 1),
                      "reshard_kb_intra_host": round(mean("intra_host_bytes") / 1024, 1),  # as 2 hosts x 4 devices
                      "reshard_kb_inter_host": round(mean("inter_host_bytes") / 1024, 1), "long_segments": mean("long_segments"),
                      "final_loss": round(r["losses"][-1], 4), "layout": f"{opts['llm']}+{opts['encoder']}",
                      "devices": jax.device_count(), "steps": opts["steps"]}
    base = rows.get("coupled")
    for name in names:
        row = rows[name]
        if name == "omnijax" and share:
            row.update(share)
        if name == "omnijax" and base:
            row["vs"] = "coupled"
            row["speedup"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        yield row
