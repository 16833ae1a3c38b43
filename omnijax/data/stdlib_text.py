"""A text source that needs no download: the Python standard library's own .py files.

Files are found through `sysconfig` (the interpreter's stdlib folder, without site-packages and
without the test suites). A fixed, content-independent hash of each relative path puts about 1 in
20 files in the held-out split, so train and eval never share a document on any machine.

Packing is chunked concatenation with document separation: each epoch the file order is permuted
(seed, epoch), the files are concatenated as byte tokens with an EOS after each, and row r holds
tokens [r*L, (r+1)*L] of that stream. A row is therefore a pure function of (seed, row index):
resume and any data-parallel split need no iterator state. `segment_ids` (1-based per document
piece within the row) keep attention inside a document; `loss_mask` is 0 where the target token
belongs to the next document.
"""
from __future__ import annotations

import bisect
import functools
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from omnijax.data import tokenizer
from omnijax.errors import UserError

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
EVAL_MODULUS = 20  # about 1 file in EVAL_MODULUS is held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _all_files() -> tuple[Path, ...]:
    root = stdlib_root()
    files = sorted(f for f in root.rglob("*.py")
                   if f.is_file() and not (_SKIP_DIRS & set(f.relative_to(root).parts[:-1])) and f.stat().st_size > 0)
    if not files:
        raise UserError(f"no .py files found under the standard library folder {root}")
    return tuple(files)


def _held_out(path: Path) -> bool:
    return zlib.crc32(str(path.relative_to(stdlib_root())).encode()) % EVAL_MODULUS == 0


def train_files() -> list[Path]:
    """Standard-library files used for training (disjoint from eval_files)."""
    return [f for f in _all_files() if not _held_out(f)]


def eval_files() -> list[Path]:
    """Held-out standard-library files."""
    return [f for f in _all_files() if _held_out(f)]


@functools.lru_cache(maxsize=32)
def _read(path: Path) -> np.ndarray:
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)
    return np.concatenate([data, np.array([tokenizer.EOS], np.int32)])


class PackedText:
    """Rows of `seq_len` byte tokens packed from whole documents; random access by global row index."""

    def __init__(self, files: list[Path], seq_len: int, seed: int = 0, shuffle: bool = True):
        if not files:
            raise UserError("PackedText: no files given")
        if seq_len <= 0:
            raise UserError(f"PackedText: seq_len={seq_len} must be > 0")
        self.files = list(files)
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self._sizes = np.array([f.stat().st_size + 1 for f in self.files], np.int64)  # +1: EOS
        self.tokens_per_epoch = int(self._sizes.sum())
        self.rows_per_epoch = (self.tokens_per_epoch - 1) // seq_len
        if self.rows_per_epoch <= 0:
            raise UserError(f"PackedText: {self.tokens_per_epoch} tokens are fewer than one row of {seq_len}")

    @functools.lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.files)) if self.shuffle
                 else np.arange(len(self.files)))
        starts = np.concatenate([[0], np.cumsum(self._sizes[order])])
        return order, starts

    def _window(self, epoch: int, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and document numbers of stream positions [begin, end) of one epoch."""
        order, starts = self._epoch(epoch)
        toks, docs = [], []
        k = bisect.bisect_right(starts, begin) - 1
        pos = begin
        while pos < end:
            data = _read(self.files[order[k]])
            lo, hi = pos - starts[k], min(end, starts[k + 1]) - starts[k]
            toks.append(data[lo:hi])
            docs.append(np.full(hi - lo, k, np.int64))
            pos = starts[k + 1]
            k += 1
        return np.concatenate(toks), np.concatenate(docs)

    def row(self, index: int) -> dict[str, np.ndarray]:
        """Row `index` (global, across epochs) in the batch layout: tokens/targets/loss_mask/segment_ids/positions."""
        epoch, r = divmod(int(index), self.rows_per_epoch)
        L = self.seq_len
        toks, docs = self._window(epoch, r * L, r * L + L + 1)
        new_doc = np.concatenate([[True], docs[1:L] != docs[: L - 1]])
        seg = np.cumsum(new_doc).astype(np.int32)
        starts = np.flatnonzero(new_doc)
        positions = (np.arange(L) - starts[seg - 1]).astype(np.int32)
        return {
            "tokens": toks[:L],
            "targets": toks[1:],
            "loss_mask": (docs[1:] == docs[:L]).astype(np.float32),
            "segment_ids": seg,
            "positions": positions,
        }

    def batch(self, step: int, batch_size: int, rank: int = 0, num_ranks: int = 1) -> dict[str, np.ndarray]:
        """Global batch `step` (batch_size rows), or the rows of data-parallel `rank` out of `num_ranks`."""
        if batch_size % num_ranks:
            raise UserError(f"batch_size={batch_size} is not divisible by {num_ranks} data-parallel ranks")
        per = batch_size // num_ranks
        first = step * batch_size + rank * per
        rows = [self.row(first + i) for i in range(per)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def batches(self, batch_size: int, start_step: int = 0, rank: int = 0, num_ranks: int = 1
                ) -> Iterator[dict[str, np.ndarray]]:
        """Endless batches from `start_step` on; resuming is just a different start_step."""
        step = start_step
        while True:
            yield self.batch(step, batch_size, rank, num_ranks)
            step += 1


def packed(split: str, seq_len: int, seed: int = 0) -> PackedText:
    """`PackedText` over the train or eval split (eval is not shuffled, so every run sees the same rows)."""
    if split not in ("train", "eval"):
        raise UserError(f"stdlib split={split!r}: must be 'train' or 'eval'")
    return PackedText(train_files() if split == "train" else eval_files(), seq_len, seed, shuffle=split == "train")
