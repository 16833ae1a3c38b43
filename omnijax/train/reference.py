"""DPO's reference computed once (`dpo.reference=precompute`): the frozen initial weights' log-probabilities of
every answer token the run will train on, computed before training and carried in each step's batch.

The data plane's batches are a pure function of the config and the seed, so a second loader built the same way
yields the very batches training will see, step by step: `precompute` runs the reference forward (the initial
parameters, adapters off) over them and keeps, per step, the answer tokens' log-probabilities (only the loss
positions, a few bytes a token); `WithReference` adds them to each training batch as `ref_logps` [B, L], which
`models/preference.dpo_loss` reads instead of a second forward. So training holds no reference model (full
fine-tuning needs no second copy of the weights), at one forward per step before training begins. A resumed run
computes the table again from the initial weights (the batches after the checkpoint are the same ones).

`pair_logps` / `pair_report` score held-out pairs: each pair's chosen and rejected sequence log-probabilities
under given weights, then the share the policy itself ranks right (log π(chosen) > log π(rejected): what greedy
decoding between the two sees) and the reward accuracy DPO optimises ((π_c − ρ_c) > (π_r − ρ_r)), with their
standard errors.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.data.payload import local_rows
from omnijax.layers import lora
from omnijax.models import preference
from omnijax.models.objective import cast_floating

STATE_KEY = "reference_step"


def precompute(loader: Any, steps: int, graphdef: nnx.GraphDef, params: Any, rest: Any, put_batch: Callable,
               compute_dtype: Any = jnp.float32, log: bool = True,
               logps_fn: preference.LogpsFn = preference.model_logps, out_sharding: Any = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step 1..`steps` of `loader` (a fresh loader of the run's data, built as the training one is): (flat
    indices, log-probabilities) of this host's answer tokens under `params` with the adapters off.

    `logps_fn`: the training step's per-token log-probabilities (the joint step's, under a placement), with
    `put_batch` the placement's; `out_sharding` (a replicated sharding of the placement's mesh) brings the
    step's [B, L] values to every process, each keeping the rows of its own host batch (`rows`)."""
    fn = jax.jit(lambda p, b: preference.reference_logps(nnx.merge(graphdef, cast_floating(p, compute_dtype), rest), b,
                                                         logps_fn), **_out(out_sharding))
    t0, table = time.perf_counter(), []
    for _ in range(steps):
        host = next(loader)
        logps = np.asarray(jax.device_get(fn(params, put_batch(host))), np.float32)
        rows = local_rows(host)
        if rows is not None and len(rows) != len(logps):  # this host's rows of the step
            logps = logps[rows]
        logps = logps.reshape(-1)
        where = np.flatnonzero(np.asarray(host["loss_mask"]).reshape(-1) > 0).astype(np.int64)
        table.append((where, logps[where]))
    if log and jax.process_index() == 0:
        print(f"dpo: reference log-probabilities of {sum(len(w) for w, _ in table)} answer tokens over {steps} steps "
              f"precomputed in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return table


def _out(sharding: Any) -> dict:
    """jit's keyword for an output sharding, where one is given."""
    return {} if sharding is None else {"out_shardings": sharding}


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


def pack_all(packer: Any, samples: list) -> list[dict]:
    """`samples` in order through `packer` (a `data.packing.SamplePacker`) into as many host batches as they take;
    one that can never fit is skipped and counted in `packer.skipped`."""
    out, i = [], 0
    while i < len(samples):
        batch, consumed = packer.pack(samples[i:])
        if not consumed:
            raise RuntimeError("pack_all: the packer took nothing from a fresh batch")
        if np.asarray(batch["loss_mask"]).any():  # not only skipped samples
            out.append(batch)
        i += len(consumed)
    return out


def pair_logps(batches: list[dict], graphdef: nnx.GraphDef, params: Any, rest: Any, put_batch: Callable,
               compute_dtype: Any = jnp.float32, adapters_off: bool = False,
               logps_fn: preference.LogpsFn = preference.model_logps,
               out_sharding: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) sequence log-probabilities of every real pair of `batches` (whole host batches with
    `pref_index`) under `params`; `adapters_off`: the model with its LoRA adapters off (DPO's reference).
    `logps_fn`, `put_batch`, `out_sharding`: as `precompute`'s (the joint step's, under a placement)."""
    def fn(p, b):
        model = nnx.merge(graphdef, cast_floating(p, compute_dtype), rest)
        if adapters_off:
            with lora.disabled():
                return preference.pair_logps(logps_fn(model, b), b)
        return preference.pair_logps(logps_fn(model, b), b)
    step = jax.jit(fn, **_out(out_sharding))
    out_c, out_r = [], []
    for host in batches:
        c, r, real = (np.asarray(x) for x in jax.device_get(step(params, put_batch(host))))
        out_c.append(c[real])
        out_r.append(r[real])
    if not out_c:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(out_c).astype(np.float64), np.concatenate(out_r).astype(np.float64)


def pair_report(policy: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray], beta: float) -> dict:
    """Held-out pair metrics: `preference_accuracy` (log π(chosen) > log π(rejected)), `reward_accuracy`
    ((π_c − ρ_c) > (π_r − ρ_r), TRL's rewards/accuracies), `_se` one standard error of each, the mean sequence
    log-probabilities, reward margin and sigmoid DPO loss, and `pairs`."""
    (pc, pr), (rc, rr) = policy, ref
    n = len(pc)
    if n == 0:
        return {"pairs": 0}
    margin = beta * ((pc - rc) - (pr - rr))
    pref, reward = float(np.mean(pc > pr)), float(np.mean(margin > 0))
    se = lambda p: round(float(np.sqrt(p * (1 - p) / n)), 4)  # noqa: E731
    return {"pairs": n, "preference_accuracy": round(pref, 4), "preference_accuracy_se": se(pref),
            "reward_accuracy": round(reward, 4), "reward_accuracy_se": se(reward),
            "logps_chosen": round(float(np.mean(pc)), 4), "logps_rejected": round(float(np.mean(pr)), 4),
            "reward_margin": round(float(np.mean(margin)), 4),
            "dpo_loss": round(float(np.mean(np.logaddexp(0.0, -margin))), 4)}
