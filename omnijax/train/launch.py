"""Multi-host start-up: `jax.distributed.initialize` from flags/env, or auto-detected.

Explicit: `python -m recipes NAME --coordinator=HOST:PORT --num-processes=N --process-id=I ...`
(or the env vars OMNIJAX_COORDINATOR / OMNIJAX_NUM_PROCESSES / OMNIJAX_PROCESS_ID).
Auto: Slurm (srun), Open MPI (mpirun) and Kubernetes indexed Jobs are detected by jax itself.
"""
from __future__ import annotations

import os
import sys

from omnijax.errors import UserError

_FLAGS = {"--coordinator": "OMNIJAX_COORDINATOR", "--num-processes": "OMNIJAX_NUM_PROCESSES",
          "--process-id": "OMNIJAX_PROCESS_ID"}
_initialized = False


def pop_launch_flags(argv: list[str]) -> list[str]:
    """Move `--coordinator=...`-style flags into the environment; return the other arguments."""
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a value, e.g. {name}=...")
                value, i = argv[i + 1], i + 1
            os.environ[_FLAGS[name]] = value
        else:
            rest.append(arg)
        i += 1
    return rest


def _auto_detected() -> str | None:
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "kubernetes"
    return None


def maybe_initialize_distributed() -> int:
    """Initialise jax.distributed when this is one process of many; returns the process count."""
    global _initialized
    import jax

    if _initialized:
        return jax.process_count()
    coordinator = os.environ.get("OMNIJAX_COORDINATOR")
    if coordinator:
        try:
            num = int(os.environ["OMNIJAX_NUM_PROCESSES"])
            pid = int(os.environ["OMNIJAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise UserError("--coordinator also needs --num-processes=N and --process-id=I (integers)") from None
        if not 0 <= pid < num:
            raise UserError(f"--process-id={pid} must be in [0, {num})")
        _cpu_collectives()
        jax.distributed.initialize(coordinator, num_processes=num, process_id=pid)
    elif _auto_detected():
        _cpu_collectives()
        jax.distributed.initialize()
    _initialized = True
    if jax.process_count() > 1:  # one line per host: shows the job really formed (not N independent runs)
        print(f"omnijax: process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} of "
              f"{jax.device_count()} devices", file=sys.stderr, flush=True)
    return jax.process_count()


def _cpu_collectives() -> None:
    """Cross-process collectives on CPU need gloo (GPU and TPU have their own)."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _has_accelerator() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/accel0"))
