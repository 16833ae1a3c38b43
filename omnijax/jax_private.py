"""The private jax modules omnijax uses, each named once here with what it reads from it.

jax has no public hook for these: the coordination-service client (barriers and the peers' heartbeat), a reset
of the persistent compilation cache's first answer, cuDNN's packed attention and its capability checks, and
XLA's cost analysis of a compiled module. A jax release may move or rename any of them, so callers import them
from here (``from omnijax.jax_private import distributed``), which imports the module on first use and checks
that everything omnijax reads from it is still there; if not, one line names the module, what is missing and
the jax versions omnijax supports (pyproject.toml's range, its upper bound the newest jax tested).
`tests/test_jax_private.py` checks every entry against the installed jax.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from omnijax.errors import UserError

SUPPORTED_JAX = ">=0.10.2,<=0.12.0.1"   # keep equal to pyproject.toml's jax requirement

# name callers import -> (module[:attribute of it that is the module], attributes omnijax reads from it (dotted:
# attributes of attributes), why)
MODULES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "distributed": ("jax._src.distributed", ("global_state.client",),
                    "the coordination-service client: barriers and PeerWatch's heartbeat (train/distributed.py, "
                    "train/loop.py, train/checkpoint.py)"),
    "compilation_cache": ("jax._src.compilation_cache", ("reset_cache",),
                          "turning the persistent compilation cache off after jax first asked it (train/distributed.py)"),
    "fused_attention_stablehlo": ("jax._src.cudnn.fused_attention_stablehlo",
                                  ("dot_product_attention", "MaskType.PADDING_CAUSAL", "MaskType.PADDING",
                                   "check_compute_capability", "is_cuda_compute_capability_equal",
                                   "check_cudnn_version"),
                                  "cuDNN's packed attention and its capability checks (layers/attention.py)"),
    "xla_bridge": ("jax._src.xla_bridge", ("get_backend",), "XLA's cost analysis on the host backend (train/dryrun.py)"),
    "jaxlib_jax": ("jax._src.lib:_jax",
                   ("hlo_module_cost_analysis", "DistributedRuntimeClient.wait_at_barrier",
                    "DistributedRuntimeClient.key_value_set", "DistributedRuntimeClient.key_value_try_get",
                    "DistributedRuntimeClient.key_value_set_bytes", "DistributedRuntimeClient.blocking_key_value_get_bytes",
                    "DistributedRuntimeClient.key_value_delete"),
                   "XLA's cost analysis (train/dryrun.py) and the coordination client's calls (train/distributed.py; "
                   "the planning parts hosts exchange, train/data_plane.py)"),
}


def _missing(obj: object, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return True
        obj = getattr(obj, part)
    return False


def load(name: str) -> ModuleType:
    """The private module `name` of MODULES, checked; a UserError naming it where this jax moved it."""
    path, attrs, why = MODULES[name]
    import jax

    where, _, inner = path.partition(":")
    try:
        module = importlib.import_module(where)
        if inner:
            module = getattr(module, inner)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"jax {jax.__version__} has no {path} ({exc}); omnijax uses it for {why}. "
                        f"Install a supported jax: pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}'") from None
    gone = [a for a in attrs if _missing(module, a)]
    if gone:
        raise UserError(f"jax {jax.__version__}'s {path} lacks {', '.join(gone)}; omnijax uses it for {why}. "
                        f"Install a supported jax: pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}'")
    return module


def __getattr__(name: str) -> ModuleType:
    if name in MODULES:
        module = load(name)
        globals()[name] = module   # checked once per process
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
