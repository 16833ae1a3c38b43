"""LLM meshes from layout strings such as ``pp2xdp2xtp2``.

A layout names the size of each parallelism axis (``pp, dp, fsdp, cp, tp, ep``); axes not named are 1.
The mesh orders axes from slowest to fastest interconnect need (``pp`` outermost, ``tp`` innermost),
so on many hosts the host boundary falls on the outer axes (hybrid placement: DCN outside, ICI inside).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from omnijax.errors import ConfigError

# Slowest (crosses hosts first) to fastest (stays inside a host longest).
MESH_AXES: tuple[str, ...] = ("pp", "dp", "fsdp", "ep", "cp", "tp")
_TOKEN = re.compile(r"^([a-z]+?)(\d+)$")


@dataclass(frozen=True)
class Layout:
    """Sizes of the six LLM mesh axes; ``str(layout)`` gives the canonical layout string."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def batch_shards(self) -> int:
        """Ways the batch dimension is split: dp, fsdp and ep all hold different sequences."""
        return self.dp * self.fsdp * self.ep

    def __str__(self) -> str:
        named = [f"{a}{n}" for a, n in self.sizes.items() if n > 1]
        return "x".join(named) or "dp1"


def parse_layout(text: str, num_devices: int | None = None) -> Layout:
    """Parse ``"pp2xdp2xtp2"``; ``""`` puts every device on ``dp`` (needs ``num_devices``)."""
    text = text.strip().lower()
    if not text:
        if num_devices is None:
            raise ConfigError("parallel.llm='': an empty layout needs the device count to fill dp")
        return Layout(dp=num_devices)
    sizes: dict[str, int] = {}
    for token in text.split("x"):
        m = _TOKEN.match(token)
        if not m:
            raise ConfigError(f"parallel.llm={text!r}: cannot read '{token}'; write axes like 'pp2xdp2xtp2' "
                              f"(axes {', '.join(MESH_AXES)}, 'x' separates)")
        axis, size = m.group(1), int(m.group(2))
        if axis not in MESH_AXES:
            raise ConfigError(f"parallel.llm={text!r}: unknown axis '{axis}'; known axes: {', '.join(MESH_AXES)}")
        if axis in sizes:
            raise ConfigError(f"parallel.llm={text!r}: axis '{axis}' named twice")
        if size < 1:
            raise ConfigError(f"parallel.llm={text!r}: axis '{axis}' has size {size}; sizes must be >= 1")
        sizes[axis] = size
    return Layout(**sizes)


def check_layout(layout: Layout, num_devices: int, model: Any | None = None, *,
                 microbatches: int = 0, circular_repeats: int = 1) -> None:
    """Fail at start, naming the exact mismatch, when the layout cannot run this model here.

    ``model`` is an ``LLMConfig`` (or anything with the same fields); it is optional so that meshes can
    be built for functions that are not the LLM.
    """
    name = str(layout)
    if layout.num_devices != num_devices:
        sizes = "x".join(str(n) for n in layout.sizes.values())
        raise ConfigError(f"parallel.llm={name}: uses {layout.num_devices} devices ({sizes} over "
                          f"{', '.join(MESH_AXES)}) but {num_devices} are present; the product of the axis "
                          f"sizes must equal the device count")
    if model is None:
        return
    checks = [("tp", layout.tp, "model.num_heads", model.num_heads),
              ("tp", layout.tp, "model.num_kv_heads", model.num_kv_heads),
              ("pp", layout.pp * max(circular_repeats, 1), "model.num_layers", model.num_layers)]
    moe = getattr(model, "moe", None)
    if moe is not None and getattr(moe, "every", 0):
        checks.append(("ep", layout.ep, "model.moe.num_experts", moe.num_experts))
    for axis, size, field, value in checks:
        if value % size:
            what = f"pp x circular repeats = {size}" if axis == "pp" and circular_repeats > 1 else f"{axis}={size}"
            raise ConfigError(f"parallel.llm={name}: {what} does not divide {field}={value}")
    if layout.ep > 1 and (moe is None or not getattr(moe, "every", 0)):
        raise ConfigError(f"parallel.llm={name}: ep={layout.ep} needs a MoE model (model.moe.every > 0)")
    if layout.pp > 1 and microbatches and microbatches < layout.pp and circular_repeats > 1:
        raise ConfigError(f"parallel.microbatches={microbatches}: the circular pipeline needs at least pp="
                          f"{layout.pp} microbatches")


def hybrid_split(sizes: Sequence[int], num_hosts: int) -> tuple[list[int], list[int]]:
    """Split axis sizes into (within-host, across-host) factors, giving hosts to the slowest axes first.

    Pure: ``ici[i] * dcn[i] == sizes[i]`` and ``prod(dcn) == num_hosts``; fast axes (last) stay in a host.
    """
    ici, dcn = list(sizes), [1] * len(sizes)
    left = num_hosts
    for i in range(len(sizes)):
        g = math.gcd(ici[i], left)
        dcn[i], ici[i] = g, ici[i] // g
        left //= g
        if left == 1:
            break
    if left != 1:
        raise ConfigError(f"layout sizes {list(sizes)} cannot be split over {num_hosts} hosts: the outer axes "
                          f"must absorb the host count (left over: {left})")
    return ici, dcn


def make_mesh(layout: Layout | str, devices: Sequence[Any] | None = None, model: Any | None = None,
              **check_kwargs: Any) -> Mesh:
    """Build the ``(pp, dp, fsdp, ep, cp, tp)`` mesh; multi-host meshes keep fast axes inside a host."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(layout, str):
        layout = parse_layout(layout, len(devices))
    check_layout(layout, len(devices), model, **check_kwargs)
    shape = [layout.sizes[a] for a in MESH_AXES]
    hosts = sorted({d.process_index for d in devices})
    if len(hosts) > 1:
        from jax.experimental import mesh_utils

        ici, dcn = hybrid_split(shape, len(hosts))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    else:
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def layout_of(mesh: Mesh) -> Layout:
    return Layout(**{a: int(mesh.shape.get(a, 1)) for a in MESH_AXES})
