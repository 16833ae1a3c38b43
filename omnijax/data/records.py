"""Binary record format of one `Sample` (ArrayRecord payloads) and its metadata sidecar.

Record bytes: b"OJX1" | u32 header length | JSON header | raw array bytes. The header lists each
segment's modality, shape, dtype and loss flag, so `read_meta` parses a few hundred bytes and never
touches the arrays; `decode` is `np.frombuffer` (no pickle, no copies beyond the final array).

A shard `x.arrayrecord` has a sidecar `x.arrayrecord.meta.npz` with the metadata of all its records
as flat arrays (segment offsets, modality codes, shapes, loss flags, and the preference-pair role of each
segment where a shard holds pairs): a host loads it once and answers `meta(i)` for any record without
opening the shard.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from omnijax.data.sample import MODALITIES, BadSample, Sample, SampleMeta, Segment, SegmentMeta

MAGIC = b"OJX1"
_DTYPES = {"int32", "float32", "float16", "uint8"}
META_SUFFIX = ".meta.npz"
MAX_RANK = 4


class BadRecord(BadSample):
    """Bytes that do not decode into a sample (truncated, wrong magic, inconsistent header)."""


class BadShard(BadSample):
    """A shard whose files disagree with the manifest written by `recipes convert` (truncated, rewritten)."""


def encode(sample: Sample) -> bytes:
    """Serialise a sample (its arrays keep their dtype; text is stored as int32)."""
    segs, blobs = [], []
    for seg in sample.segments:
        data = np.ascontiguousarray(seg.data)
        if seg.modality == "text":
            data = data.astype(np.int32, copy=False)
        elif seg.modality in ("image", "video"):
            data = _as_uint8_if_exact(data)
        if str(data.dtype) not in _DTYPES:
            data = data.astype(np.float32)
        segs.append({"m": seg.modality, "shape": list(data.shape), "dtype": str(data.dtype), "loss": bool(seg.loss),
                     **({"pair": int(seg.pair)} if seg.pair else {}),
                     **({"fps": float(seg.fps)} if seg.fps else {})})  # a video's kept-frame rate (M-RoPE time)
        blobs.append(data.tobytes())
    header = json.dumps({"segments": segs, "source": sample.source, "index": sample.index}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *blobs])


def _as_uint8_if_exact(data: np.ndarray) -> np.ndarray:
    """Pixels decoded from 8-bit files are exactly k/255: store them as uint8 (4x smaller shards); `decode`
    turns them back into the very same float32 values. Anything else stays as it is."""
    if data.dtype != np.float32 or data.size == 0:
        return data
    u = np.rint(data * np.float32(255.0))
    if not (u.min() >= 0 and u.max() <= 255):
        return data
    u8 = u.astype(np.uint8)
    return u8 if np.array_equal(u8.astype(np.float32) / 255.0, data) else data


def _header(raw: bytes, where: str) -> tuple[dict, int]:
    if len(raw) < 8 or raw[:4] != MAGIC:
        raise BadRecord(f"{where}: not an omnijax record (bad magic or truncated)")
    (n,) = struct.unpack("<I", raw[4:8])
    try:
        header = json.loads(raw[8: 8 + n])
        _ = [(s["m"], s["shape"], s["dtype"], s["loss"]) for s in header["segments"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadRecord(f"{where}: unreadable record header ({exc.__class__.__name__})") from None
    return header, 8 + n


def read_meta(raw: bytes, source: str = "", index: int = -1) -> SampleMeta:
    """Metadata of a record from its header only."""
    header, _ = _header(raw, f"{source}[{index}]")
    return SampleMeta(tuple(SegmentMeta(s["m"], tuple(s["shape"]), bool(s["loss"]), pair=int(s.get("pair", 0)),
                                        fps=float(s.get("fps", 0.0))) for s in header["segments"]), source, index)


def decode(raw: bytes, source: str = "", index: int = -1) -> Sample:
    """Sample from record bytes; BadRecord if the bytes are inconsistent. Values are not validated here."""
    header, _ = _header(raw, f"{source}[{index}]")
    data = decode_segments(raw, range(len(header["segments"])), source, index)
    return Sample(tuple(Segment(s["m"], data[k], bool(s["loss"]), pair=int(s.get("pair", 0)),
                                fps=float(s.get("fps", 0.0))) for k, s in enumerate(header["segments"])), source, index)


def decode_segments(raw: bytes, which, source: str = "", index: int = -1) -> dict[int, np.ndarray]:
    """Data of segments `which` only (by position): the others are skipped over, not converted."""
    where = f"{source}[{index}]"
    header, pos = _header(raw, where)
    which = set(int(k) for k in which)
    out = {}
    for k, s in enumerate(header["segments"]):
        if s["dtype"] not in _DTYPES or s["m"] not in MODALITIES:
            raise BadRecord(f"{where}: segment with modality {s['m']!r} dtype {s['dtype']!r} is not supported")
        dtype = np.dtype(s["dtype"])
        n = int(np.prod(s["shape"], dtype=np.int64)) * dtype.itemsize
        if pos + n > len(raw):
            raise BadRecord(f"{where}: record truncated ({len(raw)} bytes, header needs {pos + n})")
        if k in which:
            data = np.frombuffer(raw, dtype, count=n // dtype.itemsize, offset=pos).reshape(s["shape"])
            if s["m"] != "text" and dtype != np.float32:
                data = data.astype(np.float32) / (255.0 if dtype == np.uint8 else 1.0)
            out[k] = data
        pos += n
    return out


# ------------------------------------------------------------------------------ sidecars
_CODE = {m: i for i, m in enumerate(MODALITIES)}


class MetaTable:
    """Metadata of many records as flat arrays (compact: ~20 bytes per segment)."""

    def __init__(self, seg_offsets: np.ndarray, modality: np.ndarray, shape: np.ndarray, loss: np.ndarray,
                 pair: np.ndarray | None = None, fps: np.ndarray | None = None):
        self.seg_offsets = np.asarray(seg_offsets, np.int64)
        self.modality = np.asarray(modality, np.uint8)
        self.shape = np.asarray(shape, np.int32).reshape(-1, MAX_RANK)
        self.loss = np.asarray(loss, bool)
        self.pair = np.zeros(len(self.loss), np.uint8) if pair is None else np.asarray(pair, np.uint8)
        # a video's kept-frame rate (0: not recorded; sidecars written before it have none)
        self.fps = np.zeros(len(self.loss), np.float32) if fps is None else np.asarray(fps, np.float32)

    def __len__(self) -> int:
        return len(self.seg_offsets) - 1

    @classmethod
    def from_metas(cls, metas: list[SampleMeta]) -> "MetaTable":
        offsets = np.zeros(len(metas) + 1, np.int64)
        mods, shapes, loss, pair, fps = [], [], [], [], []
        for i, m in enumerate(metas):
            offsets[i + 1] = offsets[i] + len(m.segments)
            for s in m.segments:
                if len(s.shape) > MAX_RANK:
                    raise BadSample(f"segment shape {s.shape} has more than {MAX_RANK} dimensions")
                mods.append(_CODE[s.modality])
                shapes.append(list(s.shape) + [-1] * (MAX_RANK - len(s.shape)))
                loss.append(s.loss)
                pair.append(s.pair)
                fps.append(s.fps)
        return cls(offsets, np.array(mods, np.uint8), np.array(shapes, np.int32).reshape(-1, MAX_RANK),
                   np.array(loss, bool), np.array(pair, np.uint8), np.array(fps, np.float32))

    def meta(self, i: int, source: str = "") -> SampleMeta:
        lo, hi = int(self.seg_offsets[i]), int(self.seg_offsets[i + 1])
        mods, shapes, loss = self.modality[lo:hi].tolist(), self.shape[lo:hi].tolist(), self.loss[lo:hi].tolist()
        pair, fps = self.pair[lo:hi].tolist(), self.fps[lo:hi].tolist()
        segs = tuple(SegmentMeta(MODALITIES[m], tuple(d for d in sh if d >= 0), lo_, pair=p, fps=f)
                     for m, sh, lo_, p, f in zip(mods, shapes, loss, pair, fps))
        return SampleMeta(segs, source, int(i))

    def save(self, path: str | Path) -> None:
        with open(path, "wb") as f:
            extra = {"pair": self.pair} if self.pair.any() else {}  # shards without pairs: the format as before
            extra.update({"fps": self.fps} if self.fps.any() else {})  # likewise without videos
            np.savez(f, seg_offsets=self.seg_offsets, modality=self.modality, shape=self.shape, loss=self.loss, **extra)

    @classmethod
    def load(cls, path: str | Path) -> "MetaTable":
        with np.load(path) as z:
            return cls(z["seg_offsets"], z["modality"], z["shape"], z["loss"], z["pair"] if "pair" in z else None,
                       z["fps"] if "fps" in z else None)

    @classmethod
    def concat(cls, tables: list["MetaTable"]) -> "MetaTable":
        if not tables:
            return cls(np.zeros(1, np.int64), np.zeros(0, np.uint8), np.zeros((0, MAX_RANK), np.int32), np.zeros(0, bool))
        offs, base = [np.zeros(1, np.int64)], 0
        for t in tables:
            offs.append(t.seg_offsets[1:] + base)
            base += int(t.seg_offsets[-1])
        return cls(np.concatenate(offs), np.concatenate([t.modality for t in tables]),
                   np.concatenate([t.shape for t in tables]), np.concatenate([t.loss for t in tables]),
                   np.concatenate([t.pair for t in tables]), np.concatenate([t.fps for t in tables]))


# -------------------------------------------------------------------------------- writing
DATASET_JSON = "omnijax_dataset.json"
MANIFEST_SUFFIX = ".manifest.json"


class _MetaBuilder:
    """Metadata of the records written so far, in flat typed arrays (about 20 bytes per segment), so a
    shard of a million records does not hold a million Python objects."""

    def __init__(self):
        from array import array
        self.offsets, self.mods, self.shapes, self.loss = array("q", [0]), array("B"), array("i"), array("B")
        self.pair, self.fps = array("B"), array("f")

    def add(self, meta: SampleMeta) -> None:
        for s in meta.segments:
            if len(s.shape) > MAX_RANK:
                raise BadSample(f"segment shape {s.shape} has more than {MAX_RANK} dimensions")
            self.mods.append(_CODE[s.modality])
            self.shapes.extend(list(s.shape) + [-1] * (MAX_RANK - len(s.shape)))
            self.loss.append(bool(s.loss))
            self.pair.append(int(s.pair))
            self.fps.append(float(s.fps))
        self.offsets.append(self.offsets[-1] + len(meta.segments))

    def table(self) -> MetaTable:
        return MetaTable(np.frombuffer(self.offsets, np.int64), np.frombuffer(self.mods, np.uint8),
                         np.frombuffer(self.shapes, np.int32).reshape(-1, MAX_RANK),
                         np.frombuffer(self.loss, np.uint8).astype(bool), np.frombuffer(self.pair, np.uint8),
                         np.frombuffer(self.fps, np.float32))


def write_shard(path: str | Path, samples) -> int:
    """Write samples to one ArrayRecord shard plus its metadata sidecar; returns the record count.

    group_size:1 keeps every record in its own chunk, the layout for random access. `samples` may be
    any iterable: it is consumed one sample at a time.
    """
    from array_record.python.array_record_module import ArrayRecordWriter
    path = str(path)
    metas = _MetaBuilder()
    writer = ArrayRecordWriter(path, "group_size:1")
    try:
        for s in samples:
            writer.write(encode(s))
            metas.add(s.meta())
    finally:
        writer.close()
    table = metas.table()
    table.save(path + META_SUFFIX)
    return len(table)


def write_json_atomic(path: str | Path, obj: dict) -> None:
    """Write JSON to `path.tmp`, fsync, then rename: readers see the old file or the whole new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard_atomic(path: str | Path, samples, spec: dict, extra=None) -> dict:
    """`write_shard` through temporary names, then renames (sidecar, shard, manifest last).

    The manifest `path.manifest.json` holds `spec` (what the shard was made from) plus the record count
    and both files' sizes: `shard_complete` trusts a shard only when all three agree. `extra()` (called
    once the samples are consumed) adds fields such as the count of skipped records. Returns it.
    """
    path = str(path)
    tmp = path + ".tmp"
    for p in (path + MANIFEST_SUFFIX, tmp, tmp + META_SUFFIX):
        if os.path.exists(p):
            os.remove(p)
    n = write_shard(tmp, samples)
    for p in (tmp, tmp + META_SUFFIX):
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp + META_SUFFIX, path + META_SUFFIX)
    os.replace(tmp, path)
    manifest = {"spec": spec, "records": n, "bytes": os.path.getsize(path),
                "meta_bytes": os.path.getsize(path + META_SUFFIX), "sha256": file_sha256(path),
                "meta_sha256": file_sha256(path + META_SUFFIX), **(extra() if extra else {})}
    write_json_atomic(path + MANIFEST_SUFFIX, manifest)
    return manifest


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file (hashlib reads it in blocks; about 1 GB/s on one core)."""
    import hashlib
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_shard(path: str | Path, checksum: bool = True) -> str | None:
    """What is wrong with a shard against its manifest (None: consistent, or no manifest to check against).

    Sizes and the sidecar's record count always (a stat and a small read); the SHA-256 of both files
    when `checksum` (a full read: the caller decides when that is cheap). Records inside a shard are
    also protected by ArrayRecord's own per-chunk hashes, checked whenever a record is read."""
    path = str(path)
    try:
        with open(path + MANIFEST_SUFFIX) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None  # shards written by hand or by an older convert: nothing to compare with
    except (OSError, ValueError) as exc:
        return f"its manifest {path + MANIFEST_SUFFIX} is unreadable ({exc.__class__.__name__})"
    try:
        for p, size_key, hash_key in ((path, "bytes", "sha256"), (path + META_SUFFIX, "meta_bytes", "meta_sha256")):
            have = os.path.getsize(p)
            if have != manifest[size_key]:
                return f"{os.path.basename(p)} has {have} bytes, its manifest says {manifest[size_key]} (truncated or rewritten)"
        if len(MetaTable.load(path + META_SUFFIX)) != manifest["records"]:
            return f"its sidecar does not describe the manifest's {manifest['records']} records"
        if checksum:
            for p, hash_key in ((path, "sha256"), (path + META_SUFFIX, "meta_sha256")):
                if hash_key in manifest and file_sha256(p) != manifest[hash_key]:
                    return f"{os.path.basename(p)} has the right size but different bytes (checksum mismatch)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"it cannot be checked ({exc.__class__.__name__}: {exc})"
    return None


def shard_complete(path: str | Path, spec: dict) -> dict | None:
    """The shard's manifest if shard, sidecar and manifest are all present, consistent, and made from
    `spec`; None means the shard must be (re)written."""
    path = str(path)
    try:
        with open(path + MANIFEST_SUFFIX) as f:
            manifest = json.load(f)
        if manifest.get("spec") != json.loads(json.dumps(spec)):
            return None
        if (os.path.getsize(path) != manifest["bytes"]
                or os.path.getsize(path + META_SUFFIX) != manifest["meta_bytes"]):
            return None
        if len(MetaTable.load(path + META_SUFFIX)) != manifest["records"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def read_dataset_info(folder: str | Path) -> dict | None:
    """FOLDER/omnijax_dataset.json, or None when absent. An unreadable one is a UserError."""
    from omnijax.errors import UserError
    path = Path(folder) / DATASET_JSON
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); rerun `python -m recipes convert`") from None
    if not isinstance(info, dict):
        raise UserError(f"{path}: expected a JSON object; rerun `python -m recipes convert`")
    return info
