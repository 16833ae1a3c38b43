"""Per-recipe XLA:GPU flag presets for communication overlap (latency-hiding scheduler, combine
thresholds, pipelined collectives).

Every flag here was checked against the installed jaxlibs (0.10.2 and 0.12.0.1): it is a field of
XLA's DebugOptions (`compile(compiler_options=...)` accepts it) and a registered XLA_FLAGS flag (an
unknown one aborts the process). `verify` re-checks any set on the running jaxlib, so a version
bump that drops a flag fails a test instead of a GPU job.

XLA renamed the collective-pipelining switches in jaxlib 0.11.1: the booleans
`xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}` became the modes
`xla_gpu_pipeline_{...}` (OFF/ON/DEFAULT/EXPLICIT) and were removed in 0.12. The presets name the
intent once and `PIPELINED` spells it for the jaxlib that is installed, read from its package
metadata so that nothing initialises a backend before XLA_FLAGS is set.
"""
from __future__ import annotations

import os
from importlib import metadata
from typing import Any

from omnijax.errors import ConfigError

MiB = 1 << 20
PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"   # the enum value compile options take; XLA_FLAGS takes "on"


def _jaxlib_version() -> tuple[int, ...]:
    try:
        text = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def pipelined_flags(version: tuple[int, ...]) -> dict[str, Any]:
    """The names and 'on' values that pipeline all-gather, reduce-scatter and all-reduce across a
    loop's iterations on jaxlib `version`."""
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    if version >= (0, 11, 1):
        return {f"xla_gpu_pipeline_{op}": PIPELINE_ON for op in ops}
    return {f"xla_gpu_enable_pipelined_{op}": True for op in ops}


PIPELINED = pipelined_flags(_jaxlib_version())
_PREFIX = "xla_gpu_pipeline_" if "xla_gpu_pipeline_all_gather" in PIPELINED else "xla_gpu_enable_pipelined_"
PIPELINE_ALL_GATHER = _PREFIX + "all_gather"
PIPELINE_REDUCE_SCATTER = _PREFIX + "reduce_scatter"
PIPELINE_ALL_REDUCE = _PREFIX + "all_reduce"

_LHS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,     # schedule async collectives around compute
    "xla_gpu_enable_highest_priority_async_stream": True,  # collectives on a high-priority stream
}

PRESETS: dict[str, dict[str, Any]] = {
    # XLA's defaults: nothing set.
    "default": {},
    # Data parallel (replicated params): overlap gradient all-reduces with the backward; buckets of
    # about the tuned size, fused by XLA's combiner as well as by our explicit buckets.
    "dp_overlap": {**_LHS,
                   "xla_gpu_all_reduce_combine_threshold_bytes": 32 * MiB,
                   "xla_gpu_experimental_parallel_collective_overlap_limit": 2},
    # FSDP/ZeRO-3: prefetch next layer's all-gather and pipeline reduce-scatters across the layer loop.
    "fsdp": {**_LHS,
             PIPELINE_ALL_GATHER: PIPELINED[PIPELINE_ALL_GATHER],
             PIPELINE_REDUCE_SCATTER: PIPELINED[PIPELINE_REDUCE_SCATTER],
             "xla_gpu_all_gather_combine_threshold_bytes": 64 * MiB,
             "xla_gpu_reduce_scatter_combine_threshold_bytes": 64 * MiB,
             "xla_gpu_experimental_parallel_collective_overlap_limit": 2},
    # Stale DP: every gradient is ready at the start of the step; large buckets, issue early.
    "stale": {**_LHS,
              "xla_gpu_all_reduce_combine_threshold_bytes": 128 * MiB,
              "xla_gpu_experimental_collective_start_as_early_as_possible": True},
    # Pipeline parallel: pipelined point-to-point transfers between stages.
    "pipeline": {**_LHS,
                 "xla_gpu_enable_pipelined_p2p": True,
                 PIPELINE_ALL_REDUCE: PIPELINED[PIPELINE_ALL_REDUCE]},
}

RECIPE_PRESETS = {"tiny_lm": "dp_overlap", "tiny_omni": "fsdp", "llm_7b": "fsdp"}

TUNABLE = {  # what recipes/tune_comm.py searches over, with the allowed values
    "xla_gpu_all_reduce_combine_threshold_bytes": [1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB, 128 * MiB],
    "xla_gpu_experimental_parallel_collective_overlap_limit": [1, 2, 4],
    "xla_gpu_enable_latency_hiding_scheduler": [False, True],
}


def preset(name: str, **overrides: Any) -> dict[str, Any]:
    """Flags of preset `name` (see PRESETS), with `overrides` on top."""
    if name not in PRESETS:
        raise ConfigError(f"xla flag preset {name!r}: must be one of {', '.join(PRESETS)}")
    return {**PRESETS[name], **overrides}


def for_recipe(recipe: str, layout: str = "") -> dict[str, Any]:
    """The preset a recipe uses: by name, FSDP layouts get 'fsdp', pipelines 'pipeline'."""
    if "pp" in layout:
        return preset("pipeline")
    if "fsdp" in layout:
        return preset("fsdp")
    return preset(RECIPE_PRESETS.get(recipe, "dp_overlap"))


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and value.startswith("COLLECTIVE_PIPELINING_MODE_"):
        return value.removeprefix("COLLECTIVE_PIPELINING_MODE_").lower()   # the flag parser's spelling
    return str(value)


def to_xla_flags(flags: dict[str, Any]) -> str:
    return " ".join(f"--{k}={_text(v)}" for k, v in sorted(flags.items()))


def apply_env(flags: dict[str, Any]) -> str:
    """Append `flags` to XLA_FLAGS (must run before jax initialises its backend); returns the new value."""
    current = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0].lstrip("-") not in flags]
    os.environ["XLA_FLAGS"] = " ".join(current + to_xla_flags(flags).split()).strip()
    return os.environ["XLA_FLAGS"]


def verify(flags: dict[str, Any]) -> list[str]:
    """Names in `flags` that this jaxlib does not know (empty = all exist). Compiles a trivial program
    once per flag with `compiler_options`, which rejects unknown DebugOptions fields."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones((2,), jnp.float32))
    unknown = []
    for name, value in flags.items():
        try:
            lowered.compile(compiler_options={name: value})
        except Exception as exc:  # jaxlib raises a plain runtime error naming the option
            if "No such compile option" in str(exc):
                unknown.append(name)
            else:
                raise
    return unknown
