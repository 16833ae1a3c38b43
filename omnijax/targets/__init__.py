"""GPU targets to compile for without the hardware: one `GpuTargetConfigProto` text file per card.

`python -m recipes dryrun RECIPE target=h100x8` builds abstract devices of such a card with jax's deviceless
compile for CUDA (`jax.experimental.topologies.get_topology_desc`), so XLA:GPU compiles the real step here
and reports its memory, kernels and collectives. The files say where each number comes from.

Target names: ``CARD`` (one device) or ``CARDxN``; more than 8 devices are hosts of 8 (``h100x64`` is 8
hosts x 8 GPUs), as DGX/HGX machines are built.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from omnijax.errors import UserError

GPUS_PER_HOST = 8
CARDS = ("h100", "h200", "a100")
GPU_EXTRA = "pip install 'omnijax[gpu]' (jax-cuda13-plugin and jax-cuda13-pjrt at the installed jax version)"


@dataclass(frozen=True)
class Target:
    card: str
    devices: int
    hosts: int

    @property
    def name(self) -> str:
        return self.card if self.devices == 1 else f"{self.card}x{self.devices}"

    @property
    def per_host(self) -> int:
        return self.devices // self.hosts


def parse_target(text: str) -> Target:
    """``h100``, ``h100x8``, ``h200x64`` -> Target; anything else is one UserError naming the choices."""
    m = re.fullmatch(r"([a-z0-9]+?)(?:x(\d+))?", text.strip().lower())
    if not m or m.group(1) not in CARDS:
        raise UserError(f"target={text!r}: use CARD or CARDxN with CARD one of {', '.join(CARDS)} "
                        "(e.g. target=h100x8; more than 8 devices are hosts of 8)")
    n = int(m.group(2) or 1)
    if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
        raise UserError(f"target={text!r}: {n} devices; beyond one host use a multiple of {GPUS_PER_HOST} "
                        f"(hosts of {GPUS_PER_HOST} GPUs)")
    return Target(m.group(1), n, max(1, n // GPUS_PER_HOST))


def target_config(card: str) -> str:
    """The card's GpuTargetConfigProto text (package data: omnijax/targets/CARD.textproto)."""
    if card not in CARDS:
        raise UserError(f"no target config for {card!r}; known: {', '.join(CARDS)}")
    return resources.files(__package__).joinpath(f"{card}.textproto").read_text()


def device_info(card: str) -> dict[str, Any]:
    """The figures of a card's config a report needs: memory bytes, SMs, compute capability, cuDNN."""
    text = target_config(card)

    def num(field: str, block: str = text) -> float:
        m = re.search(rf"\b{field}:\s*([0-9.e+]+)", block)
        return float(m.group(1)) if m else 0.0

    cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
    dnn = re.search(r"dnn_version_info\s*\{([^}]*)\}", text)
    desc = re.search(r'device_description_str:\s*"([^"]*)"', text)
    return {"card": card, "device_kind": desc.group(1) if desc else card,
            "device_memory_bytes": int(num("device_memory_size")), "sm_count": int(num("core_count")),
            "memory_bandwidth_bytes_per_s": num("memory_bandwidth"),
            "compute_capability": f"{int(num('major', cc.group(1)))}.{int(num('minor', cc.group(1)))}" if cc else "",
            "cudnn": f"{int(num('major', dnn.group(1)))}.{int(num('minor', dnn.group(1)))}" if dnn else ""}


def devices(target: Target) -> list:
    """Abstract devices of the target (nothing can run on them; everything compiles for them).

    Needs the CUDA plugin (the `gpu` extra); the process may stay on the CPU (JAX_PLATFORMS=cpu)."""
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(target.card, "cuda", target_config=target_config(target.card),
                                            topology=f"1x{target.hosts}x{target.per_host}")
    except (ImportError, RuntimeError, ValueError) as exc:
        raise UserError(f"cannot build {target.name} devices to compile for ({str(exc).splitlines()[0][:160]}); "
                        f"{GPU_EXTRA}") from None
    return list(topo.devices)
