"""Scale evidence: the trainer's host planner on abstract grids of 1k-16k devices, a modeled joint step
against four baselines, and a calibration of the model against `bench omni` on this machine.

Rows (one per layout x devices x mix; each layout is its recipe's, `recipe_layout`): weak scaling at
the recipes' per-device work (2 rows of 4,096 tokens per device), three workload mixes whose phases
change over the steps (`omnijax.perfmodel.scale` states the distributions; docs/scale.md cites their
sources), the plan one host makes for one step from metadata (`plan_s_per_host`, measured here), the
plan's balance and padding, and the modeled step time (H100 table) of omnijax and of coupled /
replicated / disaggregated / global-LPT on the same batches. Then `calibration_cpu8`: the same model
in CPU mode (work summed over 8 fake devices, constants timed here in interleaved rounds, fitted with
bounds) predicts `bench omni`'s omnijax/coupled ratio, with its spread over the rounds, next to the
measured one. A PNG of the speed-ups goes to runs/bench/scale.png.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np

DESCRIPTION = ("planner on 1k-16k abstract devices + modeled joint step vs coupled/replicated/disaggregated/"
               "global LPT, calibrated on CPU")


def _options(overrides: list[str]) -> dict:
    opts = {"devices": "1024,4096,16384", "layouts": "omni_8b,omni_moe,omni_moe_edp64",
            "mixes": "image,video,audio_text",
            "steps": 3, "hardware": "h100", "calibrate": "1", "measured": "", "cal_steps": 0, "cal_batch_size": 0,
            "cal_rounds": 5, "cal_enc_sizes": "64,128,256,512,1024,2048", "cal_llm_sizes": "16,32,64,128,256",
            "plot": "1", "long_factor": 0.25, "refine": "1",
            "balance_target": 1.05, "bucket_growth": 0.0,
            "host_devices": 16384, "host_tokens": 16777216, "host_layout": "omni_8b", "host_process": "0,1000",
            "host_steps": 1}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.removeprefix("bench.")
        if key not in opts:
            from omnijax.errors import ConfigError

            raise ConfigError(f"bench scale: unknown option '{key}'; known: {', '.join(opts)}")
        opts[key] = type(opts[key])(value)
    return opts


# Rows by name: a recipe (recipes/configs/<name>.yaml, its own layouts) plus config overrides. The
# `_edp64` ablation is omni_moe without an encoder SP group (every segment whole on one device).
VARIANTS = {"omni_8b": ("omni_8b", ()), "omni_moe": ("omni_moe", ()),
            "omni_moe_edp64": ("omni_moe", ("parallel.encoder=edp64",))}


def recipe_layout(name: str, gpus: int = 64, check: bool = True):
    """(scale.Layout, MMConfig) of a variant, read from its recipe: the LLM mesh (`parallel.llm`), the
    encoder view's esp (`parallel.encoder`), microbatches, rows per device (`data.batch_size` over the
    recipe's `gpus`), row length, widths, MoE layers, and the parameter counts of `dry_run`, which also
    checks the layout against the recipe (esp divides every encoder's heads, sits inside a host).
    `check=False` skips `dry_run` (tens of seconds): the LLM's count is then `llm_param_counts`' and
    the encoders' the Layout default."""
    from omnijax.config import build
    from omnijax.models.llm import is_moe_layer
    from omnijax.parallel import routing
    from omnijax.perfmodel import scale
    from omnijax.parallel.mesh import parse_layout
    from omnijax.train.dryrun import dry_run
    from omnijax.train.metrics import llm_param_counts
    from recipes.common import CONFIGS
    from omnijax.train.multimodal import MultimodalConfig as OmniConfig
    from omnijax.train.multimodal import check as check_config

    recipe, overrides = VARIANTS.get(name, (name, ()))
    cfg = build(OmniConfig, CONFIGS / f"{recipe}.yaml", list(overrides), check=check_config)
    p, llm = cfg.parallel, cfg.model.llm
    if check:
        n = dry_run(cfg, gpus)["params"]
        params = {"llm_params": float(n["llm"]), "enc_params": float(n["encoders"] + n["projectors"])}
    else:
        params = {"llm_params": float(llm_param_counts(llm)[0] + (0 if llm.tie_embeddings else llm.vocab_size
                                                                    * llm.embed_dim))}
    mesh = parse_layout(p.llm, gpus)
    _, esp = routing.parse_encoder_layout(p.encoder, gpus)
    moe_layers = sum(is_moe_layer(llm, i) for i in range(llm.num_layers))
    pp = int(mesh.sizes["pp"])
    layout = scale.Layout(name, pp=pp, tp=int(mesh.sizes["tp"]), ep=int(mesh.sizes["ep"]), cp=int(mesh.sizes["cp"]),
                          esp=esp, microbatches=(p.microbatches or 2 * pp) if pp > 1 else 1,
                          rows_per_device=cfg.data.batch_size / gpus, row_len=cfg.data.seq_len, **params,
                          embed_dim=llm.embed_dim, moe_top_k=llm.moe.top_k if moe_layers else 0, moe_layers=moe_layers)
    return layout, cfg.model


def interleaved_timings(fns: dict, sizes: dict[str, list[int]], rounds: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seconds [rounds, sizes] of every (component, span length), timed in a shuffled order per round after
    one warm-up (compile) call each: on a machine shared with other jobs a burst of load then lands on
    random points of every curve instead of on the last sizes of one component."""
    for c, fn in fns.items():
        for n in sizes[c]:
            fn(n)
    jobs = [(c, k) for c in fns for k in range(len(sizes[c]))]
    out = {c: np.zeros((rounds, len(sizes[c]))) for c in fns}
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        for j in rng.permutation(len(jobs)).tolist():
            c, k = jobs[j]
            out[c][r, k] = fns[c](sizes[c][k])
    return out


def fit_bounded(ns, ts, f_scale: float = 0.05) -> tuple[float, float, float]:
    """(a, b, const) of t ≈ const + a·n + b·n², fitted on relative residuals (every span length counts
    the same, so the longest cannot absorb the rest) with a robust loss (Cauchy beyond `f_scale`, 5%:
    a point a burst of load slowed is discounted instead of bending the curve), each term non-negative
    and at most what the size where it shows best measured: const ≤ t(n_min), a ≤ t(n_min)/n_min,
    b ≤ t(n_max)/n_max²."""
    from scipy.optimize import least_squares, lsq_linear

    ns, ts = np.asarray(ns, np.float64), np.asarray(ts, np.float64)
    X = np.stack([np.ones_like(ns), ns, ns * ns], -1) / ts[:, None]
    ub = np.array([ts[0], ts[0] / ns[0], ts[-1] / ns[-1] ** 2])
    scale = X.max(0)
    Xs, hi = X / scale, ub * scale
    x0 = lsq_linear(Xs, np.ones_like(ts), bounds=(np.zeros(3), hi)).x
    res = least_squares(lambda p: Xs @ p - 1.0, np.clip(x0, 1e-12 * hi, hi * (1 - 1e-9)), bounds=(np.zeros(3), hi),
                        loss="cauchy", f_scale=f_scale)
    c, a, b = res.x / scale
    return float(a), float(b), float(c)


def calibration(opts: dict) -> dict:
    """CPU mode of the model vs `bench omni` (omnijax and coupled, its default layout and batches).

    The CPU constants come from `cal_rounds` interleaved timings of each module's forward+backward
    (`recipes calibrate_cost`'s step functions) at span lengths that cover `bench omni`'s buffers, and of
    a memory copy; the headline fit uses the median time of every point (`fit_bounded`), and the same
    fit on each round alone gives the spread of the prediction."""
    from omnijax.config import from_dict
    from omnijax.mm_config import MMConfig
    from omnijax.perfmodel import scale
    from omnijax.parallel import routing
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer
    from recipes.bench import omni
    from recipes.calibrate_cost import encoder_step, llm_step, time_fn_from

    cfg = from_dict(MMConfig, omni.MM)
    o = omni._options([])
    # bench omni's own batches and windows (0: its defaults), so the prediction and the measurement
    # are of the same steps in the same programs
    steps, bs = opts["cal_steps"] or o["steps"], opts["cal_batch_size"] or o["batch_size"]
    rounds = max(1, opts["cal_rounds"])
    w = max(1, o["window"])
    t0 = time.perf_counter()
    host = omni.batches(cfg, steps, bs, o["seq_len"], o["lookahead"], omni._ranks(o), w)
    plans = {}
    for name in ("omnijax", "coupled"):
        mode, long_short, _ = omni.VARIANTS[name]
        mx = Multiplexer(LLMParallel(o["llm"], cfg.llm), cfg, encoder_layout=o["encoder"], mode=mode,
                         long_short=long_short, balance_rows=False, growth=routing.BUCKET_GROWTH, hosts=o["hosts"])
        hp = []
        for i in range(0, steps, w):  # the trainer's window sizing, window after window, as bench omni runs it
            mx.size_window(host[i:i + w])
            hp += [mx.host_plan(b) for b in host[i:i + w]]
        plans[name] = (mx.grid.esp, hp)
    # CPU constants timed here, interleaved: encoders over the span lengths of bench omni's buffers and
    # beyond (the quadratic term needs long spans), the LLM over its row lengths
    enc_sizes = [int(x) for x in opts["cal_enc_sizes"].split(",")]
    llm_sizes = [int(x) for x in opts["cal_llm_sizes"].split(",")]
    names = sorted(cfg.encoders)
    fns = {"llm": time_fn_from(llm_step(cfg)), **{n: time_fn_from(encoder_step(cfg, n)) for n in names}}
    sizes = {c: (llm_sizes if c == "llm" else enc_sizes) for c in fns}
    x = np.ones(1 << 24, np.float32)

    def copy_s(_n: int) -> float:
        t = time.perf_counter()
        x.copy()
        return time.perf_counter() - t

    fns["copy"], sizes["copy"] = copy_s, [x.nbytes]
    T = interleaved_timings(fns, sizes, rounds)

    def constants(t: dict[str, np.ndarray]) -> scale.CpuConstants:
        fit = {c: fit_bounded(sizes[c], t[c]) for c in fns if c != "copy"}
        return scale.CpuConstants({n: fit[n] for n in names}, fit["llm"], 2 * x.nbytes / float(t["copy"][0]))

    def predict(cpu: scale.CpuConstants) -> dict[str, float]:
        step = lambda b, plan, esp: scale.plan_phases_cpu(plan, b, esp, cfg.llm.embed_dim, cpu)  # noqa: E731
        return {name: float(np.mean([step(b, plan, esp).step_s(cpu_mode=True) for b, plan in hp]))
                for name, (esp, hp) in plans.items()}

    cpu = constants({c: np.median(t, 0) for c, t in T.items()})
    preds = predict(cpu)
    pred = preds["coupled"] / preds["omnijax"]
    per_round = [predict(constants({c: t[r] for c, t in T.items()})) for r in range(rounds)]
    spread = sorted(p["coupled"] / p["omnijax"] for p in per_round)
    measured = None
    path = Path(opts["measured"] or Path(os.environ.get("OMNIJAX_RUNS", "runs")) / "bench" / "omni.jsonl")
    if path.exists():
        rows = {r["variant"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}
        if "omnijax" in rows and "coupled" in rows:
            measured = {"speedup": rows["coupled"]["step_s"] / rows["omnijax"]["step_s"],
                        "omnijax_step_s": rows["omnijax"]["step_s"], "coupled_step_s": rows["coupled"]["step_s"],
                        "steps": rows["omnijax"].get("steps"), "batch_size": rows["omnijax"].get("batch_size")}
    ms = measured["speedup"] if measured else None
    row = {"variant": "calibration_cpu8", "predicted_speedup_vs_coupled": round(pred, 3),
           "measured_speedup_vs_coupled": round(ms, 3) if measured else None,
           "relative_error": round(pred / ms - 1, 3) if measured else None,
           "predicted_per_round": {"min": round(spread[0], 3), "median": round(float(np.median(spread)), 3),
                                   "max": round(spread[-1], 3), "rounds": rounds},
           "relative_error_per_round": ({"min": round(spread[0] / ms - 1, 3), "max": round(spread[-1] / ms - 1, 3)}
                                        if measured else None),
           "predicted_step_s": {k: round(v, 3) for k, v in preds.items()},
           "measured_step_s": {k: measured[f"{k}_step_s"] for k in ("omnijax", "coupled")} if measured else None,
           "measured_from": str(path) if measured else f"{path} missing: run `python -m recipes bench omni` first",
           "cpu_constants": {"encoders_a_b_const_s": {k: [float(f"{v:.3g}") for v in c]
                                                      for k, c in cpu.encoders.items()},
                             "llm_a_b_const_s": [float(f"{v:.3g}") for v in cpu.llm],
                             "copy_GBps": round(cpu.copy_Bps / 1e9, 2)},
           "timing_spread": {c: round(float(np.max((np.percentile(t, 75, 0) - np.percentile(t, 25, 0))
                                                   / np.median(t, 0))), 3) for c, t in T.items()},
           "sizes": {"encoders": enc_sizes, "llm": llm_sizes},
           "batches": steps, "batch_size": bs, "layout": f"{o['llm']}+{o['encoder']}",
           "coupled_meaning": "bench omni's `coupled`: encoders on pp stage 0, split over tp/cp "
                              "(parallel/baselines.py)",
           "seconds": round(time.perf_counter() - t0, 1)}
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = sorted({r["mix"] for r in rows})
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
    for ax, mix in zip(axes[0], mixes):
        for layout, style in (("omni_8b", "-"), ("omni_moe", "--"), ("omni_moe_edp64", ":")):
            sel = sorted((r for r in rows if r["mix"] == mix and r["variant"] == layout), key=lambda r: r["devices"])
            if not sel:
                continue
            for base in ("coupled", "disaggregated", "global_lpt_without_greedy"):
                ax.plot([r["devices"] for r in sel], [r[f"speedup_vs_{base}"] for r in sel], style, marker="o",
                        label=f"{layout} vs {base}")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel("modeled speed-up of omnijax")
        ax.set_title(f"mix: {mix}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The host path: what one host builds per step. Samples of the built-in world at the sizes of real
# media (images 224-896 px, clips of 4-64 frames of 224-448 px, 8-64 spoken items, 32-1,024 words).
HOST_WORLD = {"image_side": (224, 896, 1.3), "video_side": (224, 448, 1.5), "video_frames": (4, 64, 1.2),
              "text_words": (32, 1024, 1.0), "audio_items": (8, 64, 1.0)}


def host_path(opts: dict) -> Iterator[dict]:
    """The data plane's host path at `host_devices` devices and a `host_tokens` global batch, for the
    processes `host_process` of that layout (hosts of 8 devices in mesh order; none of the devices is
    needed: the plan is global metadata, the arrays are one host's).

    Per step: `plan_s` is the window plan (identical on every host, metadata only), `build_s` the
    host's `Loader.host_batch` plus the LLM rows it places (what `Multiplexer.put_batch` hands to the
    devices: a whole batch's rows taken with `hosts.take_rows`, or the host's own rows as they are),
    `peak_mb` the tracemalloc peak of that build (a second, traced run of the same step: tracing slows
    it), `array_mb` the bytes of the arrays the batch holds (numpy arrays and the integer runs of the
    step's geometry; lazy payloads, decoded later and only for local devices, excluded)."""
    import tracemalloc

    from omnijax.data.loader import Loader, LoaderConfig
    from omnijax.train.data_plane import data_bounds, step_capacities
    from omnijax.data.sources import SourceSpec, WorldSource
    from omnijax.data.world import Tail, WorldConfig
    from omnijax.parallel import hosts
    from omnijax.parallel.device_grid import MESH_AXES

    devices, tokens = int(opts["host_devices"]), int(opts["host_tokens"])
    layout, mm = recipe_layout(opts["host_layout"], check=False)
    grid = layout.grid(devices)
    row_len = layout.row_len
    shards = grid.batch_shards
    rows = tokens // row_len
    if rows % shards or rows == 0:
        from omnijax.errors import ConfigError

        raise ConfigError(f"bench scale: host_tokens={tokens} makes {rows} rows of {row_len}, which do not split over "
                          f"the {shards} batch shards of {opts['host_layout']} at {devices} devices; use a multiple "
                          f"of {shards * row_len}")
    owner = (np.arange(devices) // 8).reshape(grid.sizes)  # hosts of 8 consecutive devices in mesh order
    world = WorldConfig(**{k: Tail(*v) for k, v in HOST_WORLD.items()})
    sources = [WorldSource(cfg=world)]
    caps = step_capacities(data_bounds(sources, mm), rows, row_len, mm)
    mean_tokens = data_bounds(sources, mm).mean_tokens
    cfg = LoaderConfig(sources=[SourceSpec(name="world", kind="world")], dp=shards, microbatches=1, window=1,
                       row_len=row_len, max_rows=rows // shards, fixed_shapes=True, encoder_rows=caps, seed=0,
                       samples_per_step=int(1.2 * tokens / mean_tokens))
    llm_keys = ("tokens", "targets", "loss_mask", "segment_ids", "positions")

    def array_bytes(batch: dict) -> int:
        n = 0
        for v in batch.values():
            if isinstance(v, np.ndarray):
                n += v.nbytes
            elif all(hasattr(v, a) for a in ("starts", "lengths", "values")):  # the geometry's integer runs
                n += v.starts.nbytes + v.lengths.nbytes + v.values.nbytes
        return n

    loader = Loader(cfg, mm_cfg=mm, sources=sources, lazy_media=True, text_ranks=[0])
    plan_s = {}
    for p in [int(x) for x in str(opts["host_process"]).split(",") if x != ""]:
        own = hosts.host_rows(owner, MESH_AXES, ("dp", "fsdp", "ep"), rows, p)
        ranks = sorted({int(r) // (rows // shards) for r in own})
        loader.text_ranks = set(ranks)  # process p's loader: the plan (identical on every host) is made once

        def build(step: int) -> tuple[dict, dict]:
            batch = loader.host_batch(step)["microbatches"][0]
            if "rows" in batch and len(batch["rows"]) < rows:   # the host's own rows, as the data plane built them
                placed = {k: batch[k] for k in llm_keys}
            else:                                                # the whole step's rows: take the host's
                placed = hosts.take_rows({k: batch[k] for k in llm_keys}, own)
            return batch, placed

        for step in range(int(opts["host_steps"])):
            if step not in plan_s:
                t0 = time.perf_counter()
                loader.window_plan(step)
                plan_s[step] = time.perf_counter() - t0
            t0 = time.perf_counter()
            batch, placed = build(step)
            build_s = time.perf_counter() - t0
            held, llm_rows = array_bytes(batch), sum(v.nbytes for v in placed.values())
            real = int((np.asarray(batch["segment_ids"]) > 0).sum())
            del batch, placed
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            batch, placed = build(step)
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            del batch, placed
            yield {"bench": "host_path", "layout": opts["host_layout"], "devices": devices, "hosts": devices // 8,
                   "process": p, "step": step, "global_rows": rows, "row_len": row_len,
                   "global_tokens": rows * row_len, "host_rows": int(len(own)), "host_ranks": len(ranks),
                   "host_real_tokens": real, "capacity": caps, "plan_s": round(plan_s[step], 3),
                   "build_s": round(build_s, 3), "peak_mb": round(peak / 2 ** 20, 1),
                   "array_mb": round(held / 2 ** 20, 2), "placed_llm_mb": round(llm_rows / 2 ** 20, 3)}


def run(overrides: list[str]) -> Iterator[dict]:
    opts = _options(overrides)
    calibrate = opts["calibrate"] in ("1", "true")
    if calibrate:
        from recipes.common import setup_devices

        setup_devices(["parallel.cpu_devices=8"])
    from omnijax.errors import ConfigError
    from omnijax.parallel import routing
    from omnijax.perfmodel import scale

    if opts["hardware"] not in scale.HARDWARE:
        raise ConfigError(f"bench scale: hardware={opts['hardware']!r}; known: {', '.join(scale.HARDWARE)}")
    hw = scale.HARDWARE[opts["hardware"]]
    rows = []
    devices_list = [int(x) for x in opts["devices"].split(",") if x]
    for name in [x for x in opts["layouts"].split(",") if x and devices_list]:
        from recipes.common import CONFIGS

        if name not in VARIANTS and not (CONFIGS / f"{name}.yaml").exists():
            raise ConfigError(f"bench scale: layout {name!r}; known: {', '.join(VARIANTS)} or a recipe name")
        layout, mm = recipe_layout(name)
        costs = scale.Costs.from_mm(mm)
        model = scale.StepModel(hw, layout)
        for devices in devices_list:
            for mix in [x for x in opts["mixes"].split(",") if x]:
                if mix not in scale.MIXES:
                    raise ConfigError(f"bench scale: mix {mix!r}; known: {', '.join(scale.MIXES)}")
                t0 = time.perf_counter()
                row = scale.scaling_row(layout, devices, scale.MIXES[mix], costs, model, steps=opts["steps"],
                                        long_factor=opts["long_factor"], refine=opts["refine"] in ("1", "true"),
                                        balance_target=opts["balance_target"] or None,
                                        growth=opts["bucket_growth"] or routing.BUCKET_GROWTH)
                row["long_factor"] = opts["long_factor"]
                row["refine"] = opts["refine"] in ("1", "true")
                row["bucket_growth"] = opts["bucket_growth"] or routing.BUCKET_GROWTH
                row["bench_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                yield row
    if int(opts["host_devices"]) > 0:
        yield from host_path(opts)
    if opts["plot"] in ("1", "true") and rows:
        out = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / "bench"
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / "scale.png")
    if calibrate:
        yield calibration(opts)
