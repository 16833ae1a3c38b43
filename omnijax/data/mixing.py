"""Stateless multi-source mixing with step-dependent weights.

Which (source, record) global sample i = step * B + slot maps to is a pure function of
(seed, i, schedule, source sizes); nothing is carried between steps, so resume and any number of
hosts see the same stream.

- Counts per step: systematic sampling with a per-step random offset u: source k gets
  ceil(c_k B - u) - ceil(c_{k-1} B - u) of the B slots (c = cumulative weights at that step), i.e.
  floor or ceil of w_k B, exactly B in total, unbiased over steps.
- Slots: the step's labels are shuffled by a permutation seeded with (seed, step).
- Records: the j-th draw of source k (j = draws in earlier steps + rank within this step) is record
  index_shuffle(j mod n_k) of epoch j // n_k, a bijection from grain seeded per (seed, source,
  epoch): every record once per epoch, a fresh order each epoch, O(1) memory per source (sources
  of at most 65536 records use a cached explicit permutation with the same seed instead: grain's
  bijection is slow on small domains).
- Prefix counts (draws in earlier steps) are recomputed from the schedule, vectorised, with
  checkpoints every `CHECKPOINT` steps cached: derived data, not state.
"""
from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnijax.errors import ConfigError

CHECKPOINT = 256


@dataclass
class Knot:
    step: int = 0
    weights: dict[str, float] = field(default_factory=dict)


class Schedule:
    """Piecewise-linear source weights over steps (constant before the first and after the last knot)."""

    def __init__(self, names: list[str], knots: list[Knot] | list[dict] | dict[str, float]):
        self.names = list(names)
        if isinstance(knots, dict):
            knots = [Knot(0, dict(knots))]
        ks = [k if isinstance(k, Knot) else Knot(int(k.get("step", 0)), dict(k.get("weights", {}))) for k in knots]
        if not ks:
            raise ConfigError("data mix schedule: needs at least one knot {step, weights}")
        steps = [k.step for k in ks]
        if steps != sorted(steps) or len(set(steps)) != len(steps) or steps[0] < 0:
            raise ConfigError(f"data mix schedule: knot steps must be distinct, increasing and >= 0, got {steps}")
        rows = []
        for k in ks:
            unknown = set(k.weights) - set(self.names)
            if unknown:
                raise ConfigError(f"data mix schedule at step {k.step}: unknown source(s) {sorted(unknown)}; "
                                  f"sources: {', '.join(self.names)}")
            row = np.array([float(k.weights.get(n, 0.0)) for n in self.names])
            if np.any(row < 0) or row.sum() <= 0:
                raise ConfigError(f"data mix schedule at step {k.step}: weights must be >= 0 with a positive sum")
            rows.append(row / row.sum())
        self.steps = np.array(steps, np.float64)
        self.weights = np.stack(rows)

    @classmethod
    def uniform(cls, names: list[str]) -> "Schedule":
        return cls(names, {n: 1.0 for n in names})

    def at(self, steps: np.ndarray | int) -> np.ndarray:
        """Normalised weights [len(steps), K] (or [K] for a scalar step)."""
        s = np.asarray(steps, np.float64)
        out = np.stack([np.interp(s.reshape(-1), self.steps, self.weights[:, k]) for k in range(len(self.names))], -1)
        out /= out.sum(-1, keepdims=True)
        return out[0] if s.ndim == 0 else out

    def fingerprint(self) -> str:
        h = hashlib.sha256(repr((self.names, self.steps.tolist(), self.weights.round(12).tolist())).encode())
        return h.hexdigest()[:16]


def _u(seed: int, steps: np.ndarray) -> np.ndarray:
    """Per-step offsets in [0, 1), a pure function of (seed, step) (splitmix64 finaliser)."""
    with np.errstate(over="ignore"):
        return _mix64(seed, steps)


def _mix64(seed: int, steps: np.ndarray) -> np.ndarray:
    x = (np.asarray(steps, np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15))
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@functools.lru_cache(maxsize=4096)
def _seed32(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


SMALL = 1 << 16  # sources up to this size use a cached explicit permutation (faster than index_shuffle there)


@functools.lru_cache(maxsize=256)
def _small_perm(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _position(p: int, n: int, seed: int) -> int:
    """Record at position p of the permutation of range(n) seeded by `seed` (a pure function)."""
    if n <= SMALL:
        return int(_small_perm(n, seed)[p])
    from grain.experimental import index_shuffle
    return int(index_shuffle(p, max_index=n - 1, seed=seed, rounds=4))


class Mixer:
    """Maps global sample indices to (source, record) for a batch size, a schedule and a seed."""

    def __init__(self, sizes: list[int], schedule: Schedule, seed: int, batch_size: int):
        if len(sizes) != len(schedule.names):
            raise ConfigError(f"{len(sizes)} sources but the schedule names {len(schedule.names)}")
        if any(n <= 0 for n in sizes):
            raise ConfigError(f"every source needs records, sizes={sizes}")
        if batch_size <= 0:
            raise ConfigError(f"batch_size={batch_size}: must be > 0")
        self.sizes = np.asarray(sizes, np.int64)
        self.schedule, self.seed, self.batch_size = schedule, int(seed), int(batch_size)
        self._checkpoints: list[np.ndarray] = [np.zeros(len(sizes), np.int64)]
        self._last: tuple[int, np.ndarray] = (0, self._checkpoints[0])
        self._lock = threading.Lock()  # the caches are shared by prefetch threads

    def counts(self, steps: np.ndarray) -> np.ndarray:
        """Samples per source [len(steps), K] of each step (each row sums to batch_size)."""
        steps = np.asarray(steps, np.int64).reshape(-1)
        cdf = np.cumsum(self.schedule.at(steps), -1)
        cdf[:, -1] = 1.0
        edges = np.ceil(cdf * self.batch_size - _u(self.seed, steps)[:, None]).astype(np.int64)
        edges = np.clip(edges, 0, self.batch_size)
        return np.diff(np.concatenate([np.zeros((len(steps), 1), np.int64), edges], -1), axis=-1)

    def prefix(self, step: int) -> np.ndarray:
        """Draws of each source in steps [0, step)."""
        with self._lock:
            return self._prefix(step)

    def _prefix(self, step: int) -> np.ndarray:
        last, value = self._last
        if step == last + 1:  # the common sequential case: one step of counts
            out = value + self.counts(np.array([last]))[0]
            self._last = (step, out)
            return out
        c = step // CHECKPOINT
        while len(self._checkpoints) <= c:
            k = len(self._checkpoints) - 1
            span = np.arange(k * CHECKPOINT, (k + 1) * CHECKPOINT)
            self._checkpoints.append(self._checkpoints[-1] + self.counts(span).sum(0))
        rest = np.arange(c * CHECKPOINT, step)
        out = self._checkpoints[c] + (self.counts(rest).sum(0) if rest.size else 0)
        self._last = (step, out)
        return out

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source ids [B], record ids [B]) of global batch `step`."""
        if step < 0:
            raise ConfigError(f"step {step}: must be >= 0")
        counts = self.counts(np.array([step]))[0]
        labels = np.repeat(np.arange(len(self.sizes)), counts)
        labels = labels[np.random.default_rng([self.seed, step, 0x6D6978]).permutation(self.batch_size)]
        recs, _ = self._records(labels, self.prefix(step))
        return labels.astype(np.int32), recs

    def _records(self, labels: np.ndarray, prefix: np.ndarray, lane: int = 0,
                 lanes: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Record ids of draws from sources `labels` (in slot order) after `prefix` earlier draws of each
        source, and the draws per source: each source walks one permutation of its records per epoch.
        With `lanes` > 1, this lane's d-th draw of a source is the source's draw d * lanes + lane: lanes
        that draw independently (planning groups) walk disjoint positions of the same permutations."""
        rank = np.zeros(len(labels), np.int64)
        seen = np.zeros(len(self.sizes), np.int64)
        for slot, k in enumerate(labels):
            rank[slot] = seen[k]
            seen[k] += 1
        draws = (prefix[labels] + rank) * lanes + lane
        n = self.sizes[labels]
        epoch, pos = draws // n, draws % n
        recs = np.array([_position(int(p), int(m), _seed32(self.seed, int(k), int(e)))
                         for p, m, k, e in zip(pos, n, labels, epoch)], np.int64)
        return recs, seen

    def draw(self, prefix: np.ndarray, step: int, n: int, lane: int = 0,
             lanes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`n` draws with the schedule's weights at `step`, continuing each source's sequence at `prefix`
        (draws of each source so far): (source ids [n], record ids [n], the new prefix).

        For callers that draw a varying number of samples per step (the loader draws only what its
        deferred samples leave room for): each source still walks through its records one epoch (a
        fresh permutation) at a time, and the result is a pure function of (seed, prefix, step, n).
        `lane` of `lanes`: one of several independent draws (`_records`), each with its own slot order."""
        prefix = np.asarray(prefix, np.int64)
        if n <= 0:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), prefix.copy()
        cdf = np.cumsum(self.schedule.at(np.array([step], np.int64))[0])
        cdf[-1] = 1.0
        salt = [] if lanes == 1 else [lane, lanes]  # one lane: the draws of a loader without groups
        u = _u(self.seed ^ 0x5EED, np.array([step * lanes + lane]))[0]
        edges = np.clip(np.ceil(cdf * n - u).astype(np.int64), 0, n)
        counts = np.diff(np.concatenate([[0], edges]))
        labels = np.repeat(np.arange(len(self.sizes)), counts)
        labels = labels[np.random.default_rng([self.seed, step, n, 0x647277, *salt]).permutation(n)]
        recs, seen = self._records(labels, prefix, lane, lanes)
        return labels.astype(np.int32), recs, prefix + seen

    def index(self, i: int) -> tuple[int, int]:
        """(source, record) of global sample index i."""
        step, slot = divmod(int(i), self.batch_size)
        src, rec = self.batch(step)
        return int(src[slot]), int(rec[slot])


def schedule_from_config(names: list[str], mix: Any) -> Schedule:
    """`mix` is None (uniform), {name: weight} (static) or [{step, weights: {name: weight}}, ...]."""
    if mix is None or mix == {} or mix == []:
        return Schedule.uniform(names)
    return Schedule(names, mix)
