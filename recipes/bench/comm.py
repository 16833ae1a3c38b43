"""Predicted DP step time at hosts × GPUs: XLA's default collectives vs tuned scheduling vs stale1."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

DESCRIPTION = "gradient comm scheduling: predicted step time (8x8 GPUs) of xla_default / tuned / stale1 vs max(compute, comm)"


@dataclass
class CommBench:
    models: list[str] = field(default_factory=lambda: ["tiny_omni", "7b"])
    trials: int = 6               # optuna trials per model (each compiles the step; 7B compiles 2 probes)
    trials_7b: int = 3
    device: str = "h100"
    net_gbps: float = 400.0
    hosts: int = 8
    gpus_per_host: int = 8
    cpu_devices: int = 8
    seed: int = 0


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import setup_devices

    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(CommBench, None, overrides, check=None)
    setup_devices([f"parallel.cpu_devices={cfg.cpu_devices}"])
    from recipes.tune_comm import MODELS, TuneConfig, predict_variant, tune

    from omnijax.parallel import comm

    bad = [m for m in cfg.models if m not in MODELS]
    if bad:
        raise ConfigError(f"models {bad}: must be among {', '.join(MODELS)}")
    target = {"device": cfg.device, "net_gbps": cfg.net_gbps, "hosts": cfg.hosts,
              "gpus_per_host": cfg.gpus_per_host, "cpu_devices": cfg.cpu_devices}
    where = f"{cfg.hosts}x{cfg.gpus_per_host} {cfg.device.upper()}, {cfg.net_gbps:g} Gb/s per GPU between hosts"
    for name in cfg.models:
        spec = MODELS[name]
        trials = cfg.trials_7b if spec.probe_layers else cfg.trials
        base = predict_variant(spec, "xla_default", None, target, check_flops=True)
        tuned = tune(TuneConfig(model=name, mode="sync", trials=trials, device=cfg.device, net_gbps=cfg.net_gbps,
                                hosts=cfg.hosts, gpus_per_host=cfg.gpus_per_host, seed=cfg.seed,
                                cpu_devices=cfg.cpu_devices), spec, log=lambda _: None, base=base)
        cc = comm.CommConfig(**tuned["comm"])
        flags = tuned["xla_flags"]
        t_tuned = {**target, "overlap": flags["xla_gpu_enable_latency_hiding_scheduler"],
                   "comm_streams": flags["xla_gpu_experimental_parallel_collective_overlap_limit"]}
        backward_s = base["compute_s"] * 2 / 3
        sync = predict_variant(spec, "sync", cc, t_tuned, backward_s=backward_s, check_flops=True)
        stale = predict_variant(spec, "stale1", cc, t_tuned, backward_s=backward_s, check_flops=True)
        how = ("compiled at the real depth" if not spec.probe_layers else
               f"compiled with {spec.probe_layers} blocks, extrapolated linearly to {spec.num_layers}")
        for variant, r, extra in (("xla_default", base, {"collectives_by": "GSPMD, one all-reduce per tensor "
                                                         "(XLA:CPU combiner off; GPU combiner not modelled)"}),
                                  ("tuned", sync, {"comm": tuned["comm"], "trials": trials,
                                                   "scored_by": tuned["scored_by"],
                                                   "latency_hiding": t_tuned["overlap"],
                                                   "comm_streams": t_tuned["comm_streams"]}),
                                  ("stale1", stale, {"comm": tuned["comm"]})):
            row = {"variant": variant, "recipe": name,
                   "predicted_step_s": round(r["predicted_step_s"], 6), "compute_s": round(r["compute_s"], 6),
                   "comm_s": round(r["comm_s"], 6), "lower_bound_s": round(r["lower_bound_s"], 6),
                   "step_over_lower_bound": round(r["predicted_step_s"] / r["lower_bound_s"], 4),
                   "collectives": r["collectives"], "flops_per_device": r["flops_per_device"],
                   "flops_vs_xla_cost_analysis": r.get("flops_vs_xla_cost_analysis"),
                   "target": where, "program": how, **extra}
            if variant != "xla_default":
                row["vs"] = "xla_default"
                row["speedup"] = round(base["predicted_step_s"] / r["predicted_step_s"], 4)
            yield row
