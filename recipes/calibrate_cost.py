"""Fit the data plane's cost model (a·n + b·n² per attention span) from timings of the real modules."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

DESCRIPTION = "fit cost-model coefficients (a*n + b*n^2 per span) from fwd+bwd timings of the LLM and encoders"


@dataclass
class CalibrateConfig:
    sizes: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    repeats: int = 5
    run_name: str = "calibrate_cost"
    components: list[str] = field(default_factory=lambda: ["llm", "vision", "audio"])


def time_fn_from(step: Callable[[int], Callable[[], Any]]) -> Callable[[int], float]:
    """Turn `step(n) -> run()` (a compiled closure for span length n) into `time_fn(n) -> seconds`.

    The first call per n compiles and warms up; later calls time one run to completion.
    """
    cache: dict[int, Callable[[], Any]] = {}

    def time_fn(n: int) -> float:
        import jax
        if n not in cache:
            cache[n] = step(n)
            jax.block_until_ready(cache[n]())
        t0 = time.perf_counter()
        jax.block_until_ready(cache[n]())
        return time.perf_counter() - t0
    return time_fn


def _grad_runner(module, make_args: Callable[[], tuple]) -> Callable[[], Any]:
    """Compiled forward + backward of sum(module(*args)) with respect to the module's parameters."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    args = make_args()

    @jax.jit
    def run(p, *a):
        def loss(p):
            out = nnx.merge(graphdef, p, rest)(*a)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(out.astype(jnp.float32) ** 2) * 1e-6
        return jax.grad(loss)(p)
    return lambda: run(params, *args)


def llm_step(mm_cfg: Any) -> Callable[[int], Callable[[], Any]]:
    """One document of n tokens through the LLM (causal attention over the whole span)."""
    import jax.numpy as jnp
    from flax import nnx
    from omnijax.models.llm import LLM
    model = LLM(mm_cfg.llm, rngs=nnx.Rngs(0))

    def step(n: int):
        return _grad_runner(model, lambda: (jnp.ones((1, n), jnp.int32), jnp.ones((1, n), jnp.int32),
                                            jnp.arange(n, dtype=jnp.int32)[None]))
    return step


def encoder_step(mm_cfg: Any, name: str) -> Callable[[int], Callable[[], Any]]:
    """One image/clip of n input rows (n rounded to the encoder's grouping) through encoder `name`."""
    import jax.numpy as jnp
    from flax import nnx
    from omnijax.data.packing import encoder_specs
    from omnijax.models.mllm import ENCODERS
    from omnijax.mm_config import encoder_configs
    enc_cfg = encoder_configs(mm_cfg)[name]
    spec = encoder_specs(mm_cfg)[name]
    module = ENCODERS[enc_cfg.kind](enc_cfg, rngs=nnx.Rngs(0))

    def step(n: int):
        n = max(spec.group, n // spec.group * spec.group)
        side = max(1, int(round(n ** 0.5)))
        pos = jnp.stack([jnp.zeros(n, jnp.int32), jnp.arange(n) // side, jnp.arange(n) % side], -1).astype(jnp.int32)
        return _grad_runner(module, lambda: (jnp.ones((n, spec.dim), jnp.float32) * 0.1, jnp.ones(n, jnp.int32), pos))
    return step


def calibrate(cfg: CalibrateConfig, mm_cfg: Any = None, steps: dict[str, Callable] | None = None) -> tuple[Any, dict]:
    """Fit every component; components whose module cannot be built keep the FLOP default (reported)."""
    from omnijax.data.cost import Coeffs, CostModel, fit_coeffs
    from omnijax.data.tokens import default_mm_config
    mm_cfg = mm_cfg if mm_cfg is not None else default_mm_config()
    flops = CostModel.from_flops(mm_cfg)
    fitted = CostModel(Coeffs(flops.llm.a, flops.llm.b), dict(flops.encoders), unit="s")
    report: dict[str, Any] = {}
    for comp in cfg.components:
        try:
            if steps and comp in steps:
                step = steps[comp]
            elif comp == "llm":
                step = llm_step(mm_cfg)
            else:
                step = encoder_step(mm_cfg, comp)
            coeffs, info = fit_coeffs(time_fn_from(step), cfg.sizes, cfg.repeats)
        except Exception as exc:  # a module not written yet or failing: say so, keep the default
            report[comp] = {"status": f"not timed ({exc.__class__.__name__}: {exc}); FLOP default kept"}
            continue
        if comp == "llm":
            fitted.llm = coeffs
        else:
            fitted.encoders[comp] = coeffs
        report[comp] = {"a_s_per_token": coeffs.a, "b_s_per_pair": coeffs.b, **info}
    return fitted, report


def main(argv: list[str]) -> int:
    from omnijax.config import build
    from omnijax.errors import ConfigError
    cfg = build(CalibrateConfig, None, argv, check=None)
    if len(set(cfg.sizes)) < 3 or min(cfg.sizes) <= 0:
        raise ConfigError(f"sizes={cfg.sizes}: need at least 3 distinct positive span lengths")
    model, report = calibrate(cfg)
    out = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / cfg.run_name
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / "cost_model.json")
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"cost_model": str(out / "cost_model.json"), **{k: {kk: v[kk] for kk in v if kk in (
        "a_s_per_token", "b_s_per_pair", "r2", "status")} for k, v in report.items()}}))
    return 0
