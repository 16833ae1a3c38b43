"""Data sources: random access to `Sample`s and to their cheap `SampleMeta`.

Kinds: ArrayRecord shards written by `python -m recipes convert` (read through grain's
`ArrayRecordDataSource`, metadata from the `.meta.npz` sidecars), Parquet (a `text` column),
JSONL or a `.json` list (text, interleaved segments or LLaVA-style conversations referencing media
files, tokenized by the configured tokenizer; see omnijax.data.formats) and the built-in world.

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

from omnijax.data import formats, media, records
from omnijax.data import tokenizer as tokenizer_mod
from omnijax.data.sample import BadSample, Sample, SampleMeta, Segment, SegmentMeta
from omnijax.errors import ConfigError, UserError


class Source(ABC):
    """Random-access source. `meta` must not decode payloads; `get` may raise BadSample.

    `metadata_in_memory`: every record's metadata is already in memory (ArrayRecord sidecars), so
    scanning all of it at start is cheap (`loader.data_bounds` reads every record's, others a prefix)."""
    name: str
    metadata_in_memory: bool = False

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def meta(self, index: int) -> SampleMeta: ...

    @abstractmethod
    def get(self, index: int) -> Sample: ...

    def text(self, index: int) -> dict[int, np.ndarray]:
        """Token ids of the text segments by segment position; sources that can skip the media do."""
        return {k: s.data for k, s in enumerate(self.get(index).segments) if s.modality == "text"}

    def media(self, index: int, k: int) -> np.ndarray:
        """Decoded data of segment `k` alone (a host decodes only the segments its devices encode)."""
        return self.get(index).segments[k].data

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

    def text(self, index: int) -> dict[int, np.ndarray]:
        return self.world.text_segments(self._check(index))


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


HASH_AT_OPEN_BYTES = 1 << 30  # shards' SHA-256 checked at open while a host's shards total at most this


def check_shards(groups: list[list[str]], bad_shards: str = "stop", log=None) -> tuple[list[list[str]], list[int]]:
    """Check every shard against its manifest (sizes always; checksums when the shards are small enough
    to read at open, HASH_AT_OPEN_BYTES). A damaged shard stops the run with one line naming it, or with
    bad_shards="skip" is left out with one warning line. Returns the groups kept and skips per group."""
    import sys
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    total = sum(os.path.getsize(p) for g in groups for p in g)
    kept, skipped = [], []
    for g in groups:
        keep = []
        for p in g:
            problem = records.check_shard(p, checksum=total <= HASH_AT_OPEN_BYTES)
            if problem is None:
                keep.append(p)
            elif bad_shards == "skip":
                log(f"warning: skipping damaged shard {p}: {problem} (data.bad_shards=skip)")
            else:
                raise records.BadShard(f"damaged shard {p}: {problem}; rerun `python -m recipes convert` with the "
                                       f"same arguments (it rewrites only damaged shards), or set data.bad_shards=skip")
        kept.append(keep)
        skipped.append(len(g) - len(keep))
    return kept, skipped


class HostArrayRecords:
    """One grain ArrayRecordDataSource and one metadata table for all ArrayRecord sources of a host."""

    def __init__(self, groups: list[list[str]], skipped: list[int] | None = None):
        import grain
        flat = [p for g in groups for p in g]
        self.paths, self.skipped_shards = flat, skipped or [0] * len(groups)
        tables = [records.MetaTable.load(p + records.META_SUFFIX) for p in flat]
        self.shard_starts = np.cumsum([0] + [len(t) for t in tables]).astype(np.int64)
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

    def read(self, i: int) -> bytes:
        """Record `i`'s bytes; a record ArrayRecord cannot read (its chunk hash fails) is a BadRecord naming
        the shard file, so the loader counts and skips it."""
        try:
            return self.data[i]
        except Exception as exc:  # noqa: BLE001 - riegeli raises plain RuntimeError/ValueError/OSError
            k = int(np.searchsorted(self.shard_starts, i, side="right") - 1)
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise records.BadRecord(f"{self.paths[k]} record {i - int(self.shard_starts[k])} is unreadable "
                                    f"({first})") from None


class ArrayRecordSource(Source):
    """Records [offset, offset + length) of the host's shared ArrayRecord data source."""
    metadata_in_memory = True

    def __init__(self, name: str, host: HostArrayRecords, group: int):
        self.name, self.host = name, host
        self.offset = int(host.offsets[group])
        self.length = int(host.offsets[group + 1] - host.offsets[group])
        self.skipped_shards = int(host.skipped_shards[group])  # damaged shards left out (data.bad_shards=skip)

    def __len__(self) -> int:
        return self.length

    def meta(self, index: int) -> SampleMeta:
        return _with_origin(self.host.table.meta(self.offset + self._check(index)), self.name, index)

    def get(self, index: int) -> Sample:
        raw = self.host.read(self.offset + self._check(index))
        return records.decode(raw, self.name, index)

    def text(self, index: int) -> dict[int, np.ndarray]:
        meta = self.meta(index)
        raw = self.host.read(self.offset + index)
        return records.decode_segments(raw, [k for k, s in enumerate(meta.segments) if s.modality == "text"],
                                       self.name, index)

    def media(self, index: int, k: int) -> np.ndarray:
        raw = self.host.read(self.offset + self._check(index))
        return records.decode_segments(raw, [k], self.name, index)[k]


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
    body = np.concatenate([np.frombuffer(data, np.uint8).astype(np.int32), [tokenizer_mod.EOS]]).astype(np.int32)
    return Sample((Segment("text", np.array([tokenizer_mod.BOS], np.int32)), Segment("text", body, True)), source, index)


# ------------------------------------------------------------------------------------ jsonl
_SCAN = 1 << 20  # bytes per step of the record indexers: memory stays O(records), not O(file)


def index_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges [start, end) of the non-empty lines of a file, read in 1 MiB steps."""
    cuts, size = [], os.path.getsize(path)
    with open(path, "rb") as f:
        off = 0
        while chunk := f.read(_SCAN):
            cuts.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + off)
            off += len(chunk)
    ends = np.concatenate(cuts + [np.array([size], np.int64)]) if cuts else np.array([size], np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep]


_JSON_LUT = np.zeros(256, np.uint8)
_JSON_LUT[[34, 91, 123, 93, 125, 44]] = [1, 2, 2, 3, 3, 4]  # " [ { ] } ,


def index_json_list(path: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Byte ranges of the elements of a top-level JSON list (LLaVA's `.json` files), found by scanning for
    commas at depth 1 outside strings, 1 MiB at a time; no element is parsed. None if the file does not
    start with `[` (then it is read as JSON lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head[:1] != b"[":
        return None
    in_str, depth, carry_bs, bounds, off = 0, 0, 0, [], 0
    with open(path, "rb") as f:
        while chunk := f.read(_SCAN):
            b = np.frombuffer(chunk, np.uint8)
            n = b.size
            pos = np.flatnonzero(_JSON_LUT[b])  # only quotes, brackets and commas matter
            c = _JSON_LUT[b[pos]]
            quote = c == 1
            # a quote right after backslashes is escaped when their run is odd (rare: counted one by one)
            after_bs = quote & (b[np.maximum(pos - 1, 0)] == 92) & (pos > 0) | quote & (pos == 0) & (carry_bs > 0)
            escaped = np.zeros(pos.size, bool)
            cand = np.flatnonzero(after_bs)
            if cand.size:
                q = pos[cand]
                non = np.flatnonzero(b != 92)  # the last non-backslash before q ends the backslash run
                at = np.searchsorted(non, q - 1, side="right") - 1
                k = np.where(at >= 0, non[np.maximum(at, 0)], -1)
                escaped[cand] = (q - 1 - k + np.where(k < 0, carry_bs, 0)) % 2 == 1
            toggle = (quote & ~escaped).astype(np.int64)
            outside = ((in_str + np.cumsum(toggle)) % 2 == 0) & ~quote
            delta = np.where(outside & (c == 2), 1, 0) - np.where(outside & (c == 3), 1, 0)
            after = depth + np.cumsum(delta)
            if after.size and after.min() < 0:
                raise UserError(f"{path}: malformed JSON list (a closing bracket near byte "
                                f"{off + int(pos[np.argmax(after < 0)])})")
            hit = (outside & (c == 4) & (after == 1)) | ((delta == 1) & (after == 1)) | ((delta == -1) & (after == 0))
            bounds.append(pos[hit].astype(np.int64) + off)
            in_str = int((in_str + toggle.sum()) % 2)
            depth = int(after[-1]) if after.size else depth
            if n and b[-1] == 92:
                non = np.flatnonzero(b != 92)
                carry_bs = n - 1 - int(non[-1]) if non.size else n + carry_bs
            else:
                carry_bs = 0
            off += n
    pos = np.concatenate(bounds) if bounds else np.zeros(0, np.int64)
    if depth != 0 or pos.size < 2:
        raise UserError(f"{path}: the JSON list is not closed (truncated file?)")
    starts, ends = pos[:-1] + 1, pos[1:]
    if starts.size == 1:  # "[]" or "[ ]": no element
        with open(path, "rb") as f:
            f.seek(int(starts[0]))
            if not f.read(int(ends[0] - starts[0])).strip():
                return starts[:0], ends[:0]
    return starts, ends


def _media_call(fn, path: Path, modality: str, cfg: Any):
    """media.* readers take the MediaConfig only when one is given."""
    return fn(path, modality) if cfg is None else fn(path, modality, cfg)


class JsonlSource(Source):
    """Records of a JSONL file (one object per line) or of a `.json` file holding a list of objects.

    Each record is {"text": ...}, {"segments": [...]} or a LLaVA-style conversation (omnijax.data.formats).
    Text is tokenized with `tokenizer` (None: byte-level); media paths are relative to the file, or to
    `media_root` when given. Record byte ranges are indexed once at open (16 bytes per record, the file
    itself is scanned 1 MiB at a time); a record is parsed only when it is read.
    """

    def __init__(self, name: str, path: str, tokenizer: Any = None, media_cfg: Any = None, media_root: str = "",
                 index: tuple[np.ndarray, np.ndarray] | None = None):
        if not os.path.exists(path):
            raise UserError(f"missing JSONL file: {path}")
        self.name, self.path = name, path
        self.tok = tokenizer if tokenizer is not None else tokenizer_mod.BYTE_TOKENIZER
        self.media_cfg, self.media_root = media_cfg, media_root
        self.root = Path(media_root) if media_root else Path(path).parent
        if index is None:
            index = (index_json_list(path) if path.endswith(".json") else None) or index_lines(path)
        self._starts, self._ends = (np.asarray(a, np.int64) for a in index)
        self._fd = os.open(path, os.O_RDONLY)

    def __getstate__(self) -> dict:  # a file descriptor means nothing in another process
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    @property
    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """Byte ranges of the records (hand them to another process instead of rescanning the file)."""
        return self._starts, self._ends

    def __len__(self) -> int:
        return len(self._starts)

    def _record(self, index: int) -> Any:
        index = self._check(index)
        raw = os.pread(self._fd, int(self._ends[index] - self._starts[index]), int(self._starts[index]))
        try:
            return json.loads(raw)
        except ValueError:
            raise records.BadRecord(f"{self.name}[{index}]: record {index} (line {index + 1}) of {self.path} is "
                                    f"not valid JSON") from None

    def _resolve(self, p: str) -> Path:
        return Path(p) if os.path.isabs(p) else self.root / p

    def _parts(self, index: int, media_fn) -> list:
        return formats.build(self._record(index), self.tok, media_fn, self._resolve, f"{self.name}[{index}]")

    def meta(self, index: int) -> SampleMeta:
        parts = self._parts(index, media.rated(media.media_shape, self.media_cfg))
        value, fps = media.Rated.value_of, media.Rated.fps_of
        segs = tuple(SegmentMeta(m, tuple(v.shape) if m == "text" else tuple(value(v)), loss, pair=pair, fps=fps(v))
                     for m, v, loss, pair in map(formats.part_fields, parts))
        return SampleMeta(segs, self.name, int(index))

    def get(self, index: int) -> Sample:
        parts = self._parts(index, media.rated(media.load_media, self.media_cfg))
        return Sample(tuple(Segment(m, media.Rated.value_of(v), loss, pair=pair, fps=media.Rated.fps_of(v))
                            for m, v, loss, pair in map(formats.part_fields, parts)), self.name, index)

    def text(self, index: int) -> dict[int, np.ndarray]:
        parts = self._parts(index, lambda p, m: None)  # media files are not opened
        return {k: p[1] for k, p in enumerate(parts) if p[0] == "text"}

    def media(self, index: int, k: int) -> np.ndarray:
        parts = self._parts(index, lambda p, m: (p, m))  # one parse, no media file opened yet
        if not 0 <= k < len(parts) or parts[k][0] == "text":
            raise IndexError(f"{self.name}[{index}]: segment {k} is not a media segment")
        path, modality = parts[k][1]
        return _media_call(media.load_media, path, modality, self.media_cfg)


# ---------------------------------------------------------------------------------- opening
@dataclass
class SourceSpec:
    """One source of a mix. kind: world | arrayrecord | parquet | jsonl (inferred from path if "")."""
    name: str = ""
    kind: str = ""
    path: str = ""
    split: str = "train"   # world only
    size: int = 1_000_000  # world only: number of virtual samples


WORLD = "world"  # the built-in world's name among a recipe's data paths (`data.sources=[world]`)


def check_source_path(key: str, path: str) -> None:
    """One clear line for a data path (under config key `key`) that cannot be read, before anything is loaded."""
    if path == WORLD:
        return
    if any(ch in path for ch in "*?["):
        if not glob.glob(path):
            raise ConfigError(f"{key}: {path} matches no files")
    elif not os.path.exists(path):
        raise ConfigError(f"{key}: {path}: no such folder; write it first with "
                          f"`python -m recipes convert input=YOUR.jsonl output={path}`")


def source_specs(key: str, paths: list[str], split: str) -> list[SourceSpec]:
    """Sources of `paths`: the built-in world by name (its `split`), otherwise folders/globs of converted shards.

    A source is named after its folder (the names `data.mix` uses), so two paths in one folder are an error."""
    specs = []
    for path in paths:
        if path == WORLD:
            specs.append(SourceSpec(name=WORLD, kind="world", split=split))
            continue
        p = Path(path.rstrip("/"))
        while any(ch in p.name for ch in "*?[") and p.parent != p:
            p = p.parent
        specs.append(SourceSpec(name=p.name or path, kind="arrayrecord", path=path))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{key}: two sources are named {dup[0]!r} (a source is named after its folder); "
                          "give each source its own folder")
    return specs


def _kind(spec: SourceSpec) -> str:
    if spec.kind:
        return spec.kind
    if not spec.path or spec.path == "world":
        return "world"
    if spec.path.endswith(".parquet"):
        return "parquet"
    if spec.path.endswith((".jsonl", ".json")):
        return "jsonl"
    return "arrayrecord"


def dataset_folder(pattern: str) -> Path:
    """The folder whose `omnijax_dataset.json` describes the shards matched by `pattern`."""
    p = Path(pattern)
    if p.is_dir():
        return p
    paths = shard_paths(pattern)
    return Path(paths[0]).parent


def dataset_info(folder: str | Path) -> dict | None:
    """`FOLDER/omnijax_dataset.json` written by `recipes convert` (tokenizer fingerprint, vocab size,
    placeholder ids, input, counts), or None for shards written before it existed (byte-level)."""
    return records.read_dataset_info(folder)


def check_dataset_tokenizer(pattern: str, tok: Any = None) -> None:
    """UserError when the shards of `pattern` were tokenized by another tokenizer than `tok` (None: byte-level).

    Shards without `omnijax_dataset.json` predate it and were always byte-level."""
    tok = tok if tok is not None else tokenizer_mod.BYTE_TOKENIZER
    folder = dataset_folder(pattern)
    info = dataset_info(folder)
    have = (info or {}).get("tokenizer", {"fingerprint": tokenizer_mod.BYTE_TOKENIZER.fingerprint,
                                          "name": "byte-level (no omnijax_dataset.json)"})
    if have.get("fingerprint") != tok.fingerprint:
        raise UserError(f"{folder}: shards were tokenized by {have.get('name', '?')} (fingerprint "
                        f"{have.get('fingerprint')}) but the configured tokenizer is {tok.name} (fingerprint "
                        f"{tok.fingerprint}); set tokenizer.path to the one used by `recipes convert`, or reconvert")


def open_sources(specs: list[SourceSpec], world_cfg: Any = None, tokenizer: Any = None,
                 media_cfg: Any = None, bad_shards: str = "stop") -> list[Source]:
    """Open every source once; all ArrayRecord sources share one host-level data source and index.

    `tokenizer` (None: byte-level) tokenizes JSONL text and must be the one ArrayRecord shards were
    converted with (checked against their omnijax_dataset.json; shards without one are byte-level).
    `media_cfg` (omnijax.config.MediaConfig) is how JSONL media files are decoded. Shards are checked
    against their manifests first (`check_shards`; `bad_shards`: "stop" or "skip").
    """
    kinds = [_kind(s) for s in specs]
    bad = [k for k in kinds if k not in ("world", "arrayrecord", "parquet", "jsonl")]
    if bad:
        raise UserError(f"unknown source kind {bad[0]!r}; expected world, arrayrecord, parquet or jsonl")
    names = [s.name or (Path(s.path).stem if s.path else "world") for s in specs]
    if len(set(names)) != len(names):
        raise UserError(f"source names must be unique, got {names}")
    if tokenizer is not None and "jsonl" in kinds:
        formats.check_template(tokenizer)  # fail at open, not as one skipped record per conversation
    groups = [shard_paths(s.path) for s, k in zip(specs, kinds) if k == "arrayrecord"]
    for s, k in zip(specs, kinds):
        if k == "arrayrecord":
            check_dataset_tokenizer(s.path, tokenizer)
    groups, skipped = check_shards(groups, bad_shards)
    host = HostArrayRecords(groups, skipped) if groups else None
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
            out.append(JsonlSource(name, spec.path, tokenizer, media_cfg))
        if len(out[-1]) == 0:
            raise UserError(f"source {name} ({spec.path or kind}) is empty")
    return out
