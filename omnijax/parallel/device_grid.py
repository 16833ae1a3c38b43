"""The device grid the host planner works on: the LLM mesh's axes in order, flattened, and the encoder
view `(edp, esp)` of the same devices (`esp` groups are runs of consecutive devices, the innermost axes)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omnijax.errors import ConfigError


MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


# ----------------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceGrid:
    """The LLM mesh shape plus the encoder view's `esp` size, as the planner needs them."""

    sizes: tuple[int, ...]  # in MESH_AXES order
    esp: int = 1

    def __post_init__(self):
        if len(self.sizes) != len(MESH_AXES):
            raise ValueError(f"sizes must give {len(MESH_AXES)} axes {MESH_AXES}")
        if self.esp < 1 or self.num_devices % self.esp:
            raise ConfigError(f"parallel.encoder: esp={self.esp} must divide the {self.num_devices} devices")

    @classmethod
    def from_layout(cls, layout, esp: int = 1) -> "DeviceGrid":
        return cls(tuple(int(layout.sizes[a]) for a in MESH_AXES), esp)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    @property
    def edp(self) -> int:
        return self.num_devices // self.esp

    def size(self, axis: str) -> int:
        return self.sizes[MESH_AXES.index(axis)]

    @property
    def batch_shards(self) -> int:
        return self.size("dp") * self.size("fsdp") * self.size("ep")

    def coords(self) -> np.ndarray:
        """[D, 6] mesh coordinates of every device, in flattened (row-major) mesh order."""
        return np.stack(np.unravel_index(np.arange(self.num_devices), self.sizes), axis=1)

    def batch_shard(self) -> np.ndarray:
        c = self.coords()
        dp, fsdp, ep = (MESH_AXES.index(a) for a in ("dp", "fsdp", "ep"))
        return (c[:, dp] * self.size("fsdp") + c[:, fsdp]) * self.size("ep") + c[:, ep]

    def axis(self, name: str) -> np.ndarray:
        return self.coords()[:, MESH_AXES.index(name)]

    def receivers(self, first_stage_only: bool = False) -> dict[tuple[int, int], np.ndarray]:
        """(batch shard, cp rank) -> devices holding that LLM block (all its pp and tp replicas, or
        only the pp=0 ones when the encoder outputs feed the first pipeline stage directly)."""
        shard, cp, pp = self.batch_shard(), self.axis("cp"), self.axis("pp")
        stage = (pp == 0) if first_stage_only else np.ones_like(pp, bool)
        return {(s, c): np.flatnonzero((shard == s) & (cp == c) & stage)
                for s in range(self.batch_shards) for c in range(self.size("cp"))}

    def esp_axes(self) -> tuple[str, ...]:
        """Mesh axes that make up one esp group: the innermost non-trivial axes whose sizes multiply to esp."""
        if self.esp == 1:
            return ()
        axes, prod = [], 1
        for name in reversed(MESH_AXES):
            n = self.size(name)
            if n == 1:
                continue
            axes.insert(0, name)
            prod *= n
            if prod >= self.esp:
                break
        if prod != self.esp:
            inner = "x".join(f"{a}{self.size(a)}" for a in reversed(MESH_AXES) if self.size(a) > 1)
            raise ConfigError(f"parallel.encoder: esp={self.esp} must equal the product of the innermost LLM mesh axes "
                              f"(so esp groups stay on the fast links); innermost first: {inner or 'none'}")
        return tuple(axes)


def parse_encoder_layout(text: str, num_devices: int) -> tuple[int, int]:
    """`"edp4xesp2"` -> (edp, esp); `""` -> (num_devices, 1). The product must be the device count."""
    text = text.strip().lower()
    sizes = {"edp": 1, "esp": 1}
    if text:
        for token in text.split("x"):
            name = token.rstrip("0123456789")
            digits = token[len(name):]
            if name not in sizes or not digits:
                raise ConfigError(f"parallel.encoder={text!r}: cannot read '{token}'; write e.g. 'edp4xesp2'")
            sizes[name] = int(digits)
        if "edp" not in text:
            sizes["edp"] = num_devices // max(sizes["esp"], 1)
    else:
        sizes["edp"] = num_devices
    if sizes["edp"] * sizes["esp"] != num_devices:
        raise ConfigError(f"parallel.encoder={text!r}: edp{sizes['edp']} x esp{sizes['esp']} = "
                          f"{sizes['edp'] * sizes['esp']} devices, but there are {num_devices}")
    return sizes["edp"], sizes["esp"]
