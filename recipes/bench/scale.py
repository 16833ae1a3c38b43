"""Scale evidence: the trainer's host planner on abstract grids of 1k-16k devices, a modeled joint step
against four baselines, and a calibration of the model against `bench omni` on this machine.

Rows (one per layout x devices x mix; each layout is its recipe's, `recipe_layout`): weak scaling at
the recipes' per-device work (2 rows of 4,096 tokens per device), three workload mixes whose phases
change over the steps (`omnijax.perfmodel.scale` states the distributions; docs/scale.md cites their
sources), the plan one host makes for one step from metadata (`plan_s_per_host`, measured here), the
plan's balance and padding, and the modeled step time (H100 table) of omnijax and of coupled /
replicated / disaggregated / global-LPT on the same batches. Then `calibration_cpu8`: the same model
in CPU mode (constants timed here in interleaved rounds, fitted with bounds) predicts `bench omni`'s
omnijax/coupled ratio, with its spread over the rounds, next to the measured one, and every other variant
bench omni measured (`variants`: its step over coupled's under three aggregations — `sum` over devices,
`shared` cores as `mesh_probe` measures this mesh, `max` the slowest device — plus the encoder part and the
rest apart, in wall and CPU seconds). Two constants are timed on the mesh itself: how an imbalanced phase
runs (`mesh_probe`: the cores the process gets, the cost of a waiting device) and what the step's buffers
cost with nothing in them (`capacity_probe`: seconds per buffer row, charged to every plan's capacities).
A PNG of the speed-ups goes to runs/bench/scale.png.
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
            "cal_rounds": 5, "cal_cores": 0.0, "cal_empty": "0", "cal_capacity": "1", "cal_real_rows": "1", "probe_units": 400, "cal_enc_sizes": "64,128,256,512,1024,2048", "cal_llm_sizes": "16,32,64,128,256",
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


def empty_encoder_step(mm_cfg, name: str):
    """`step(n) -> run()`: what a device pays for an encoder buffer of n rows that holds nothing in a step:
    the multiplexed step runs every buffer under `lax.cond(has work, encoder, zeros)` (one program for
    every device), and its forward + backward with the branch skipped still writes the buffer's outputs,
    cotangents and the residuals the taken branch would have saved (zeros of the same shapes)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from omnijax.data.packing import encoder_specs
    from omnijax.mm_config import encoder_configs
    from omnijax.models.mllm import ENCODERS

    enc_cfg, spec = encoder_configs(mm_cfg)[name], encoder_specs(mm_cfg)[name]
    module = ENCODERS[enc_cfg.kind](enc_cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def step(n: int):
        n = max(spec.group, n // spec.group * spec.group)
        side = max(1, int(round(n ** 0.5)))
        x, seg = jnp.ones((n, spec.dim), jnp.float32) * 0.1, jnp.zeros(n, jnp.int32)
        pos = jnp.stack([jnp.zeros(n, jnp.int32), jnp.arange(n) // side, jnp.arange(n) % side], -1).astype(jnp.int32)

        @jax.jit
        def run(p, x, seg, pos):
            def loss(p):
                m = nnx.merge(graphdef, p, rest)
                shape = jax.eval_shape(lambda: m(x, seg, pos)).shape
                out = jax.lax.cond(jnp.any(seg > 0), lambda: m(x, seg, pos), lambda: jnp.zeros(shape, jnp.float32))
                return jnp.sum(out ** 2) * 1e-6
            return jax.grad(loss)(p)
        return lambda: run(params, x, seg, pos)
    return step


def capacity_rows(plan) -> int:
    """Encoder buffer rows (every encoder, short and long) plus route rows of one device in a plan."""
    caps = dict(plan.capacities)
    return int(sum(v for k, v in caps.items()))


def capacity_probe(mx, cfg, host: list[dict], rounds: int) -> dict:
    """What the multiplexed step costs per buffer row when no buffer holds anything: bench omni's omnijax
    program on its batches with every encoder segment removed (every encoder's `lax.cond` skipped), at the
    window's capacities and at twice them (each buffer and the route, rounded up to the reduction), timed
    interleaved over `rounds`; the slope (median seconds over the rows added per device) is a constant
    of this mesh's program, timed without encoder work, that the calibration then checks on the full steps."""
    import jax
    from flax import nnx

    from omnijax.config import OptimizerConfig
    from omnijax.models import mllm
    from omnijax.train.optimizer import make_optimizer
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    from recipes.bench.omni import without_encoder_work

    stripped = without_encoder_work(host, cfg.encoders)
    base = dict(mx.size_window(host[:max(1, len(host) // 2)]))
    red = lambda k: mx.reductions.get(k.rsplit("_", 1)[0], 1)  # noqa: E731
    doubled = {k: (-(-2 * v // red(k)) * red(k) if v else 0) for k, v in base.items()}
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), len(host))
    model = mx.prepare(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0)))
    g, params, rest = nnx.split(model, nnx.Param, ...)
    step = jax.jit(make_train_step(g, rest, mx.loss_fn, opt))
    state = mx.put_state(init_state(params, opt))
    t = {"base": [], "doubled": []}
    batches = {}
    for key, caps in (("base", base), ("doubled", doubled)):
        mx.capacities = dict(caps)
        batches[key] = [mx.put_batch(b) for b in stripped]
        jax.block_until_ready(step(state, batches[key][0])[1]["loss"])
    for _ in range(max(1, rounds)):
        for i in range(len(stripped)):
            for key in ("base", "doubled"):
                t0 = time.perf_counter()
                jax.block_until_ready(step(state, batches[key][i])[1]["loss"])
                t[key].append(time.perf_counter() - t0)
    rows = sum(doubled.values()) - sum(base.values())
    med = {k: float(np.median(v)) for k, v in t.items()}
    return {"capacities": base, "doubled": doubled, "step_s_without_encoder_work": {k: round(v, 4) for k, v in med.items()},
            "seconds_per_capacity_row": float(f"{max(0.0, med['doubled'] - med['base']) / max(rows, 1):.3g}")}


# The probe's work patterns: seconds of single-core work per device (in units of `probe_units` loop
# iterations), all with the same total; `one` fits the wait cost, the others check it.
PROBE_PATTERNS = {"all8": [1.0] * 8, "half4": [2.0] * 4 + [0.0] * 4, "two": [4.0] * 2 + [0.0] * 6,
                  "one": [8.0] + [0.0] * 7, "ramp": [2.0 * k / 9 for k in range(1, 9)]}


def mesh_probe(units: int, rounds: int, cores: float, fit_on: str = "one") -> dict:
    """How XLA:CPU runs an imbalanced phase on this mesh: one program over the 8 fake devices in which
    device d runs `pattern[d] · units` iterations of a small matmul loop (the scale of bench omni's
    kernels: [128, 64] @ [64, 64]), then all of them meet at a psum (the phase's collective). Every
    pattern has the same total work; only its spread differs. Wall and process CPU seconds per call
    are medians of `rounds` interleaved rounds.

    `all8` (every device busy) gives the single-core seconds of one unit: wall × cores / 8. The wait
    cost of an idle device (`scale.shared_cores_s`' `wait_cost`) is solved from the `fit_on` pattern's
    wall time, then `shared_cores_s` predicts every other pattern: their errors check the law, not the fit.
    The CPU column says the same directly: a waiting device that spins burns process CPU time."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from scipy.optimize import brentq

    from omnijax.perfmodel import scale

    devs = jax.devices()[:8]
    mesh = Mesh(np.array(devs), ("d",))

    def body(n, x, w):
        y = jax.lax.fori_loop(0, n[0], lambda _, y: jnp.tanh(y @ w[0]) + y * 0.5, x[0])
        return jax.lax.psum(y.sum(), "d")[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d"), P("d")), out_specs=P("d")))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))  # noqa: E731
    x = put(np.ones((8, 128, 64), np.float32) * 0.01)
    w = put(np.ones((8, 64, 64), np.float32) * 0.01)
    counts = {k: put(np.round(np.asarray(v) * units).astype(np.int32)) for k, v in PROBE_PATTERNS.items()}
    for n in counts.values():
        jax.block_until_ready(f(n, x, w))
    wall = {k: [] for k in counts}
    cpu = {k: [] for k in counts}
    rng = np.random.default_rng(1)
    for _ in range(rounds):
        for k in rng.permutation(sorted(counts)).tolist():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(counts[k], x, w))
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = {k: float(np.median(v)) for k, v in wall.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    unit = med["all8"] * cores / (8 * units)              # single-core seconds of one iteration
    work = {k: np.asarray(v) * units * unit for k, v in PROBE_PATTERNS.items()}
    lo, hi = scale.shared_cores_s(work[fit_on], cores, 0.0), scale.shared_cores_s(work[fit_on], cores, 1.0)
    target = min(max(med[fit_on], lo), hi)
    wait_cost = 0.0 if target <= lo else 1.0 if target >= hi else float(
        brentq(lambda c: scale.shared_cores_s(work[fit_on], cores, c) - target, 0.0, 1.0))
    rows = {}
    for k in PROBE_PATTERNS:
        pred = scale.shared_cores_s(work[k], cores, wait_cost)
        rows[k] = {"wall_s": round(med[k], 4), "cpu_s": round(med_cpu[k], 4),
                   "cores_busy": round(med_cpu[k] / med[k], 2),
                   "wall_over_all8": round(med[k] / med["all8"], 3),
                   "predicted_over_all8": round(pred / med["all8"], 3),
                   "if_waiting_is_free": round(scale.shared_cores_s(work[k], cores, 0.0) / med["all8"], 3),
                   "if_waiting_spins": round(scale.shared_cores_s(work[k], cores, 1.0) / med["all8"], 3),
                   "relative_error": None if k in ("all8", fit_on) else round(pred / med[k] - 1, 3)}
    return {"wait_cost": round(wait_cost, 3), "fitted_on": fit_on, "cores": cores, "units": units,
            "rounds": rounds, "unit_s": float(f"{unit:.3g}"), "patterns": rows}


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
    for name in [v for v in omni.VARIANTS if not omni.VARIANTS[v][2]]:  # every variant with encoders before the LLM
        mode, long_short, _ = omni.VARIANTS[name]
        mx = Multiplexer(LLMParallel(o["llm"], cfg.llm), cfg, encoder_layout=o["encoder"], mode=mode,
                         long_short=long_short, balance_rows=False, growth=routing.BUCKET_GROWTH, hosts=o["hosts"])
        hp = []
        for i in range(0, steps, w):  # the trainer's window sizing, window after window, as bench omni runs it
            mx.size_window(host[i:i + w])
            hp += [mx.host_plan(b) for b in host[i:i + w]]
        plans[name] = (mx.grid.esp, mx.grid.batch_shards, hp)
        if name == "omnijax":
            base_mx = mx
    # CPU constants timed here, interleaved: encoders over the span lengths of bench omni's buffers and
    # beyond (the quadratic term needs long spans), the LLM over its row lengths
    enc_sizes = [int(x) for x in opts["cal_enc_sizes"].split(",")]
    llm_sizes = [int(x) for x in opts["cal_llm_sizes"].split(",")]
    names = sorted(cfg.encoders)
    fns = {"llm": time_fn_from(llm_step(cfg)), **{n: time_fn_from(encoder_step(cfg, n)) for n in names},
           **{f"{n}_empty": time_fn_from(empty_encoder_step(cfg, n)) for n in names}}
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
        return scale.CpuConstants({n: fit[n] for n in names}, fit["llm"], 2 * x.nbytes / float(t["copy"][0]),
                                  {n: fit[f"{n}_empty"] for n in names} if opts["cal_empty"] in ("1", "true") else {})

    # The cores this process gets (the probe's balanced pattern: process CPU over wall; on a machine other
    # jobs share it is below the core count) and what a waiting device costs, both measured on the mesh
    nominal = float(opts["cal_cores"] or len(os.sched_getaffinity(0)))
    probe = mesh_probe(opts["probe_units"], rounds, nominal) if opts["probe_units"] > 0 else None
    if probe and not opts["cal_cores"]:
        nominal = min(nominal, probe["patterns"]["all8"]["cores_busy"])
        probe = mesh_probe(opts["probe_units"], rounds, nominal)   # the wait cost solved at those cores
    cores = nominal
    wait_cost = probe["wait_cost"] if probe else 0.0

    cap_probe = capacity_probe(base_mx, cfg, host, rounds) if opts["cal_capacity"] in ("1", "true") else None
    per_row = cap_probe["seconds_per_capacity_row"] if cap_probe else 0.0

    def phases(cpu: scale.CpuConstants) -> dict[str, list[scale.Phases]]:
        out = {}
        for name, (esp, shards, hp) in plans.items():
            out[name] = []
            for b, plan in hp:
                ph = scale.plan_phases_cpu(plan, b, esp, cfg.llm.embed_dim, cpu, shards=shards,
                                           real_rows=opts["cal_real_rows"] in ("1", "true"))
                ph.fixed += per_row * capacity_rows(plan)   # what the program's buffers cost with nothing in them
                out[name].append(ph)
        return out

    def predict(cpu: scale.CpuConstants, agg: str = "sum") -> dict[str, float]:
        kw = {"sum": {}, "shared": {"cores": cores, "wait_cost": wait_cost}, "max": {"cores": cores, "wait_cost": 1.0}}
        return {name: float(np.mean([ph.step_s(cpu_mode=True, **kw[agg]) for ph in phs]))
                for name, phs in phases(cpu).items()}

    cpu = constants({c: np.median(t, 0) for c, t in T.items()})
    preds = predict(cpu)
    pred = preds["coupled"] / preds["omnijax"]
    per_round = [predict(constants({c: t[r] for c, t in T.items()})) for r in range(rounds)]
    spread = sorted(p["coupled"] / p["omnijax"] for p in per_round)
    measured = None
    path = Path(opts["measured"] or Path(os.environ.get("OMNIJAX_RUNS", "runs")) / "bench" / "omni.jsonl")
    rows = {}
    if path.exists():
        rows = {r["variant"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}
        if "omnijax" in rows and "coupled" in rows:
            measured = {"speedup": rows["coupled"]["step_s"] / rows["omnijax"]["step_s"],
                        "omnijax_step_s": rows["omnijax"]["step_s"], "coupled_step_s": rows["coupled"]["step_s"],
                        "steps": rows["omnijax"].get("steps"), "batch_size": rows["omnijax"].get("batch_size")}
    ms = measured["speedup"] if measured else None
    # Every variant bench omni measured, under each aggregation: its step over coupled's (coupled / variant,
    # bench omni's speed-up) predicted and measured, and the encoder part (step minus the step without
    # encoder work, where bench omni timed that) against the model's encoder phase.
    by_agg = {agg: predict(cpu, agg) for agg in ("sum", "shared", "max")}
    phs = phases(cpu)
    enc_pred = {n: float(np.mean([scale.shared_cores_s(p.enc, cores, wait_cost) for p in ph])) for n, ph in phs.items()}
    rest_pred = {n: float(np.mean([scale.shared_cores_s(p.route, cores, wait_cost)
                                   + scale.shared_cores_s(p.llm, cores, wait_cost) + p.fixed for p in ph]))
                 for n, ph in phs.items()}
    variants = {}
    for name in plans:
        v = {"predicted_step_s": {agg: round(p[name], 4) for agg, p in by_agg.items()},
             "predicted_encoder_s": round(enc_pred[name], 4), "predicted_without_encoder_s": round(rest_pred[name], 4)}
        if name in rows and "coupled" in rows:
            m = rows["coupled"]["step_s"] / rows[name]["step_s"]
            v["measured_speedup_vs_coupled"] = round(m, 3)
            for agg, p in by_agg.items():
                v[f"predicted_speedup_{agg}"] = round(p["coupled"] / p[name], 3)
                v[f"error_{agg}"] = round(p["coupled"] / p[name] / m - 1, 3)
            v["measured_step_s"] = rows[name]["step_s"]
            if "step_s_without_encoder_work" in rows[name]:
                v["measured_encoder_s"] = round(rows[name]["step_s"] - rows[name]["step_s_without_encoder_work"], 4)
                v["measured_without_encoder_s"] = rows[name]["step_s_without_encoder_work"]
            for key in ("cpu_s", "cpu_cores_busy", "cpu_s_without_encoder_work", "enc_cost_max_over_mean"):
                if key in rows[name]:
                    v[f"measured_{key}"] = rows[name][key]
            if rows[name].get("cpu_s") and rows["coupled"].get("cpu_s"):
                # the work alone: process CPU seconds, which another job's load does not stretch
                mc = rows["coupled"]["cpu_s"] / rows[name]["cpu_s"]
                v["measured_cpu_speedup_vs_coupled"] = round(mc, 3)
                v["error_sum_vs_cpu"] = round(by_agg["sum"]["coupled"] / by_agg["sum"][name] / mc - 1, 3)
                if "cpu_s_without_encoder_work" in rows[name]:
                    v["measured_encoder_cpu_s"] = round(rows[name]["cpu_s"] - rows[name]["cpu_s_without_encoder_work"], 4)
                v["predicted_encoder_sum_s"] = round(float(np.mean([p.enc.sum() for p in phs[name]])), 4)
                v["predicted_without_encoder_sum_s"] = round(float(np.mean([p.route.sum() + p.llm.sum() + p.fixed
                                                                             for p in phs[name]])), 4)
        variants[name] = v
    row = {"variant": "calibration_cpu8", "predicted_speedup_vs_coupled": round(pred, 3),
           "measured_speedup_vs_coupled": round(ms, 3) if measured else None,
           "relative_error": round(pred / ms - 1, 3) if measured else None,
           "predicted_per_round": {"min": round(spread[0], 3), "median": round(float(np.median(spread)), 3),
                                   "max": round(spread[-1], 3), "rounds": rounds},
           "relative_error_per_round": ({"min": round(spread[0] / ms - 1, 3), "max": round(spread[-1] / ms - 1, 3)}
                                        if measured else None),
           "predicted_step_s": {k: round(v, 3) for k, v in preds.items()},
           "variants": variants, "mesh_probe": probe, "cores": cores, "wait_cost": wait_cost,
           "capacity_probe": cap_probe,
           "measured_step_s": {k: measured[f"{k}_step_s"] for k in ("omnijax", "coupled")} if measured else None,
           "measured_from": str(path) if measured else f"{path} missing: run `python -m recipes bench omni` first",
           "cpu_constants": {"encoders_a_b_const_s": {k: [float(f"{v:.3g}") for v in c]
                                                      for k, c in cpu.encoders.items()},
                             "llm_a_b_const_s": [float(f"{v:.3g}") for v in cpu.llm],
                             "empty_buffer_a_b_const_s": {k: [float(f"{v:.3g}") for v in c]
                                                          for k, c in cpu.empty.items()},
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
