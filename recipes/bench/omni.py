"""Joint multimodal step on a dynamic mix: omnijax's decoupled multiplexing vs its baselines.

All variants train the same model on the same batches from the built-in world (images of varied
resolutions, long videos, audio, text-only samples; the mix changes over steps) on one LLM layout
(default pp2xdp2xtp2 with encoders edp4xesp2), interleaved step by step in one process so that
machine noise hits them alike:
- omnijax:       decoupled encoders, cost-balanced placement, long-short SP, LLM rows balanced;
- coupled:       encoders follow the LLM layout (pp stage 0 only, replicated over tp/cp), arrival order;
- no_reorder:    decoupled, but segments and rows in arrival order;
- no_long_short: decoupled and balanced, every segment data-parallel;
- omnijax_interleaved: omnijax with the encoders inside the pipeline loop (each microbatch planned
  and encoded one iteration ahead of stage 0), side by side with the encoder phase before it.
"""
from __future__ import annotations

import time
from typing import Iterator

DESCRIPTION = "multimodal joint step: tokens/s, padding, encoder/LLM imbalance of omnijax vs coupled and ablations"

VARIANTS = {  # mode, long_short, balance LLM rows, encoders inside the pipeline loop (None: bench.interleave)
    "omnijax": ("balanced", True, True, None),
    "coupled": ("coupled", False, False, None),
    "no_reorder": ("arrival", True, False, None),
    "no_long_short": ("balanced", False, True, None),
    "omnijax_interleaved": ("balanced", True, True, True),
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
    opts = {"steps": 6, "llm": "pp2xdp2xtp2", "encoder": "edp4xesp2", "batch_size": 32, "seq_len": 128,
            "cpu_devices": 8, "variants": ",".join(VARIANTS), "lookahead": 256, "window": 3,
            "bucket_growth": 1.0625, "interleave": "0"}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.removeprefix("bench.").removeprefix("parallel.")
        if key not in opts:
            from omnijax.errors import ConfigError

            raise ConfigError(f"bench omni: unknown option '{key}'; known: {', '.join(opts)}")
        opts[key] = type(opts[key])(value)
    return opts


def _best_subset(sizes: list[int], room: int) -> list[int]:
    """Indices of a subset of `sizes` with the largest sum <= room (subset-sum DP; earlier items
    preferred on ties)."""
    best = {0: []}  # reachable sum -> the items that reach it (first found)
    for i, n in enumerate(sizes):
        for total, items in list(best.items()):
            if total + n <= room and total + n not in best:
                best[total + n] = items + [i]
        if room in best:
            break
    return best[max(best)]


def pack_lookahead(packer, stream: Iterator, deferred: list, lookahead: int) -> tuple[dict, list]:
    """One batch, filled row by row from a look-ahead pool of candidate samples (`deferred` first,
    topped up from `stream` to `lookahead`): each row takes the oldest pending sample, then the
    subset of the pool that fills the rest of the row best, within the encoder buffers. Samples left
    in the pool are deferred to the next batch (returned), never dropped; the oldest go first, so none
    waits forever."""
    B, L = packer.B, packer.L
    enc = {n: 0 for n in packer.capacity}
    pool: list = []  # (sample, llm tokens, encoder rows)
    pending = list(deferred)

    def top_up():
        while len(pool) < max(lookahead, 1):
            sample = pending.pop(0) if pending else next(stream)
            sizes = packer.sizes(sample)
            if sizes is not None:  # None: can never fit (Packer counts it in `skipped`)
                pool.append((sample, *sizes))

    def fits(rows: dict) -> bool:
        return all(enc[n] + k <= packer.capacity[n] for n, k in rows.items())

    rows_of: list[list] = []
    for _ in range(B):
        top_up()
        row, room = [], L
        if fits(pool[0][2]):
            first = pool.pop(0)
            row.append(first[0])
            room -= first[1]
            for n, k in first[2].items():
                enc[n] += k
        if lookahead > 1:
            ok = [j for j, (_, llm, rows) in enumerate(pool) if llm <= room and fits(rows)]
            while True:
                pick = [ok[j] for j in _best_subset([pool[j][1] for j in ok], room)]
                total = {n: sum(pool[j][2].get(n, 0) for j in pick) for n in enc}
                if fits(total):
                    break
                ok.remove(max(pick, key=lambda j: max(pool[j][2].values(), default=0)))  # over an encoder buffer
            for j in sorted(pick, reverse=True):
                sample, llm, rows = pool.pop(j)
                row.insert(1, sample)
                room -= llm
                for n, k in rows.items():
                    enc[n] += k
        rows_of.append(row)
    chosen = [x for row in rows_of for x in row]  # row by row: Packer's first fit keeps every one
    batch, consumed = packer.pack(iter(chosen))
    if len(consumed) != len(chosen):
        raise RuntimeError(f"look-ahead packing: Packer took {len(consumed)} of {len(chosen)} chosen samples")
    return batch, [x[0] for x in pool] + pending


def batches(cfg, steps: int, batch_size: int, seq_len: int, lookahead: int = 64) -> list[dict]:
    """`steps` packed batches of one sample stream per mix phase (deferred samples go first into the
    next batch). lookahead=1 packs like the plain Packer: the batch closes at the first misfit."""
    from omnijax.data.world import Tail, World, WorldConfig
    from recipes.tiny_omni import Packer

    scale = max(1, batch_size // 16)
    packer = Packer(cfg, batch_size, seq_len, {"vision": 8192 * scale, "audio": 4096 * scale})  # host staging only
    streams, out, deferred = {}, [], []
    for step in range(steps):
        phase = step * len(PHASES) // steps
        if phase not in streams:
            world = World(WorldConfig(seed=phase, weights=PHASES[phase],
                                      image_side=Tail(16, 64, 1.2), video_side=Tail(16, 32, 1.3),
                                      video_frames=Tail(2, 24, 1.1), audio_items=Tail(1, 12, 1.1),
                                      text_words=Tail(2, 48, 1.0)))
            streams[phase] = (world.sample(i) for i in range(10**9))
        batch, deferred = pack_lookahead(packer, streams[phase], deferred, lookahead)
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
    from omnijax.mm_config import MMConfig
    from omnijax.parallel import routing
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer
    from omnijax.train.optimizer import make_optimizer
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    cfg = from_dict(MMConfig, MM)
    steps, w = opts["steps"], max(1, opts["window"])
    t0 = time.perf_counter()
    host = batches(cfg, steps, opts["batch_size"], opts["seq_len"], opts["lookahead"])
    pack_s = time.perf_counter() - t0
    windows = [list(range(i, min(i + w, steps))) for i in range(0, steps, w)]
    window_of = {i: k for k, win in enumerate(windows) for i in win}
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), steps)
    names = [v for v in opts["variants"].split(",") if v]
    runs = {}
    for name in names:
        mode, long_short, balance, interleave = VARIANTS[name]
        engine = LLMParallel(opts["llm"], cfg.llm)
        if interleave is None:
            interleave = opts["interleave"] in ("1", "true")
        mx = Multiplexer(engine, cfg, encoder_layout=opts["encoder"], mode=mode, long_short=long_short,
                         balance_rows=balance, interleave=interleave)
        model = mx.prepare(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0)))
        g, params, rest = nnx.split(model, nnx.Param, ...)
        t0 = time.perf_counter()
        caps = [mx.fit_window([host[i] for i in win], opts["bucket_growth"]) for win in windows]
        fit_s = time.perf_counter() - t0
        step = jax.jit(make_train_step(g, rest, mx.loss_fn, opt), donate_argnums=0)
        runs[name] = {"mx": mx, "step": step, "state": mx.put_state(init_state(params, opt)), "caps": caps,
                      "fit_s": fit_s, "time": 0.0, "plan_s": 0.0, "tokens": 0, "stats": [], "losses": [],
                      "compile_s": 0.0, "grew": 0}
    # Warm-up: compile every window's program once, on a throwaway copy of the state (steady-state timing).
    for name in names:
        r = runs[name]
        for k, win in enumerate(windows):
            r["mx"].capacities = dict(r["caps"][k])
            dev = r["mx"].put_batch(host[win[0]])
            before = r["step"]._cache_size()
            t0 = time.perf_counter()
            _, m = r["step"](jax.tree.map(lambda x: x.copy(), r["state"]), dev)
            jax.block_until_ready(m["loss"])
            if r["step"]._cache_size() > before:
                r["compile_s"] += time.perf_counter() - t0
    for i in range(steps):
        for name in names:  # interleaved: the same noise for every variant
            r = runs[name]
            mx = r["mx"]
            mx.capacities = dict(r["caps"][window_of[i]])
            t0 = time.perf_counter()
            dev = mx.put_batch(host[i])
            t1 = time.perf_counter()
            r["grew"] += int(mx.capacities != r["caps"][window_of[i]])  # a plan outgrew its window's capacities
            r["state"], m = r["step"](r["state"], dev)
            jax.block_until_ready(m["loss"])
            t2 = time.perf_counter()
            r["plan_s"] += t1 - t0
            r["time"] += t2 - t1
            r["tokens"] += int((np.asarray(host[i]["segment_ids"]) > 0).sum())
            plan = mx.last_plan
            traffic = routing.route_traffic(plan, hosts=2, bytes_per_token=4 * cfg.llm.embed_dim)
            r["stats"].append({**plan.stats, **traffic})
            r["losses"].append(float(m["loss"]))
    # Encoder share of the omnijax step: the same program on the same batches with every encoder
    # segment removed (lax.cond skips empty buffers; capacities are unchanged, so no recompile).
    shares = {}
    for name in ("omnijax", "omnijax_interleaved"):
        if name not in runs:
            continue
        r = runs[name]
        programs = int(r["step"]._cache_size())
        t_bare = 0.0
        for i, b in enumerate(host):
            b = dict(b)
            for enc in ("vision", "audio"):
                b[f"{enc}_segment_ids"] = np.zeros_like(b[f"{enc}_segment_ids"])
                b[f"{enc}_dest"] = np.full_like(b[f"{enc}_dest"], -1)
            r["mx"].capacities = dict(r["caps"][window_of[i]])
            dev = r["mx"].put_batch(b)
            t0 = time.perf_counter()
            r["state"], m = r["step"](r["state"], dev)
            jax.block_until_ready(m["loss"])
            t_bare += time.perf_counter() - t0
        shares[name] = {"encoder_share_of_step": round(1.0 - t_bare / r["time"], 3),
                        "step_s_without_encoder_work": round(t_bare / len(host), 3),
                        "recompiled_for_text_only": int(r["step"]._cache_size()) - programs}
    rows = {}
    for name in names:
        r = runs[name]
        mean = lambda key: float(np.mean([s[key] for s in r["stats"]]))  # noqa: E731
        total = lambda key: float(np.sum([s.get(key, 0) for s in r["stats"]]))  # noqa: E731
        rows[name] = {"variant": name, "tokens_per_s": round(r["tokens"] / r["time"], 1),
                      "padded_fraction": round(mean("padded_fraction"), 4),
                      "enc_cost_max_over_mean": round(mean("enc_cost_max_over_mean"), 3),
                      "llm_cost_max_over_mean": round(mean("llm_cost_max_over_mean"), 3),
                      "bubble_fraction": round(float(r["mx"].bubble_fraction), 4),
                      "compiled_programs": int(r["step"]._cache_size()), "windows": len(windows),
                      "capacities_grew": r["grew"],
                      "step_s": round(r["time"] / steps, 3), "plan_ms": round(1e3 * r["plan_s"] / steps, 1),
                      "fit_capacities_ms": round(1e3 * r["fit_s"] / len(windows), 1),
                      "compile_s": round(r["compile_s"], 1),
                      "reshard_kb_intra_host": round(mean("intra_host_bytes") / 1024, 1),  # as 2 hosts x 4 devices
                      "reshard_kb_inter_host": round(mean("inter_host_bytes") / 1024, 1), "long_segments": mean("long_segments"),
                      "short_in_long_segments": mean("short_in_long_segments"),
                      "final_loss": round(r["losses"][-1], 4), "layout": f"{opts['llm']}+{opts['encoder']}",
                      "interleaved": r["mx"].interleave,
                      "devices": jax.device_count(), "steps": steps, "batch_size": opts["batch_size"],
                      "pack_s": round(pack_s, 1)}
        for enc in ("vision", "audio"):
            rows[name][f"padded_fraction_{enc}"] = round(
                1 - total(f"enc_rows_real_{enc}") / max(total(f"enc_rows_computed_{enc}"), 1), 4)
        rows[name]["padded_fraction_llm"] = round(
            1 - total("llm_tokens_real") / max(total("llm_tokens_computed"), 1), 4)
    base = rows.get("coupled")
    for name in names:
        row = rows[name]
        row.update(shares.get(name, {}))
        if name in ("omnijax", "omnijax_interleaved") and base:
            row["vs"] = "coupled"
            row["speedup"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        yield row
