"""Encoder payloads decoded where they are encoded, and only there.

A step's plan needs only metadata (shapes, lengths); the pixels and waveforms of a segment are needed
only on the device that encodes it, and its token rows only on the devices that hold them. The loader
therefore gives a host its own LLM rows plus the step's geometry in a few integers per segment (`Runs`
for segment ids and destinations, `PositionRows` for encoder positions, `row_docs` per global row),
with each encoder's input buffer a `LazyRows`: rows are laid out from the metadata, and a segment is
read and decoded the first time a slice touches it (the routing plan slices exactly the segments
placed on this host's devices). Every decode is counted, so a host can report the payload bytes it decoded beside the step's total.
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
    positions: Callable[[], np.ndarray] | None = None  # its encoder positions [rows, 3], from metadata
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


    def positions(self) -> "PositionRows":
        """The buffer's positions [n, 3] (int32), each segment's computed only when a slice touches it."""
        return PositionRows(self)


class PositionRows:
    """Encoder positions [n, 3] of a `LazyRows` buffer: a segment's are a pure function of its metadata
    (`Payload.positions`), computed when a slice asks, so no host holds the whole step's positions."""

    def __init__(self, rows: LazyRows):
        self._rows = rows
        self.shape = (rows.shape[0], 3)
        self.dtype = np.dtype(np.int32)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            return np.asarray(self)[key]
        lo, hi, _ = key.indices(self.shape[0])
        out = np.zeros((max(hi - lo, 0), 3), np.int32)
        for s, p in self._rows._overlapping(lo, hi):
            a, b = max(s, lo), min(s + p.rows, hi)
            out[a - lo:b - lo] = np.asarray(p.positions(), np.int32)[a - s:b - s]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[0:self.shape[0]]
        return out if dtype is None else out.astype(dtype)


class Runs:
    """A per-row int buffer [n] given by runs instead of rows: rows ``starts[k] + i`` (``i < lengths[k]``)
    hold ``values[k] + step * i``, every other row ``fill``.

    The step's encoder segment ids (``step=0``) and output destinations (``step=1``: a segment's output
    tokens land on consecutive LLM positions) take a few integers per segment this way, so every host
    can hold the whole step's geometry (the plan needs it) without O(step rows) arrays. Slices and
    ``np.asarray`` give the plain rows."""

    def __init__(self, n: int, starts, lengths, values, step: int = 0, fill: int = 0, dtype=np.int32):
        self.shape = (int(n),)
        self.dtype = np.dtype(dtype)
        self.ndim = 1
        self.starts = np.asarray(starts, np.int64).reshape(-1)
        self.lengths = np.asarray(lengths, np.int64).reshape(-1)
        self.values = np.asarray(values, np.int64).reshape(-1)
        self.step, self.fill = int(step), int(fill)
        if not (len(self.starts) == len(self.lengths) == len(self.values)):
            raise ValueError("Runs: starts, lengths and values must have one entry per run")
        ends = self.starts + self.lengths
        if np.any(self.lengths <= 0) or np.any(self.starts[1:] < ends[:-1]) or (ends.size and ends[-1] > n):
            raise ValueError("Runs: runs must be non-empty, increasing, non-overlapping and inside the buffer")

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def real(self) -> int:
        """Rows covered by a run (the buffer's non-padding rows)."""
        return int(self.lengths.sum())

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            return np.asarray(self)[key]
        lo, hi, _ = key.indices(self.shape[0])
        out = np.full(max(hi - lo, 0), self.fill, self.dtype)
        k = max(int(np.searchsorted(self.starts, lo, side="right")) - 1, 0)
        while k < len(self.starts) and self.starts[k] < hi:
            s, n = int(self.starts[k]), int(self.lengths[k])
            a, b = max(s, lo), min(s + n, hi)
            if a < b:
                out[a - lo:b - lo] = self.values[k] + self.step * np.arange(a - s, b - s)
            k += 1
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.full(self.shape[0], self.fill, self.dtype)
        if self.real:
            first = np.repeat(self.starts, self.lengths)
            within = np.arange(self.real) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
            out[first + within] = np.repeat(self.values, self.lengths) + self.step * within
        return out if dtype is None else out.astype(dtype)


def payload_bytes(batch: dict) -> tuple[int, int]:
    """(decoded by this host, the step's total) over every lazy encoder buffer of a packed batch. A batch
    whose buffers hold only this host's own segments carries the step's rows per encoder (`enc_docs`:
    segments, rows, squared rows, every host's); the step's total is then those rows' bytes."""
    lazy = {k[:-len("_inputs")]: v for k, v in batch.items() if k.endswith("_inputs") and isinstance(v, LazyRows)}
    step = batch.get("enc_docs")
    total = (sum(int(step[n][1]) * v.shape[1] * 4 for n, v in lazy.items() if n in step) if step is not None
             else sum(v.total_bytes for v in lazy.values()))
    return sum(v.decoded_bytes for v in lazy.values()), total


def global_layout(batch: dict) -> bool:
    """True if the batch carries the whole step's metadata (`row_docs`: documents, tokens and squared
    lengths of every global LLM row, laid out from metadata) beside the token rows this host holds:
    counts taken from it (samples, FLOPs) are the step's, not this host's share."""
    return "row_docs" in batch


def local_rows(batch: dict) -> np.ndarray | None:
    """Global row index of each LLM row a host batch holds (None: a whole batch, rows 0..B-1)."""
    return np.asarray(batch["rows"]) if "rows" in batch else None


def step_rows(batch: dict) -> int:
    """LLM rows of the whole step (a host batch may hold only its own)."""
    return len(batch["row_docs"]) if "row_docs" in batch else int(np.shape(batch["tokens"])[0])
