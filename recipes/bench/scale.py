"""Scale evidence: the trainer's host planner on abstract grids of 1k-16k devices, a modeled joint step
against four baselines, and a calibration of the model against `bench omni` on this machine.

Rows (one per layout x devices x mix): weak scaling at omni_8b's per-device work (2 rows of 4,096
tokens per device), three workload mixes whose phases change over the steps (`omnijax.parallel.scale`
states the distributions; the README text cites their sources), the plan one host makes for one step
from metadata (`plan_s_per_host`, measured here), the plan's balance and padding, and the modeled step
time (H100 table) of omnijax and of coupled / replicated / disaggregated / global-LPT on the same
batches. Then `calibration_cpu8`: the same model in CPU mode (work summed over 8 fake devices, constants
timed here) predicts `bench omni`'s omnijax/coupled ratio, next to the measured one. A PNG of the
speed-ups goes to runs/bench/scale.png.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

DESCRIPTION = ("planner on 1k-16k abstract devices + modeled joint step vs coupled/replicated/disaggregated/"
               "global LPT, calibrated on CPU")


def _options(overrides: list[str]) -> dict:
    opts = {"devices": "1024,4096,16384", "layouts": "omni_8b,omni_moe,omni_moe_edp64",
            "mixes": "image,video,audio_text",
            "steps": 3, "hardware": "h100", "calibrate": "1", "measured": "", "cal_steps": 3, "cal_batch_size": 32,
            "plot": "1", "long_factor": 0.25, "refine": "1",
            "balance_target": 1.05, "bucket_growth": 1.25}
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


def recipe_layout(name: str, gpus: int = 64):
    """(scale.Layout, MMConfig) of a variant, read from its recipe: the LLM mesh (`parallel.llm`), the
    encoder view's esp (`parallel.encoder`), microbatches, rows per device (`data.batch_size` over the
    recipe's `gpus`), row length, widths, MoE layers, and the parameter counts of `dry_run`, which also
    checks the layout against the recipe (esp divides every encoder's heads, sits inside a host)."""
    from omnijax.config import build
    from omnijax.models.llm import is_moe_layer
    from omnijax.parallel import routing, scale
    from omnijax.parallel.mesh import parse_layout
    from omnijax.train.dryrun import dry_run
    from recipes.common import CONFIGS
    from recipes.tiny_omni import OmniConfig, check

    recipe, overrides = VARIANTS.get(name, (name, ()))
    cfg = build(OmniConfig, CONFIGS / f"{recipe}.yaml", list(overrides), check=check)
    report = dry_run(cfg, gpus)
    p, llm = cfg.parallel, cfg.model.llm
    mesh = parse_layout(p.llm, gpus)
    _, esp = routing.parse_encoder_layout(p.encoder, gpus)
    moe_layers = sum(is_moe_layer(llm, i) for i in range(llm.num_layers))
    pp = int(mesh.sizes["pp"])
    layout = scale.Layout(name, pp=pp, tp=int(mesh.sizes["tp"]), ep=int(mesh.sizes["ep"]), cp=int(mesh.sizes["cp"]),
                          esp=esp, microbatches=(p.microbatches or 2 * pp) if pp > 1 else 1,
                          rows_per_device=cfg.data.batch_size / gpus, row_len=cfg.data.seq_len,
                          llm_params=float(report["params"]["llm"]),
                          enc_params=float(report["params"]["encoders"] + report["params"]["projectors"]),
                          embed_dim=llm.embed_dim, moe_top_k=llm.moe.top_k if moe_layers else 0, moe_layers=moe_layers)
    return layout, cfg.model


def calibration(opts: dict) -> dict:
    """CPU mode of the model vs `bench omni` (omnijax and coupled, its default layout and batches)."""
    import numpy as np

    from omnijax.config import from_dict
    from omnijax.mm_config import MMConfig
    from omnijax.parallel import scale
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer
    from recipes.bench import omni
    from recipes.calibrate_cost import CalibrateConfig, calibrate

    cfg = from_dict(MMConfig, omni.MM)
    o = omni._options([])
    steps, bs = opts["cal_steps"], opts["cal_batch_size"]
    t0 = time.perf_counter()
    host = omni.batches(cfg, steps, bs, o["seq_len"], o["lookahead"])
    # CPU constants timed here: each module's fwd+bwd at a few span lengths, and a memory copy
    fitted, report = calibrate(CalibrateConfig(sizes=[256, 1024, 2048, 4096], repeats=3), cfg)
    x = np.ones(1 << 24, np.float32)
    t = time.perf_counter()
    for _ in range(5):
        x.copy()
    copy_Bps = 5 * x.nbytes * 2 / (time.perf_counter() - t)
    const = lambda k: max(0.0, float(report[k].get("const_s", 0.0)))  # noqa: E731
    cpu = scale.CpuConstants({n: (c.a, c.b, const(n)) for n, c in fitted.encoders.items()},
                             (fitted.llm.a, fitted.llm.b, const("llm")), copy_Bps)
    preds = {}
    for name in ("omnijax", "coupled"):
        mode, long_short, _ = omni.VARIANTS[name]
        mx = Multiplexer(LLMParallel(o["llm"], cfg.llm), cfg, encoder_layout=o["encoder"], mode=mode,
                         long_short=long_short, balance_rows=False)
        mx.capacities = mx.fit_window(host, o["bucket_growth"])
        total = 0.0
        for b in host:
            batch, plan = mx.host_plan(b)
            total += scale.plan_phases_cpu(plan, batch, mx.grid.esp, cfg.llm.embed_dim, cpu).step_s(cpu_mode=True)
        preds[name] = total / len(host)
    measured = None
    path = Path(opts["measured"] or Path(os.environ.get("OMNIJAX_RUNS", "runs")) / "bench" / "omni.jsonl")
    if path.exists():
        rows = {r["variant"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}
        if "omnijax" in rows and "coupled" in rows:
            measured = {"speedup": rows["coupled"]["step_s"] / rows["omnijax"]["step_s"],
                        "omnijax_step_s": rows["omnijax"]["step_s"], "coupled_step_s": rows["coupled"]["step_s"],
                        "steps": rows["omnijax"].get("steps"), "batch_size": rows["omnijax"].get("batch_size")}
    pred = preds["coupled"] / preds["omnijax"]
    row = {"variant": "calibration_cpu8", "predicted_speedup_vs_coupled": round(pred, 3),
           "measured_speedup_vs_coupled": round(measured["speedup"], 3) if measured else None,
           "relative_error": round(pred / measured["speedup"] - 1, 3) if measured else None,
           "predicted_step_s": {k: round(v, 3) for k, v in preds.items()},
           "measured_step_s": {k: measured[f"{k}_step_s"] for k in ("omnijax", "coupled")} if measured else None,
           "measured_from": str(path) if measured else f"{path} missing: run `python -m recipes bench omni` first",
           "cpu_constants": {"encoders_a_b_const_s": {k: [float(f"{x:.3g}") for x in v]
                                                      for k, v in cpu.encoders.items()},
                             "llm_a_b_const_s": [float(f"{x:.3g}") for x in cpu.llm],
                             "copy_GBps": round(copy_Bps / 1e9, 2)},
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


def run(overrides: list[str]) -> Iterator[dict]:
    opts = _options(overrides)
    calibrate = opts["calibrate"] in ("1", "true")
    if calibrate:
        from recipes.common import setup_devices

        setup_devices(["parallel.cpu_devices=8"])
    from omnijax.errors import ConfigError
    from omnijax.parallel import scale

    if opts["hardware"] not in scale.HARDWARE:
        raise ConfigError(f"bench scale: hardware={opts['hardware']!r}; known: {', '.join(scale.HARDWARE)}")
    hw = scale.HARDWARE[opts["hardware"]]
    rows = []
    for name in [x for x in opts["layouts"].split(",") if x]:
        from recipes.common import CONFIGS

        if name not in VARIANTS and not (CONFIGS / f"{name}.yaml").exists():
            raise ConfigError(f"bench scale: layout {name!r}; known: {', '.join(VARIANTS)} or a recipe name")
        layout, mm = recipe_layout(name)
        costs = scale.Costs.from_mm(mm)
        model = scale.StepModel(hw, layout)
        for devices in [int(x) for x in opts["devices"].split(",") if x]:
            for mix in [x for x in opts["mixes"].split(",") if x]:
                if mix not in scale.MIXES:
                    raise ConfigError(f"bench scale: mix {mix!r}; known: {', '.join(scale.MIXES)}")
                t0 = time.perf_counter()
                row = scale.scaling_row(layout, devices, scale.MIXES[mix], costs, model, steps=opts["steps"],
                                        long_factor=opts["long_factor"], refine=opts["refine"] in ("1", "true"),
                                        balance_target=opts["balance_target"] or None,
                                        growth=opts["bucket_growth"])
                row["long_factor"] = opts["long_factor"]
                row["refine"] = opts["refine"] in ("1", "true")
                row["bucket_growth"] = opts["bucket_growth"]
                row["bench_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                yield row
    if opts["plot"] in ("1", "true") and rows:
        out = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / "bench"
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / "scale.png")
    if calibrate:
        yield calibration(opts)
