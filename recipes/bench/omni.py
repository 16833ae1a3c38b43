"""Joint multimodal step on a dynamic mix: omnijax's decoupled multiplexing vs its baselines.

All variants train the same model on the same batches from the built-in world (images of varied
resolutions, long videos, audio, text-only samples; the mix changes over steps), packed by the data
plane that training uses (`batches`: rows already balanced over the ranks by cost, so no variant moves
them again), on one LLM layout (default pp2xdp2xtp2 with encoders edp4xesp2), interleaved step by step
in one process so that machine noise hits them alike:
- omnijax:            decoupled encoders, cost-balanced placement, long-short SP;
- coupled:            the baseline users run today (`parallel/baselines.py`): encoders on pp stage 0,
  each batch shard's segments split over that stage's tp/cp ranks as Megatron shards its ViT over the
  tensor-parallel group (no replicated work, but stage 0 carries all encoder time), arrival order;
- coupled_replicated: as coupled, but every tp/cp rank of stage 0 encodes the shard's whole set;
- no_reorder:         decoupled, but segments in arrival order;
- no_long_short:      decoupled and balanced, every segment data-parallel;
- omnijax_interleaved: omnijax with the encoders inside the pipeline loop (each microbatch planned
  and encoded one iteration ahead of stage 0), side by side with the encoder phase before it.

Two figures per row, because 8 fake devices share this machine's cores: `tokens_per_s` (measured) follows
the *total* work of all devices and cannot show a straggler, so a placement that piles work on a few
devices looks as fast as one that spreads it; `critical_path_s` is the planned time of the busiest
device per phase (encoders, all-to-all, LLM; `scale.plan_phases_cpu`'s per-device work with the FLOP cost
model on an H100 table entry, each phase lasting as long as its slowest device), what a GPU step follows.
`*_speedup` compare with `coupled`. For the calibration of that model on this mesh (`bench scale`'s
`calibration_cpu8`) every row also has `cpu_s` (process CPU seconds per timed step: all threads, so a
device that spins while it waits at a collective shows there) with `cpu_cores_busy` (cpu_s / step_s), and,
timed in a second pass with every encoder segment removed (same program), `step_s_without_encoder_work` /
`cpu_s_without_encoder_work` and `encoder_share_of_step`: the encoder part and the rest measured apart
(`phases=0`: that pass for omnijax and omnijax_interleaved only, as before).

Then a host-work pair (`host_pair=1`): the omnijax steps fed by the trainer's prefetcher
(`train/prefetch.py`: loader + plan + transfer running ahead in a thread) vs the same steps with their
batches prepared beforehand; `prefetch_over_prepared` is the ratio of their step times (steady state, the
first step's fill excluded). On a GPU host the step computes on the devices while host work uses the CPU;
here the fake devices are CPU threads, so the pair runs as on a GPU host: the step's threads on all but
`host_cores` cores, the prefetch thread and the loader threads it starts on those (`Prefetcher(cpus=...)`),
then once more with every core shared (`*_shared_cores`: what host work costs when it takes the step's
CPU time). Two probes bound what the split can show here: the prepared steps with a thread on the host
cores that runs pure Python (`probe_python_thread_over_prepared`: the GIL alone) or streams memory
(`probe_memory_thread_over_prepared`: the caches and memory the fake devices share with the host).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

DESCRIPTION = "multimodal joint step: tokens/s, padding, encoder/LLM imbalance of omnijax vs coupled and ablations"

VARIANTS = {  # mode, long_short, encoders inside the pipeline loop (None: bench.interleave)
    "omnijax": ("balanced", True, None),
    "coupled": ("coupled", False, None),
    "coupled_replicated": ("coupled_replicated", False, None),
    "no_reorder": ("arrival", True, None),
    "no_long_short": ("balanced", False, None),
    "omnijax_interleaved": ("balanced", True, True),
}

MM = {"llm": {"vocab_size": 512, "embed_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 16, "mlp_dim": 128, "max_seq_len": 128},
      "encoders": {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 64,
                              "embed_dim": 64, "num_layers": 2, "num_heads": 4, "mlp_dim": 128},
                   "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 64, "num_layers": 2,
                             "num_heads": 4, "mlp_dim": 128}}}

# `model=qwen2_5_vl`: Qwen2.5-VL's parts at MM's widths (window-attention `qwen_vit` tower, M-RoPE LLM), resizing
# within 8x8..64x64 px so the world's images and frames keep their native resolution (16..64 px sides: 16..256
# patches per image or temporal patch, counts varying sample by sample).
QWEN = {"llm": {**MM["llm"], "rope": {"mrope_section": [2, 3, 3], "theta": 10000.0}},
        "encoders": {"vision": {"kind": "qwen_vit", "patch": 4, "temporal_patch": 2, "merge": 2, "embed_dim": 64,
                                "num_layers": 2, "num_heads": 4, "mlp_dim": 128, "out_dim": 64, "window_size": 16,
                                "fullatt_block_indexes": [1], "min_pixels": 64, "max_pixels": 64 * 64}},
        "modalities": {"image": "vision", "video": "vision"}}

# Mix phases (curriculum): the share of each modality changes every few steps.
PHASES = [{"image": 0.5, "video": 0.2, "audio": 0.2, "text": 0.1},
          {"image": 0.2, "video": 0.4, "audio": 0.2, "text": 0.2},
          {"image": 0.1, "video": 0.1, "audio": 0.3, "text": 0.5}]


def _options(overrides: list[str]) -> dict:
    opts = {"steps": 6, "llm": "pp2xdp2xtp2", "encoder": "edp4xesp2", "batch_size": 32, "seq_len": 128,
            "cpu_devices": 8, "variants": ",".join(VARIANTS), "lookahead": 128, "window": 3,
            "bucket_growth": 0.0, "interleave": "0", "hosts": 2, "host_pair": "1", "host_repeats": 5, "host_cores": 1, "hardware": "h100",
            "model": "", "phases": "1"}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.removeprefix("bench.").removeprefix("parallel.")
        if key not in opts:
            from omnijax.errors import ConfigError

            raise ConfigError(f"bench omni: unknown option '{key}'; known: {', '.join(opts)}")
        opts[key] = type(opts[key])(value)
    return opts


def model_config(model: str):
    """The bench's MMConfig: "" the composed toy (MM), `qwen2_5_vl` the tiny Qwen2.5-VL (QWEN), or a
    Qwen2-VL/Qwen2.5-VL folder's config (e.g. `example_models model=qwen2_5_vl`'s output)."""
    from omnijax.config import from_dict
    from omnijax.mm_config import MMConfig

    if model in ("", "omni"):
        return from_dict(MMConfig, MM)
    if model == "qwen2_5_vl":
        return from_dict(MMConfig, QWEN)
    from pathlib import Path

    from omnijax.interop import qwen_vl

    if not Path(model).is_dir():
        from omnijax.errors import ConfigError

        raise ConfigError(f"bench omni: model={model!r}: qwen2_5_vl, or a Qwen2-VL/Qwen2.5-VL folder")
    return qwen_vl.config_from_folder(model)[0]


def _ranks(opts: dict) -> int:
    """Data-parallel ranks the batches are planned for: cpu_devices, or (0) the accelerators present (gpucheck)."""
    import jax
    return opts["cpu_devices"] or jax.device_count()


def batches(cfg, steps: int, batch_size: int, seq_len: int, lookahead: int = 256, devices: int = 8,
            window: int = 3) -> list[dict]:
    """`steps` global batches from the data plane, the packer training uses (`omnijax.data.loader`): one
    world source per mix phase, switched by a step schedule; each window of `window` steps is planned
    together (grouped reordering by cost over `devices` ranks, then each encoder's rows evened out over
    the window's steps: the window runs one program sized for its fullest step) from a pool of
    `lookahead` samples per step; samples that find no room wait for the next window, none is dropped."""
    loader = make_loader(cfg, steps, batch_size, seq_len, lookahead, devices, window)
    return [loader.host_batch(step)["microbatches"][0] for step in range(steps)]


def _phases(cfg) -> list[dict[str, float]]:
    """PHASES for `cfg`'s modalities: a modality the model has no encoder for gives its share to text."""
    out = []
    for p in PHASES:
        kept = {m: v for m, v in p.items() if m == "text" or m in cfg.modalities}
        kept["text"] = kept.get("text", 0.0) + sum(v for m, v in p.items() if m not in kept)
        out.append(kept)
    return out


def make_loader(cfg, steps: int, batch_size: int, seq_len: int, lookahead: int = 256, devices: int = 8,
                window: int = 3):
    """The data-plane `Loader` behind `batches` (a fresh one gives the same batches: plans are pure)."""
    from omnijax.data.loader import Loader, LoaderConfig
    from omnijax.data.sources import SourceSpec, WorldSource
    from omnijax.data.world import Tail, WorldConfig

    names = [f"phase{k}" for k in range(len(PHASES))]
    sources = [WorldSource(name, cfg=WorldConfig(seed=k, weights=_phases(cfg)[k], image_side=Tail(16, 64, 1.2),
                                                 video_side=Tail(16, 32, 1.3), video_frames=Tail(2, 24, 1.1),
                                                 audio_items=Tail(1, 12, 1.1), text_words=Tail(2, 48, 1.0)))
               for k, name in enumerate(names)]
    mix = [{"step": k * steps // len(PHASES), "weights": {n: float(j == k) for j, n in enumerate(names)}}
           for k in range(len(PHASES))]
    scale = max(1, batch_size // 16)
    plane = LoaderConfig(sources=[SourceSpec(name=n, kind="world") for n in names], mix=mix,
                         samples_per_step=max(lookahead, 1), dp=devices, microbatches=1, window=max(window, 1),
                         row_len=seq_len, max_rows=batch_size // devices, fixed_shapes=True,
                         max_encoder_rows={e: {"vision": 8192, "audio": 4096}.get(e, 8192) * scale // devices
                                           for e in cfg.encoders})
    return Loader(plane, mm_cfg=cfg, sources=sources)


def without_encoder_work(host: list[dict], encoders) -> list[dict]:
    """The batches with every encoder segment removed (no segment ids, no destinations): the same program
    and buffers, its encoder branches skipped, so what remains is the step's LLM and fixed work."""
    import numpy as np

    stripped = []
    for b in host:
        b = dict(b)
        for enc in encoders:
            b[f"{enc}_segment_ids"] = np.zeros_like(b[f"{enc}_segment_ids"])
            b[f"{enc}_dest"] = np.full_like(b[f"{enc}_dest"], -1)
        stripped.append(b)
    return stripped


def critical_path(mx, host_batch: dict, plan, hw) -> dict[str, float]:
    """Planned seconds of one step on the busiest device of each phase (GPU mode: the encoder phase, the
    all-to-all and the LLM are separated by barriers): per-device encoder work of the real buffers
    (`scale.plan_phases_cpu`, every non-empty buffer costs its capacity plus the attention blocks it
    visits) and each batch shard's LLM work over its pp·tp·cp devices with the pipeline bubble, from the
    FLOP cost model at `hw`'s achieved FLOP/s. Interleaved plans ([D, M, ...]) add their microbatches'
    encoder work (the overlap with the pipeline is not credited)."""
    import numpy as np

    from omnijax.data.cost import CostModel
    from omnijax.parallel import routing
    from omnijax.perfmodel import scale

    sec = 1e6 / (hw.peak_flops * hw.efficiency)  # MFLOP -> s
    cm = CostModel.from_flops(mx.mm_cfg)
    enc_coeffs = {}
    for name, c in cm.encoders.items():  # per input row (the default cost counts audio after its reduction)
        r = mx.reductions[name] if name == "audio" else 1
        enc_coeffs[name] = (c.a * sec / r, c.b * sec / r ** 2, 0.0)
    cpu = scale.CpuConstants(enc_coeffs, (cm.llm.a * sec, cm.llm.b * sec, 0.0), hw.nvlink_Bps)
    arr = plan.arrays
    D = arr["route_send"].shape[0]
    subs = ([plan] if arr["route_send"].ndim == 3 else
            [routing.Plan({k: v[:, m] for k, v in arr.items()}) for m in range(arr["route_send"].shape[1])])
    enc, route = np.zeros(D), np.zeros(D)
    for sub in subs:
        ph = scale.plan_phases_cpu(sub, host_batch, mx.grid.esp, mx.engine.model_cfg.embed_dim, cpu)
        enc += ph.enc
        route += ph.route
    batch = mx.balanced(host_batch)  # the rows as the step places them (deterministic)
    seg = np.asarray(batch["segment_ids"])
    a, b = cm.llm.a * sec, cm.llm.b * sec
    rows = np.array([float((a * n + b * n * n).sum()) for n in
                     (np.bincount(row[row > 0]).astype(np.float64) for row in seg)])
    g = mx.grid
    shard_cost = rows.reshape(g.batch_shards, -1).sum(axis=1)
    llm = shard_cost / (g.size("pp") * g.size("tp") * g.size("cp")) / (1.0 - mx.bubble_fraction)
    phases = scale.Phases(enc, route, llm)
    return {"total": phases.step_s(), "encoder": float(enc.max()), "route": float(route.max()),
            "llm": float(llm.max())}


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import setup_devices

    opts = _options(overrides)
    setup_devices([f"parallel.cpu_devices={opts['cpu_devices']}"])
    import jax
    import numpy as np
    from flax import nnx

    from omnijax.config import OptimizerConfig
    from omnijax.models import mllm
    from omnijax.parallel import routing
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer
    from omnijax.train.optimizer import make_optimizer
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    from omnijax.perfmodel.scale import HARDWARE

    if opts["hardware"] not in HARDWARE:
        from omnijax.errors import ConfigError

        raise ConfigError(f"bench omni: hardware={opts['hardware']!r}; known: {', '.join(HARDWARE)}")
    hw = HARDWARE[opts["hardware"]]
    names = [v for v in opts["variants"].split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        from omnijax.errors import ConfigError

        raise ConfigError(f"bench omni: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    cfg = model_config(opts["model"])
    steps, w = opts["steps"], max(1, opts["window"])
    ranks = _ranks(opts)
    t0 = time.perf_counter()
    host = batches(cfg, steps, opts["batch_size"], opts["seq_len"], opts["lookahead"], ranks, w)
    pack_s = time.perf_counter() - t0
    windows = [list(range(i, min(i + w, steps))) for i in range(0, steps, w)]
    window_of = {i: k for k, win in enumerate(windows) for i in win}
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), steps)
    runs = {}
    for name in names:
        mode, long_short, interleave = VARIANTS[name]
        engine = LLMParallel(opts["llm"], cfg.llm)
        if interleave is None:
            interleave = opts["interleave"] in ("1", "true")
        mx = Multiplexer(engine, cfg, encoder_layout=opts["encoder"], mode=mode, long_short=long_short,
                         balance_rows=False, interleave=interleave, growth=opts["bucket_growth"] or routing.BUCKET_GROWTH,
                         hosts=opts["hosts"])
        model = mx.prepare(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0)))
        g, params, rest = nnx.split(model, nnx.Param, ...)
        t0 = time.perf_counter()
        # the trainer's window sizing, window after window (capacities carried over, as in training)
        caps = [mx.size_window([host[i] for i in win]) for win in windows]
        fit_s = time.perf_counter() - t0
        step = jax.jit(make_train_step(g, rest, mx.loss_fn, opt), donate_argnums=0)
        runs[name] = {"mx": mx, "step": step, "state": mx.put_state(init_state(params, opt)), "caps": caps,
                      "fit_s": fit_s, "time": 0.0, "plan_s": 0.0, "tokens": 0, "stats": [], "losses": [],
                      "compile_s": 0.0, "grew": 0, "critical": [], "cpu": 0.0}
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
            c1 = time.process_time()
            r["state"], m = r["step"](r["state"], dev)
            jax.block_until_ready(m["loss"])
            t2 = time.perf_counter()
            r["cpu"] += time.process_time() - c1
            r["plan_s"] += t1 - t0
            r["time"] += t2 - t1
            r["tokens"] += int((np.asarray(host[i]["segment_ids"]) > 0).sum())
            plan = mx.last_plan
            traffic = routing.route_traffic(plan, hosts=max(opts["hosts"], 1), bytes_per_token=4 * cfg.llm.embed_dim)
            r["stats"].append({**plan.stats, **traffic})
            r["losses"].append(float(m["loss"]))
            r["critical"].append(critical_path(mx, host[i], plan, hw))
    # Encoder share of every variant's step: the same program on the same batches with every encoder
    # segment removed (lax.cond skips empty buffers; capacities are unchanged, so no recompile), the
    # variants interleaved step by step as above. Wall and process CPU seconds of what remains (the LLM,
    # the all-to-all of empty buffers, the step's fixed work) let bench scale's calibration check its
    # encoder and LLM phases apart. `phases=0` keeps it to omnijax and omnijax_interleaved.
    shares = {}
    share_names = [n for n in names if opts["phases"] in ("1", "true") or n in ("omnijax", "omnijax_interleaved")]
    bare = {n: {"time": 0.0, "cpu": 0.0, "programs": int(runs[n]["step"]._cache_size())} for n in share_names}
    stripped = without_encoder_work(host, cfg.encoders)
    for i, b in enumerate(stripped):
        for name in share_names:
            r = runs[name]
            r["mx"].capacities = dict(r["caps"][window_of[i]])
            dev = r["mx"].put_batch(b)
            t0, c0 = time.perf_counter(), time.process_time()
            r["state"], m = r["step"](r["state"], dev)
            jax.block_until_ready(m["loss"])
            bare[name]["time"] += time.perf_counter() - t0
            bare[name]["cpu"] += time.process_time() - c0
    for name in share_names:
        r, t = runs[name], bare[name]
        shares[name] = {"encoder_share_of_step": round(1.0 - t["time"] / r["time"], 3),
                        "step_s_without_encoder_work": round(t["time"] / len(host), 3),
                        "cpu_s_without_encoder_work": round(t["cpu"] / len(host), 3),
                        "recompiled_for_text_only": int(r["step"]._cache_size()) - t["programs"]}
    host_rows = host_pair(runs["omnijax"], host, windows, window_of, opts, cfg) \
        if opts["host_pair"] in ("1", "true") and "omnijax" in runs else []
    rows = {}
    for name in names:
        r = runs[name]
        crit = {k: float(np.mean([c[k] for c in r["critical"]])) for k in r["critical"][0]}
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
                      # process CPU seconds per timed step (every thread: the 8 fake devices, XLA's pools) and
                      # the cores it kept busy on average: what the calibration's CPU aggregation is checked on
                      "cpu_s": round(r["cpu"] / steps, 3), "cpu_cores_busy": round(r["cpu"] / r["time"], 3),
                      "critical_path_s": float(f"{crit['total']:.4g}"),
                      "critical_path_parts_s": {k: float(f"{v:.4g}") for k, v in crit.items() if k != "total"},
                      "critical_path_hardware": hw.name,
                      "fit_capacities_ms": round(1e3 * r["fit_s"] / len(windows), 1),
                      "compile_s": round(r["compile_s"], 1),
                      "reshard_kb_intra_host": round(mean("intra_host_bytes") / 1024, 1),  # as 2 hosts x 4 devices
                      "reshard_kb_inter_host": round(mean("inter_host_bytes") / 1024, 1), "long_segments": mean("long_segments"),
                      "short_in_long_segments": mean("short_in_long_segments"),
                      "final_loss": round(r["losses"][-1], 4), "model": opts["model"] or "omni", "layout": f"{opts['llm']}+{opts['encoder']}",
                      "interleaved": r["mx"].interleave,
                      "devices": jax.device_count(), "steps": steps, "batch_size": opts["batch_size"],
                      "pack_s": round(pack_s, 1)}
        for enc in cfg.encoders:
            rows[name][f"padded_fraction_{enc}"] = round(
                1 - total(f"enc_rows_real_{enc}") / max(total(f"enc_rows_computed_{enc}"), 1), 4)
        rows[name]["padded_fraction_llm"] = round(
            1 - total("llm_tokens_real") / max(total("llm_tokens_computed"), 1), 4)
        enc_real = sum(total(f"enc_rows_real_{e}") for e in cfg.encoders)
        rows[name]["padded_fraction_encoders"] = round(
            1 - enc_real / max(sum(total(f"enc_rows_computed_{e}") for e in cfg.encoders), 1), 4)
        if "host_payload_share_min" in r["stats"][0]:  # each host's share of every step's payload, as `hosts` hosts
            rows[name]["host_payload_share"] = [round(min(s["host_payload_share_min"] for s in r["stats"]), 4),
                                                round(max(s["host_payload_share_max"] for s in r["stats"]), 4)]
        rows[name]["capacities"] = r["caps"]
    base = rows.get("coupled")
    for name in names:
        row = rows[name]
        row.update(shares.get(name, {}))
        if base:
            row["vs"] = "coupled"
            row["speedup"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
            row["critical_path_speedup"] = round(base["critical_path_s"] / row["critical_path_s"], 3)
        yield row
    yield from host_rows


def host_pair(r: dict, host: list[dict], windows: list[list[int]], window_of: dict, opts: dict, cfg) -> list[dict]:
    """The omnijax step with host work on (the trainer's prefetcher over a fresh loader of the same
    batches: read, pack, plan and transfer run ahead in a thread) and off (every batch planned and
    transferred beforehand), `host_repeats` times each, alternating. Steady state: each pass runs its
    first step untimed (the prefetcher's fill), then times the rest; capacities are the main run's
    per window, so both reuse its compiled programs."""
    import jax

    from omnijax.data.loader import TrainerBatches
    from omnijax.train.prefetch import Prefetcher, pinned, split_cores

    mx, step, steps = r["mx"], r["step"], len(host)
    if steps < 2:
        return []

    def put(batch: dict, i: int):
        mx.capacities = dict(r["caps"][window_of[i]])
        return mx.put_batch(batch)

    def run_steps(batches) -> float:
        t0 = None
        for dev in batches:
            r["state"], m = step(r["state"], dev)
            jax.block_until_ready(m["loss"])
            t0 = t0 or time.perf_counter()  # from the end of the first step on
        return time.perf_counter() - t0

    def prefetched(cpus: set[int] | None):
        counter = iter(range(steps))
        loader = make_loader(cfg, steps, opts["batch_size"], opts["seq_len"], opts["lookahead"], _ranks(opts),
                             max(1, opts["window"]))
        pf = Prefetcher(TrainerBatches(loader), lambda b: put(b, next(counter)), depth=2,
                        cpus=cpus)
        waits = []
        try:
            for _ in range(steps):
                item = next(pf)
                waits.append(pf.wait_s)
                yield item.batch
        finally:
            pf.close()
            wait_s.append(sum(waits[1:]))

    def prepared() -> list:
        ready = [put(b, i) for i, b in enumerate(host)]
        jax.block_until_ready(ready)
        return ready

    def pair(split: tuple[set[int], set[int]] | None) -> dict:
        t = {"prepared": 0.0, "prefetch": 0.0}
        with pinned(split[0]) if split else contextlib.nullcontext():
            for _ in range(max(1, opts["host_repeats"])):
                t["prepared"] += run_steps(prepared())
                t["prefetch"] += run_steps(prefetched(split[1] if split else None))
        return t

    def probe(split: tuple[set[int], set[int]]) -> dict:
        """What a thread on the host cores costs the prepared steps when it does no host work at all:
        pure Python (holds the GIL, touches little memory) vs streaming a 32 MB array (releases the
        GIL, loads the memory system the fake devices use), alternating with no thread."""
        import threading

        import numpy as np

        def busy(kind: str, stop: threading.Event) -> None:
            os.sched_setaffinity(0, split[1])
            a = np.ones(4 << 20) if kind == "memory" else None
            while not stop.is_set():
                if a is None:
                    sum(range(10_000))
                else:
                    a *= 1.0
        ready = prepared()
        t = {"none": 0.0, "python": 0.0, "memory": 0.0}
        with pinned(split[0]):
            for kind in ["none", "python", "memory", "memory", "python", "none"]:
                stop = threading.Event()
                thread = threading.Thread(target=busy, args=(kind, stop), daemon=True) if kind != "none" else None
                if thread:
                    thread.start()
                t[kind] += run_steps(ready)
                stop.set()
                if thread:
                    thread.join()
        return {"probe_python_thread_over_prepared": round(t["python"] / t["none"], 3),
                "probe_memory_thread_over_prepared": round(t["memory"] / t["none"], 3)}

    wait_s: list[float] = []
    split = split_cores(opts["host_cores"])
    t = pair(split)
    n = max(1, opts["host_repeats"]) * (steps - 1)
    ratio = t["prefetch"] / t["prepared"]
    common = {"steps_timed": n, "layout": f"{opts['llm']}+{opts['encoder']}", "batch_size": opts["batch_size"]}
    where = (f"step threads on cores {sorted(split[0])}, host work on {sorted(split[1])}" if split
             else "step and host work share every core")
    rows = [{"variant": "omnijax_host_prepared", "step_s": round(t["prepared"] / n, 3), "cores": where,
             "host_work": "off: batches planned and transferred before the timed steps", **common},
            {"variant": "omnijax_host_prefetch", "step_s": round(t["prefetch"] / n, 3), "cores": where,
             "host_wait_s_per_step": round(sum(wait_s) / n, 4), "prefetch_over_prepared": round(ratio, 3),
             "host_work": "on: loader + plan + transfer in the trainer's prefetch thread (depth 2)", **common}]
    if split:  # the probes, then the same pair with every core shared (host work competing for the cores)
        rows[1].update(probe(split))
        wait_s.clear()
        t = pair(None)
        rows[1]["prefetch_over_prepared_shared_cores"] = round(t["prefetch"] / t["prepared"], 3)
        rows[1]["host_wait_s_per_step_shared_cores"] = round(sum(wait_s) / n, 4)
    return rows
