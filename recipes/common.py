"""Pieces shared by recipes: config loading, device setup, loader adapters."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from omnijax.config import Config, build, load_yaml, merge, parse_overrides, validate

CONFIGS = Path(__file__).parent / "configs"


# Settings that act before a recipe builds its config: the fake CPU devices and XLA:CPU's thread pool are fixed
# when jax makes its client, jax.distributed's heartbeat limit when it starts, and the run folder is where a
# supervisor of the process writes. They are read from the recipe's YAML and the command line alike.
EARLY = ("parallel.cpu_devices", "parallel.cpu_threads", "trainer.peer_timeout_s", "trainer.run_name")
PEER_TIMEOUT_ENV = "OMNIJAX_PEER_TIMEOUT_S"  # omnijax.train.distributed sizes jax's heartbeat limit from it


def early_settings(recipe: str, argv: list[str]) -> dict:
    """The EARLY settings of `recipe` as its config will hold them: recipes/configs/<recipe>.yaml (with the files
    it includes through `base:`) <- the `key=value` arguments. Keys set nowhere are absent; values are as
    written (the config's own validation names a bad one)."""
    path = CONFIGS / f"{recipe}.yaml"
    tree = merge(load_yaml(path) if path.is_file() else {},
                 parse_overrides([a for a in argv if "=" in a and not a.startswith("-")]))
    out = {}
    for key in EARLY:
        node = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[key] = node
    return out


def _positive_int(value) -> int | None:
    text = str(value).strip()
    return int(text) if not isinstance(value, bool) and text.isdigit() and int(text) > 0 else None


def _devices_and_threads(devices, threads) -> None:
    """The fake CPU device count into XLA_FLAGS, the thread count into NPROC: XLA reads both when it makes the
    CPU client. A value that is not a positive integer is skipped (the config's validation names it)."""
    devices, threads = _positive_int(devices), _positive_int(threads)
    if devices:
        flags = os.environ.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    if threads:
        os.environ["NPROC"] = str(threads)


def apply_early(settings: dict) -> None:
    """Put the EARLY settings where jax and omnijax.train.distributed read them, before jax starts (devices and
    threads as _devices_and_threads, the peer timeout into PEER_TIMEOUT_ENV)."""
    _devices_and_threads(settings.get("parallel.cpu_devices"), settings.get("parallel.cpu_threads"))
    try:
        timeout = float(settings.get("trainer.peer_timeout_s"))
    except (TypeError, ValueError):
        timeout = 0.0
    if timeout > 0:
        os.environ[PEER_TIMEOUT_ENV] = f"{timeout:g}"
    else:  # set nowhere (or invalid, which the config names): never a parent process's value
        os.environ.pop(PEER_TIMEOUT_ENV, None)


def before_jax(recipe: str, argv: list[str]) -> dict:
    """Every recipe's start (`python -m recipes NAME`): read the EARLY settings from its YAML and the command
    line and apply them before jax starts; returns them."""
    settings = early_settings(recipe, argv)
    apply_early(settings)
    return settings


def setup_devices(overrides: list[str]) -> None:
    """Honour `parallel.cpu_devices=N` and `parallel.cpu_threads=T` of `overrides` before jax starts (for code
    started without `python -m recipes`, which applies the recipe's YAML too: see before_jax)."""
    values = {k.strip(): v for k, _, v in (o.partition("=") for o in overrides)}
    _devices_and_threads(values.get("parallel.cpu_devices"), values.get("parallel.cpu_threads"))


def load_config(name: str, overrides: list[str], cls: type = Config, check: Any = validate) -> Any:
    """recipes/configs/<name>.yaml <- command-line overrides (run_name defaults to the recipe name), then
    `check` (None: unchecked)."""
    return build(cls, CONFIGS / f"{name}.yaml", overrides, defaults={"trainer": {"run_name": name}}, check=check)


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
