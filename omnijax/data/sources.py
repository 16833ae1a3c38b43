"""Data sources: random access to `Sample`s and to their cheap `SampleMeta`.

Kinds: ArrayRecord shards written by `python -m recipes convert` (read through grain's
`ArrayRecordDataSource`, metadata from the `.meta.npz` sidecars), Parquet (a `text` column),
JSONL (text or interleaved segments referencing media files) and the built-in world.

"Opened once per host": all ArrayRecord sources of a host share ONE grain data source over all
their shards and ONE concatenated metadata table (`HostArrayRecords`); a source is just an offset
and a length into them. Readers inside grain's data source open lazily, so a thousand sources cost
a thousand integers until they are read. A missing shard or sidecar fails at open with its path.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnijax.data import media, records, tokenizer
from omnijax.data.sample import MODALITIES, BadSample, Sample, SampleMeta, Segment, SegmentMeta
from omnijax.errors import UserError


class Source(ABC):
    """Random-access source. `meta` must not decode payloads; `get` may raise BadSample."""
    name: str

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def meta(self, index: int) -> SampleMeta: ...

    @abstractmethod
    def get(self, index: int) -> Sample: ...

    def _check(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: index {index} out of range [0, {len(self)})")
        return int(index)


# ------------------------------------------------------------------------------------ world
class WorldSource(Source):
    """The built-in world as a source of `size` samples (indices are world indices)."""

    def __init__(self, name: str = "world", size: int = 1_000_000, split: str = "train", cfg: Any = None):
        from omnijax.data.world import World, WorldConfig
        self.name, self.size = name, int(size)
        self.world = World(cfg if cfg is not None else WorldConfig(), split=split, name=name)

    def __len__(self) -> int:
        return self.size

    def meta(self, index: int) -> SampleMeta:
        return self.world.meta(self._check(index))

    def get(self, index: int) -> Sample:
        return self.world.sample(self._check(index))


# ------------------------------------------------------------------------------ arrayrecord
def shard_paths(pattern: str) -> list[str]:
    """Shards of an ArrayRecord source: a file, a folder (all *.arrayrecord in it) or a glob."""
    p = Path(pattern)
    if p.is_dir():
        paths = sorted(glob.glob(str(p / "*.arrayrecord")))
    elif any(ch in pattern for ch in "*?["):
        paths = sorted(glob.glob(pattern))
    else:
        paths = [pattern]
    if not paths:
        raise UserError(f"no ArrayRecord shards match {pattern}")
    for path in paths:
        if not os.path.exists(path):
            raise UserError(f"missing ArrayRecord shard: {path}")
        if not os.path.exists(path + records.META_SUFFIX):
            raise UserError(f"missing metadata sidecar {path + records.META_SUFFIX}; rewrite the shard with "
                            f"`python -m recipes convert`")
    return paths


class HostArrayRecords:
    """One grain ArrayRecordDataSource and one metadata table for all ArrayRecord sources of a host."""

    def __init__(self, groups: list[list[str]]):
        import grain
        flat = [p for g in groups for p in g]
        tables = [records.MetaTable.load(p + records.META_SUFFIX) for p in flat]
        self.table = records.MetaTable.concat(tables)
        self.data = grain.sources.ArrayRecordDataSource(flat) if flat else None
        counts = np.array([len(t) for t in tables], np.int64)
        if self.data is not None and len(self.data) != int(counts.sum()):
            raise UserError(f"ArrayRecord shards hold {len(self.data)} records but their sidecars describe "
                            f"{int(counts.sum())}; rewrite them with `python -m recipes convert`")
        sizes = [int(sum(len(t) for t in tables[a: a + len(g)]))
                 for a, g in zip(np.cumsum([0] + [len(g) for g in groups[:-1]]), groups)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.table)


class ArrayRecordSource(Source):
    """Records [offset, offset + length) of the host's shared ArrayRecord data source."""

    def __init__(self, name: str, host: HostArrayRecords, group: int):
        self.name, self.host = name, host
        self.offset = int(host.offsets[group])
        self.length = int(host.offsets[group + 1] - host.offsets[group])

    def __len__(self) -> int:
        return self.length

    def meta(self, index: int) -> SampleMeta:
        return _with_origin(self.host.table.meta(self.offset + self._check(index)), self.name, index)

    def get(self, index: int) -> Sample:
        raw = self.host.data[self.offset + self._check(index)]
        return records.decode(raw, self.name, index)


def _with_origin(meta: SampleMeta, source: str, index: int) -> SampleMeta:
    return SampleMeta(meta.segments, source, int(index))


# ---------------------------------------------------------------------------------- parquet
class ParquetSource(Source):
    """Text documents from a Parquet file's `text` column (loss on every token).

    Lengths are read once at open (one pass over the column); rows are read by row group, with the
    last few row groups cached.
    """

    def __init__(self, name: str, path: str, column: str = "text"):
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        if not os.path.exists(path):
            raise UserError(f"missing Parquet file: {path}")
        self.name, self.path, self.column = name, path, column
        self._file = pq.ParquetFile(path)
        if column not in self._file.schema_arrow.names:
            raise UserError(f"{path}: no column {column!r}; columns: {', '.join(self._file.schema_arrow.names)}")
        col = self._file.read(columns=[column]).column(column)
        self._lengths = np.asarray(pc.fill_null(pc.binary_length(pc.cast(col, "binary")), -1), np.int64)
        sizes = [self._file.metadata.row_group(i).num_rows for i in range(self._file.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lengths)

    def meta(self, index: int) -> SampleMeta:
        n = int(self._lengths[self._check(index)])
        return SampleMeta((SegmentMeta("text", (1,)), SegmentMeta("text", (n + 1,), True)), self.name, int(index))

    @functools.lru_cache(maxsize=4)
    def _group(self, g: int) -> list:
        with self._lock:
            return self._file.read_row_group(g, columns=[self.column]).column(self.column).to_pylist()

    def get(self, index: int) -> Sample:
        index = self._check(index)
        g = int(np.searchsorted(self._starts, index, side="right") - 1)
        value = self._group(g)[index - self._starts[g]]
        if value is None:
            raise BadSample(f"{self.name}[{index}]: null text")
        data = value.encode() if isinstance(value, str) else bytes(value)
        return _text_sample(data, self.name, index)


def _text_sample(data: bytes, source: str, index: int) -> Sample:
    body = np.concatenate([np.frombuffer(data, np.uint8).astype(np.int32), [tokenizer.EOS]]).astype(np.int32)
    return Sample((Segment("text", np.array([tokenizer.BOS], np.int32)), Segment("text", body, True)), source, index)


# ------------------------------------------------------------------------------------ jsonl
class JsonlSource(Source):
    """One JSON object per line: {"text": "..."} (loss on every token) or
    {"segments": [{"text": "...", "loss": true}, {"image": "a.png"}, {"video": "v.npy"}, {"audio": "x.wav"}]}
    with media paths relative to the JSONL file. Line offsets are indexed once at open.
    """

    def __init__(self, name: str, path: str):
        if not os.path.exists(path):
            raise UserError(f"missing JSONL file: {path}")
        self.name, self.path = name, path
        self.root = Path(path).parent
        buf = np.fromfile(path, np.uint8)
        ends = np.flatnonzero(buf == ord("\n"))
        if buf.size and buf[-1] != ord("\n"):
            ends = np.append(ends, buf.size)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        keep = ends > starts  # skip empty lines
        self._starts, self._ends = starts[keep], ends[keep].astype(np.int64)
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._starts)

    def _line(self, index: int) -> dict:
        index = self._check(index)
        raw = os.pread(self._fd, int(self._ends[index] - self._starts[index]), int(self._starts[index]))
        try:
            obj = json.loads(raw)
        except ValueError:
            raise records.BadRecord(f"{self.name}[{index}]: line {index + 1} of {self.path} is not valid JSON") from None
        if not isinstance(obj, dict) or not ("text" in obj or "segments" in obj):
            raise records.BadRecord(f"{self.name}[{index}]: expected an object with 'text' or 'segments'")
        return obj

    def _parts(self, obj: dict, index: int) -> list[tuple[str, Any, bool]]:
        if "segments" not in obj:
            return [("text", str(obj["text"]), True)]
        parts = []
        for seg in obj["segments"]:
            kinds = [m for m in MODALITIES if m in seg] if isinstance(seg, dict) else []
            if len(kinds) != 1:
                raise records.BadRecord(f"{self.name}[{index}]: each segment needs exactly one of {', '.join(MODALITIES)}")
            m = kinds[0]
            parts.append((m, seg[m] if m == "text" else self.root / str(seg[m]), bool(seg.get("loss", False))))
        return parts

    def meta(self, index: int) -> SampleMeta:
        obj = self._line(index)
        segs = [SegmentMeta("text", (1,))] if "segments" not in obj else []
        for m, value, loss in self._parts(obj, index):
            if m == "text":
                n = len(str(value).encode()) + (1 if "segments" not in obj else 0)
                segs.append(SegmentMeta("text", (n,), loss))
            else:
                segs.append(SegmentMeta(m, media.media_shape(value, m), False))
        return SampleMeta(tuple(segs), self.name, int(index))

    def get(self, index: int) -> Sample:
        obj = self._line(index)
        if "segments" not in obj:
            return _text_sample(str(obj["text"]).encode(), self.name, index)
        segs = []
        for m, value, loss in self._parts(obj, index):
            data = tokenizer.encode(str(value)) if m == "text" else media.load_media(value, m)
            segs.append(Segment(m, data, loss))
        return Sample(tuple(segs), self.name, index)


# ---------------------------------------------------------------------------------- opening
@dataclass
class SourceSpec:
    """One source of a mix. kind: world | arrayrecord | parquet | jsonl (inferred from path if "")."""
    name: str = ""
    kind: str = ""
    path: str = ""
    split: str = "train"   # world only
    size: int = 1_000_000  # world only: number of virtual samples


def _kind(spec: SourceSpec) -> str:
    if spec.kind:
        return spec.kind
    if not spec.path or spec.path == "world":
        return "world"
    if spec.path.endswith(".parquet"):
        return "parquet"
    if spec.path.endswith(".jsonl"):
        return "jsonl"
    return "arrayrecord"


def open_sources(specs: list[SourceSpec], world_cfg: Any = None) -> list[Source]:
    """Open every source once; all ArrayRecord sources share one host-level data source and index."""
    kinds = [_kind(s) for s in specs]
    bad = [k for k in kinds if k not in ("world", "arrayrecord", "parquet", "jsonl")]
    if bad:
        raise UserError(f"unknown source kind {bad[0]!r}; expected world, arrayrecord, parquet or jsonl")
    names = [s.name or (Path(s.path).stem if s.path else "world") for s in specs]
    if len(set(names)) != len(names):
        raise UserError(f"source names must be unique, got {names}")
    groups = [shard_paths(s.path) for s, k in zip(specs, kinds) if k == "arrayrecord"]
    host = HostArrayRecords(groups) if groups else None
    out: list[Source] = []
    g = 0
    for spec, kind, name in zip(specs, kinds, names):
        if kind == "world":
            out.append(WorldSource(name, spec.size, spec.split, world_cfg))
        elif kind == "arrayrecord":
            out.append(ArrayRecordSource(name, host, g))
            g += 1
        elif kind == "parquet":
            out.append(ParquetSource(name, spec.path))
        else:
            out.append(JsonlSource(name, spec.path))
        if len(out[-1]) == 0:
            raise UserError(f"source {name} ({spec.path or kind}) is empty")
    return out
