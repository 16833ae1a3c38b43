"""Auto-tune gradient communication with Bayesian optimisation (optuna TPE).

Searches bucket size, partition size, in-flight bound and XLA:GPU flags for one model's
data-parallel step (sync or stale1). Each trial compiles the step with explicit, scheduled
collectives. Score: the measured step time when a GPU is present, otherwise the step-time model
(`omnijax.perfmodel.step_model`) replaying the compiled program's schedule on the target
(device, network, hosts × GPUs). Writes `runs/<run_name>/comm_tuned.yaml`, which a recipe can
include (`comm:` settings for `omnijax.parallel.comm.CommConfig`, `xla_flags:` for
`omnijax.parallel.xla_flags.apply_env`).

Programs are built abstractly (ShapeDtypeStructs; nothing is allocated), so 7B-wide models compile
on the CPU. Large models are compiled with `probe_layers` (e.g. 2 and 4 blocks) and every time is
extrapolated linearly in the number of layers (a dense decoder's blocks are identical).
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnijax.config import LLMConfig

DESCRIPTION = "auto-tune gradient bucketing/partitioning/in-flight bound + XLA flags (optuna); writes comm_tuned.yaml"

MiB = 1 << 20


@dataclass
class ModelSpec:
    """An LLM to tune for, plus the step shape it is compiled with."""
    llm: LLMConfig = field(default_factory=lambda: LLMConfig(vocab_size=512, embed_dim=96, num_layers=2, num_heads=4,
                                                             num_kv_heads=2, head_dim=24, mlp_dim=256, max_seq_len=128))
    batch_per_device: int = 1
    compute_dtype: str = "float32"
    probe_layers: list[int] = field(default_factory=list)   # [] = compile the real depth

    @property
    def num_layers(self) -> int:
        return self.llm.num_layers

    @property
    def seq_len(self) -> int:
        return self.llm.max_seq_len


MODELS = {
    # the LLM backbone of recipes/configs/tiny_omni.yaml (encoders not included)
    "tiny_omni": ModelSpec(),
    # Llama-2-7B shapes; compiled with 2 and 4 blocks and extrapolated to 32
    "7b": ModelSpec(LLMConfig(vocab_size=32000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                              head_dim=128, mlp_dim=11008, max_seq_len=4096, tie_embeddings=False),
                    batch_per_device=1, compute_dtype="bfloat16", probe_layers=[2, 4]),
}


@dataclass
class TuneConfig:
    model: str = "tiny_omni"
    mode: str = "sync"            # sync | stale1
    trials: int = 10
    device: str = "h100"          # h100 | h200 (the step-time model's target)
    net_gbps: float = 400.0       # per GPU between hosts
    hosts: int = 8
    gpus_per_host: int = 8
    seed: int = 0
    cpu_devices: int = 8
    run_name: str = "tune_comm"


# ------------------------------------------------------------------------------ building steps
def _llm_config(spec: ModelSpec, layers: int) -> LLMConfig:
    return dataclasses.replace(spec.llm, num_layers=layers)


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def build_program(spec: ModelSpec, layers: int, variant: str, comm_cfg: Any | None, link: Any | None = None,
                  backward_s: float = 0.0):
    """Lower (abstractly) one DP step of the LLM on all devices as mesh axis 'dp'.

    variant: "xla_default" (the trainer's GSPMD step, collectives left to XLA), "sync" (explicit
    collectives scheduled by `comm_cfg`), "stale1" (stale step, previous gradients reduced by the
    plan while this step computes). Returns (lowered, plan or None).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from omnijax.models.llm import LLM
    from omnijax.parallel import comm
    from omnijax.models.losses import lm_loss
    from omnijax.train.staleness import StalenessSpec, init_extra, make_stale_step, stale_state_shardings
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    mesh = Mesh(np.array(jax.devices()), ("dp",))
    n = mesh.shape["dp"]
    model = nnx.eval_shape(lambda: LLM(_llm_config(spec, layers), rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adamw(1e-4)
    dtype = jnp.dtype(spec.compute_dtype)
    B, L = spec.batch_per_device * n, spec.seq_len
    rep, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=row)
             for k in ("tokens", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct((B, L), jnp.float32, sharding=row)
    if variant == "xla_default":
        state = jax.eval_shape(lambda p: init_state(p, opt), params)
        state = _abstract(state, jax.tree.map(lambda _: rep, state))
        step = make_train_step(graphdef, rest, lm_loss, opt, compute_dtype=dtype)
        return jax.jit(step, donate_argnums=0).lower(state, batch), None
    stale = variant == "stale1"
    sspec = StalenessSpec("stale1" if stale else "sync", warmup_steps=0)
    state = jax.eval_shape(lambda p: init_state(p, opt, init_extra(p, sspec, n)), params)
    pspecs = jax.tree.map(lambda _: P(), params)
    ospecs = jax.tree.map(lambda _: P(), state.opt_state)
    state = _abstract(state, stale_state_shardings(state, mesh, pspecs, ospecs))
    plan = None
    reduce_fn = None
    if comm_cfg is not None:
        order = comm.forward_use_order(
            lambda p: lm_loss(nnx.merge(graphdef, p, rest), {k: jnp.zeros((1, 8), v.dtype) for k, v in batch.items()})[0],
            params)
        tensors = comm.describe_grads(params, fwd_order=order, backward_s=backward_s, all_ready=stale)
        plan = comm.plan_comm(tensors, link or comm.LinkModel(n=n), comm_cfg)
        reduce_fn = comm.make_reduce_fn(plan, "dp")
    step = make_stale_step(graphdef, rest, lm_loss, opt, mesh, pspecs, ospecs, sspec, compute_dtype=dtype,
                           reduce_fn=reduce_fn)
    return jax.jit(step, donate_argnums=0).lower(state, batch), plan


def predict_variant(spec: ModelSpec, variant: str, comm_cfg: Any | None, target: dict, *,
                    backward_s: float = 0.0, check_flops: bool = False) -> dict:
    """Step-time prediction for one variant, extrapolated over layers when `spec.probe_layers` is set."""
    from omnijax.parallel import comm
    from omnijax.perfmodel import step_model
    from omnijax.parallel.comm import CPU_INSPECT_OPTIONS

    net = step_model.network(target["net_gbps"], target["hosts"], target["gpus_per_host"])
    device = step_model.DEVICES[target["device"]]
    link = comm.LinkModel(n=net.world, bandwidth_Bps=net.net_Bps, latency_s=net.net_latency_s)
    layers = spec.probe_layers or [spec.num_layers]
    rows, flops_checks, compile_s = [], [], 0.0
    for nl in layers:
        t0 = time.perf_counter()
        lowered, plan = build_program(spec, nl, variant, comm_cfg, link, backward_s * nl / spec.num_layers)
        # keep XLA:CPU from merging collectives: what is left is what the program (or our plan) asked for
        compiled = lowered.compile(compiler_options=CPU_INSPECT_OPTIONS)
        compile_s += time.perf_counter() - t0
        pred = step_model.predict(compiled.as_text(), device, net, program_devices=target["cpu_devices"],
                                  comm_streams=target.get("comm_streams", 1), overlap=target.get("overlap", True))
        rows.append(pred)
        if check_flops:
            flops_checks.append(step_model.check_flops(compiled)["ratio"])
    def extrap(attr):
        vals = [getattr(r, attr) for r in rows]
        if len(vals) == 1:
            return vals[0]
        (l0, l1), (v0, v1) = layers[:2], vals[:2]
        return v0 + (v1 - v0) * (spec.num_layers - l0) / (l1 - l0)
    step_s, compute_s, comm_s, flops = (extrap(a) for a in ("step_s", "compute_s", "comm_s", "flops"))
    out = {"predicted_step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
           "lower_bound_s": max(compute_s, comm_s), "flops_per_device": flops,
           "collectives": len(rows[-1].collectives), "compile_s": round(compile_s, 1),
           "compiled_layers": layers}
    if check_flops:
        out["flops_vs_xla_cost_analysis"] = [round(r, 4) for r in flops_checks]
    return out


def measure_gpu(spec: ModelSpec, variant: str, comm_cfg: Any, flags: dict, steps: int = 10) -> float:
    """Measured seconds per step on the local accelerator (only when one is present)."""
    import jax
    import numpy as np

    lowered, _ = build_program(spec, spec.num_layers, variant, comm_cfg)
    compiled = lowered.compile(compiler_options=flags)
    args = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), lowered.args_info)
    state, batch = args[0][0], args[0][1]
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = compiled(state, batch)
    jax.block_until_ready(m)
    return (time.perf_counter() - t0) / steps


def tune(cfg: TuneConfig, spec: ModelSpec, log=print, base: dict | None = None) -> dict:
    """Run the optuna study; returns the best settings and the trial history. `base`: an already
    computed xla_default prediction (it sets the backward time the plans assume)."""
    import jax
    import optuna

    from omnijax.parallel import comm, xla_flags

    on_gpu = jax.default_backend() == "gpu"
    target = {"device": cfg.device, "net_gbps": cfg.net_gbps, "hosts": cfg.hosts, "gpus_per_host": cfg.gpus_per_host,
              "cpu_devices": cfg.cpu_devices}
    base = base or predict_variant(spec, "xla_default", None, target)
    backward_s = base["compute_s"] * 2 / 3
    history = []

    def objective(trial: optuna.Trial) -> float:
        cc = comm.CommConfig(
            bucket_bytes=int(trial.suggest_float("bucket_bytes", 64 << 10, 512 * MiB, log=True)),
            partition_bytes=int(trial.suggest_float("partition_bytes", 256 << 10, 1024 * MiB, log=True)),
            in_flight=trial.suggest_categorical("in_flight", [1, 2, 4, 0]))
        flags = {k: trial.suggest_categorical(k, v) for k, v in xla_flags.TUNABLE.items()}
        if on_gpu:
            score = measure_gpu(spec, cfg.mode, cc, flags)
            how = "measured_gpu"
        else:
            t = {**target, "overlap": flags["xla_gpu_enable_latency_hiding_scheduler"],
                 "comm_streams": flags["xla_gpu_experimental_parallel_collective_overlap_limit"]}
            score = predict_variant(spec, cfg.mode, cc, t, backward_s=backward_s)["predicted_step_s"]
            how = "step_model"
        history.append({"trial": trial.number, "score_s": score, "scored_by": how, **trial.params})
        log(json.dumps(history[-1]))
        return score

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    # start from the presets' values so the search never does worse than the hand-written one
    study.enqueue_trial({"bucket_bytes": 4.0 * MiB, "partition_bytes": 64.0 * MiB, "in_flight": 2,
                         **{k: xla_flags.PRESETS["dp_overlap"].get(k, v[0]) for k, v in xla_flags.TUNABLE.items()}})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=cfg.trials)
    best = study.best_params
    return {"comm": {"bucket_bytes": int(best["bucket_bytes"]), "partition_bytes": int(best["partition_bytes"]),
                     "in_flight": int(best["in_flight"])},
            "xla_flags": {**xla_flags.PRESETS["dp_overlap"], **{k: best[k] for k in xla_flags.TUNABLE}},
            "best_step_s": study.best_value, "scored_by": history[-1]["scored_by"] if history else "",
            "xla_default_step_s": base["predicted_step_s"], "history": history, "target": target,
            "model": cfg.model, "mode": cfg.mode}


def main(argv: list[str]) -> int:
    from recipes.common import setup_devices

    from omnijax.config import build
    from omnijax.errors import ConfigError
    from omnijax.utils import runs_root

    cfg = build(TuneConfig, None, argv, check=None)
    if cfg.model not in MODELS or cfg.mode not in ("sync", "stale1") or cfg.trials < 1:
        raise ConfigError(f"model must be one of {', '.join(MODELS)}, mode sync|stale1, trials >= 1 (got {cfg})")
    setup_devices([f"parallel.cpu_devices={cfg.cpu_devices}"])
    import yaml

    result = tune(cfg, MODELS[cfg.model])
    out = Path(runs_root()) / cfg.run_name
    out.mkdir(parents=True, exist_ok=True)
    chosen = {k: result[k] for k in ("comm", "xla_flags")}
    chosen["tuned"] = {k: result[k] for k in ("best_step_s", "xla_default_step_s", "scored_by", "model", "mode", "target")}
    (out / "comm_tuned.yaml").write_text(yaml.safe_dump(chosen, sort_keys=False))
    (out / "trials.jsonl").write_text("".join(json.dumps(h) + "\n" for h in result["history"]))
    print(f"best {result['best_step_s']:.6f}s/step ({result['scored_by']}) vs xla_default "
          f"{result['xla_default_step_s']:.6f}s -> {out / 'comm_tuned.yaml'}")
    return 0
