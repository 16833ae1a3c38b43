"""DPO's reference computed once (`dpo.reference=precompute`): the frozen initial weights' log-probabilities of
every answer token the run will train on, computed before training and carried in each step's batch.

The data plane's batches are a pure function of the config and the seed, so a second loader built the same way
yields the very batches training will see, step by step: `precompute` runs the reference forward (the initial
parameters, adapters off) over them and keeps, per step, the answer tokens' log-probabilities (only the loss
positions, a few bytes a token); `WithReference` adds them to each training batch as `ref_logps` [B, L], which
`models/preference.dpo_loss` reads instead of a second forward. So training holds no reference model (full
fine-tuning needs no second copy of the weights), at one forward per step before training begins. A resumed run
computes the table again from the initial weights (the batches after the checkpoint are the same ones).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.models import preference
from omnijax.models.objective import cast_floating

STATE_KEY = "reference_step"


def precompute(loader: Any, steps: int, graphdef: nnx.GraphDef, params: Any, rest: Any, put_batch: Callable,
               compute_dtype: Any = jnp.float32, log: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step 1..`steps` of `loader` (a fresh loader of the run's data): (flat indices, log-probabilities) of
    the answer tokens under `params` with the adapters off."""
    fn = jax.jit(lambda p, b: preference.reference_logps(nnx.merge(graphdef, cast_floating(p, compute_dtype), rest), b))
    t0, table = time.perf_counter(), []
    for _ in range(steps):
        host = next(loader)
        logps = np.asarray(jax.device_get(fn(params, put_batch(host))), np.float32).reshape(-1)
        where = np.flatnonzero(np.asarray(host["loss_mask"]).reshape(-1) > 0).astype(np.int64)
        table.append((where, logps[where]))
    if log and jax.process_index() == 0:
        print(f"dpo: reference log-probabilities of {sum(len(w) for w, _ in table)} answer tokens over {steps} steps "
              f"precomputed in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return table


class WithReference:
    """The training loader with each batch's `ref_logps` [B, L] from a `precompute` table (step k: entry k)."""

    def __init__(self, loader: Any, table: list[tuple[np.ndarray, np.ndarray]] | None = None):
        self.loader, self.table, self.step = loader, table, 0

    def __iter__(self) -> "WithReference":
        return self

    def __next__(self) -> dict:
        if self.table is None:
            raise RuntimeError("WithReference: no table yet (call precompute first)")
        if self.step >= len(self.table):
            raise RuntimeError(f"WithReference: step {self.step + 1} is past the {len(self.table)} precomputed steps")
        host = dict(next(self.loader))
        where, values = self.table[self.step]
        mask = np.asarray(host["loss_mask"])
        if not np.array_equal(np.flatnonzero(mask.reshape(-1) > 0), where):  # the data changed under the table
            raise RuntimeError(f"step {self.step + 1}: the batch's answer tokens differ from the precomputed ones")
        ref = np.zeros(mask.size, np.float32)
        ref[where] = values
        host["ref_logps"] = ref.reshape(mask.shape)
        self.step += 1
        return host

    def get_state(self) -> dict:
        return {**self.loader.get_state(), STATE_KEY: self.step}

    def set_state(self, state: dict) -> None:
        state = dict(state)
        self.step = int(state.pop(STATE_KEY, 0))
        self.loader.set_state(state)

    def __getattr__(self, name: str) -> Any:  # window, metrics, reserve: the wrapped loader's
        return getattr(self.loader, name)
