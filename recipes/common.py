"""Pieces shared by recipes: config loading, device setup, loader adapters."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from omnijax.config import Config, build

CONFIGS = Path(__file__).parent / "configs"


def setup_devices(overrides: list[str]) -> None:
    """Honour `parallel.cpu_devices=N` and `parallel.cpu_threads=T` before jax starts: fakes N CPU devices
    when no accelerator; sizes XLA:CPU's intra-op thread pool (XLA reads NPROC when it makes the client).
    A value that is not a positive integer is left to the config's own validation, which names it."""
    for item in overrides:
        key, _, value = item.partition("=")
        value = value.strip()
        if not value.isdigit() or int(value) == 0:
            continue
        if key.strip() == "parallel.cpu_devices":
            flags = os.environ.get("XLA_FLAGS", "")
            flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={int(value)}".strip()
        elif key.strip() == "parallel.cpu_threads":
            os.environ["NPROC"] = value


def load_config(name: str, overrides: list[str], cls: type = Config) -> Config:
    """recipes/configs/<name>.yaml <- command-line overrides (run_name defaults to the recipe name)."""
    return build(cls, CONFIGS / f"{name}.yaml", overrides, defaults={"trainer": {"run_name": name}}
                 if not any(o.startswith("trainer.run_name=") for o in overrides) else None)


class IndexedLoader:
    """Adapts a random-access batch source to the trainer's Loader protocol. Its whole state is the
    next step number, so resume is exact and independent of the number of hosts.

    `rows` (the placement's `host_rows(batch_size)`) are the global rows of every batch this host
    loads, increasing; they need a source with `row(global_index)` (batch `step` holds rows
    `step * batch_size + r`). Without `rows`, the source's `batch(step, batch_size, rank, num_ranks)`
    gives the contiguous block `rank` of `num_ranks` (right only where each host's devices hold one
    contiguous block of batch shards)."""

    def __init__(self, source, batch_size: int, rank: int = 0, num_ranks: int = 1, seed: int = 0,
                 rows: Sequence[int] | None = None):
        self.source, self.batch_size, self.rank, self.num_ranks, self.seed = source, batch_size, rank, num_ranks, seed
        self.rows = None if rows is None else [int(r) for r in rows]
        if self.rows is not None:
            from omnijax.errors import UserError

            if not hasattr(source, "row"):
                raise UserError(f"{type(source).__name__} has no row(index): it cannot load a host's rows by index")
            if any(not 0 <= r < batch_size for r in self.rows) or self.rows != sorted(set(self.rows)):
                raise UserError(f"IndexedLoader rows must be increasing indices in [0, {batch_size}), got {self.rows}")
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.rows is None:
            batch = self.source.batch(self.step, self.batch_size, self.rank, self.num_ranks)
        else:
            base = self.step * self.batch_size
            got = [self.source.row(base + r) for r in self.rows]
            batch = {k: np.stack([g[k] for g in got]) for k in got[0]}
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def set_state(self, state: dict) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            from omnijax.errors import UserError

            raise UserError(f"checkpoint was written with trainer.seed={state['seed']}, this run has {self.seed}; "
                            "use the same seed or a new trainer.run_name")
        self.step = int(state["step"])
