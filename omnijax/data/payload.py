"""Encoder payloads decoded where they are encoded, and only there.

A step's plan needs only metadata (shapes, lengths); the pixels and waveforms of a segment are needed
only on the device that encodes it. The loader therefore packs a step with `LazyRows` in place of each
encoder's input buffer: rows are laid out from the metadata, and a segment is read and decoded the first
time a slice touches it (the routing plan slices exactly the segments placed on this host's devices).
Every decode is counted, so a host can report the payload bytes it decoded beside the step's total.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from omnijax.errors import BadSample, UserError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Payload:
    """One media segment's encoder input rows [rows, dim], decoded on first use.

    `fetch` reads and decodes the segment (float32 [rows, dim]); on a bad payload (`BadSample`, unreadable
    file) the rows are zeros and `on_error` is told, so every host keeps the same plan and the skip is counted."""
    rows: int
    dim: int
    fetch: Callable[[], np.ndarray]
    what: str = ""
    on_error: Callable[[str], None] | None = None
    _data: np.ndarray | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * 4

    @property
    def decoded(self) -> bool:
        return self._data is not None

    def get(self) -> np.ndarray:
        with self._lock:
            if self._data is None:
                try:
                    x = np.asarray(self.fetch(), np.float32)
                    if x.shape != (self.rows, self.dim):
                        raise BadSample(f"decoded to {x.shape} rows, its metadata says ({self.rows}, {self.dim})")
                    if not np.all(np.isfinite(x)):
                        raise BadSample("contains NaN or inf")
                except (BadSample, UserError, ValueError, OSError) as exc:
                    log.warning("skipped bad payload %s: %s (zeros in its place)", self.what, exc)
                    if self.on_error is not None:
                        self.on_error(self.what)
                    x = np.zeros((self.rows, self.dim), np.float32)
                self._data = x
            return self._data


class LazyRows:
    """An encoder input buffer [n, dim] whose rows are payload segments decoded when first sliced.

    Rows no segment covers are zeros (padding). `np.asarray(rows)` decodes everything (single-host
    consumers); a slice decodes only the segments it overlaps."""

    def __init__(self, n: int, dim: int):
        self.shape = (int(n), int(dim))
        self.dtype = np.dtype(np.float32)
        self.ndim = 2
        self._starts: list[int] = []
        self._pieces: list[Payload] = []

    def __len__(self) -> int:
        return self.shape[0]

    def put(self, lo: int, payload: Payload) -> None:
        if self._starts and lo < self._starts[-1] + self._pieces[-1].rows:
            raise ValueError("payloads must be placed in increasing, non-overlapping row order")
        if lo + payload.rows > self.shape[0] or payload.dim != self.shape[1]:
            raise ValueError(f"payload of {payload.rows}x{payload.dim} does not fit rows {lo}.. of {self.shape}")
        self._starts.append(int(lo))
        self._pieces.append(payload)

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            return np.asarray(self)[key]
        lo, hi, _ = key.indices(self.shape[0])
        out = np.zeros((max(hi - lo, 0), self.shape[1]), np.float32)
        for s, p in self._overlapping(lo, hi):
            a, b = max(s, lo), min(s + p.rows, hi)
            out[a - lo:b - lo] = p.get()[a - s:b - s]
        return out

    def _overlapping(self, lo: int, hi: int):
        """(start row, payload) of every segment that rows [lo, hi) touch, in row order."""
        i = max(int(np.searchsorted(self._starts, lo, side="right")) - 1, 0)
        for s, p in zip(self._starts[i:], self._pieces[i:]):
            if s >= hi:
                break
            if s + p.rows > lo:
                yield s, p

    def load(self, ranges, threads: int = 8) -> None:
        """Decode every segment overlapping the row ranges [(lo, hi), ...] now, `threads` at a time
        (image and video decoders release the GIL), so the slices that follow only copy."""
        todo, seen = [], set()
        for lo, hi in ranges:
            for _, p in self._overlapping(lo, hi):
                if not p.decoded and id(p) not in seen:
                    seen.add(id(p))
                    todo.append(p)
        if len(todo) > 1 and threads > 1:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(min(threads, len(todo))) as pool:
                list(pool.map(Payload.get, todo))
        else:
            for p in todo:
                p.get()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[0:self.shape[0]]
        return out if dtype is None else out.astype(dtype)

    @property
    def total_bytes(self) -> int:
        """Payload bytes of every segment in the buffer (what a host that decoded everything would decode)."""
        return sum(p.nbytes for p in self._pieces)

    @property
    def decoded_bytes(self) -> int:
        """Payload bytes this host has decoded so far."""
        return sum(p.nbytes for p in self._pieces if p.decoded)


def payload_bytes(batch: dict) -> tuple[int, int]:
    """(decoded by this host, the step's total) over every lazy encoder buffer of a packed batch."""
    lazy = [v for v in batch.values() if isinstance(v, LazyRows)]
    return sum(v.decoded_bytes for v in lazy), sum(v.total_bytes for v in lazy)


def global_layout(batch: dict) -> bool:
    """True if the batch holds the whole step's layout (every host's rows, laid out from metadata)
    rather than only this host's rows: it then carries lazy encoder buffers."""
    return any(isinstance(v, LazyRows) for v in batch.values())
