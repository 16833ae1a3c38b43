"""safetensors files read by slices and written tensor by tensor (no whole model in host memory).

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw row-major data. Reading uses `os.pread` of contiguous row ranges in bounded
chunks instead of a memory map: a mapped file's touched pages count in the process's resident set
until it is unmapped, which would charge every host for the slices it merely passed over. Writing
streams each tensor after a header computed from the shapes alone, so an exporter holds one tensor
at a time.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from omnijax.errors import UserError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
CHUNK_BYTES = 4 << 20  # rows are read in pieces of at most this size


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in `file`


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """name -> TensorInfo and the `__metadata__` of one safetensors file (header bytes only)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
            data_bytes = os.fstat(f.fileno()).st_size - 8 - n
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, h in header.items():
        out[name] = _tensor_info(path, name, h, 8 + n, data_bytes)
    spans = sorted((t.offset, t.offset + t.dtype.itemsize * int(np.prod(t.shape, dtype=np.int64)), name)
                   for name, t in out.items())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise UserError(f"{path}: tensors {first!r} and {second!r} claim the same bytes (data_offsets overlap); "
                            "the file is damaged")
    return out, meta


def _tensor_info(path: Path, name: str, h: object, base: int, data_bytes: int) -> TensorInfo:
    """One header entry, checked: its byte range lies in the file's data and holds exactly shape x dtype
    (a range that disagrees would read a neighbouring tensor's bytes as this one)."""
    bad = f"{path}: tensor {name!r} has a malformed header entry"
    if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= set(h):
        missing = sorted({"dtype", "shape", "data_offsets"} - set(h)) if isinstance(h, dict) else []
        raise UserError(f"{bad} ({'no ' + ', '.join(missing) if missing else repr(h)}); the file is damaged")
    if h["dtype"] not in DTYPES:
        raise UserError(f"{path}: tensor {name!r} has dtype {h['dtype']} which omnijax does not read")
    shape, offsets = h["shape"], h["data_offsets"]
    if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise UserError(f"{bad} (shape {shape!r}, data_offsets {offsets!r}); the file is damaged")
    dtype = np.dtype(DTYPES[h["dtype"]])
    begin, end = offsets
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not 0 <= begin <= end <= data_bytes or end - begin != size:
        raise UserError(f"{path}: tensor {name!r} claims bytes [{begin}, {end}) of the file's {data_bytes} data "
                        f"bytes, but {h['dtype']} {list(shape)} is {size} bytes; the file is damaged or truncated")
    return TensorInfo(path, dtype, tuple(shape), base + begin)


class TensorIndex:
    """Every tensor of a Hugging Face folder: one `*.safetensors` or many with `model.safetensors.index.json`."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                data = json.loads(index.read_text())
            except json.JSONDecodeError as exc:
                raise UserError(f"{index}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            weight_map = (data.get("weight_map") if isinstance(data, dict) else None) or {}
            if not isinstance(weight_map, dict):
                raise UserError(f"{index}: weight_map is not a mapping of tensor names to files")
            outside = [f for f in weight_map.values() if not isinstance(f, str) or Path(f).is_absolute()
                       or Path(f).name != f]
            if outside:
                raise UserError(f"{index}: weight_map names {outside[0]!r}, not a file of this folder")
            files = sorted({folder / f for f in weight_map.values()})
            if not files:
                raise UserError(f"{index}: empty weight_map")
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise UserError(f"{index} lists missing file(s) {', '.join(missing[:3])}; copy the whole folder")
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"{folder}: no *.safetensors weights (omnijax reads safetensors, not .bin; re-save "
                                "with save_pretrained(safe_serialization=True))")
        self.folder, self.files = folder, files
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            self.tensors.update(read_header(f)[0])

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise UserError(f"{self.folder}: no tensor {name!r} in {', '.join(f.name for f in self.files)} (a folder "
                            "of another model, or incomplete?)") from None

    def read(self, name: str, rows: tuple[int, int] | None = None, rest: tuple[slice, ...] = ()) -> np.ndarray:
        """tensor[rows[0]:rows[1]][:, *rest] in its stored dtype, reading only rows [rows) from disk."""
        t = self.info(name)
        if not t.shape:
            return self._pread(t, 0, t.dtype.itemsize).view(t.dtype).reshape(())
        lo, hi = rows if rows is not None else (0, t.shape[0])
        if not 0 <= lo <= hi <= t.shape[0]:
            raise ValueError(f"{name}: rows [{lo}, {hi}) outside its {t.shape[0]} rows")
        row_elems = int(np.prod(t.shape[1:], dtype=np.int64))
        row_bytes = max(1, row_elems * t.dtype.itemsize)
        step = max(1, CHUNK_BYTES // row_bytes)
        parts = []
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            raw = self._pread(t, a * row_bytes, (b - a) * row_bytes)
            block = raw.view(t.dtype).reshape((b - a,) + t.shape[1:])
            parts.append(np.ascontiguousarray(block[(slice(None),) + tuple(rest)]) if rest else block)
        if not parts:
            return np.zeros((0,) + t.shape[1:], t.dtype)[(slice(None),) + tuple(rest)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_box(self, name: str, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """tensor viewed as 2-D [rows, columns] (trailing dims flattened; 1-D as one column), block
        [rows[0]:rows[1], cols[0]:cols[1]], reading only that block's bytes: whole rows in bounded chunks
        when it spans (almost) every column, else each row's column span by itself."""
        t = self.info(name)
        n_rows = t.shape[0] if t.shape else 1
        width = int(np.prod(t.shape[1:], dtype=np.int64)) if t.shape else 1
        (r0, r1), (c0, c1) = rows, cols
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= width):
            raise ValueError(f"{name}: block rows [{r0}, {r1}) x columns [{c0}, {c1}) outside {n_rows} x {width}")
        size = t.dtype.itemsize
        if (c1 - c0) * 10 >= width * 9:  # reading the rest of each row costs at most 1.1x
            out = np.empty((r1 - r0, c1 - c0), t.dtype)
            step = max(1, CHUNK_BYTES // max(1, width * size))
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                block = self._pread(t, a * width * size, (b - a) * width * size).view(t.dtype).reshape(b - a, width)
                out[a - r0: b - r0] = block[:, c0:c1]
            return out
        out = np.empty((r1 - r0, c1 - c0), t.dtype)
        flat = out.reshape(-1).view(np.uint8)
        span = (c1 - c0) * size
        fd = os.open(t.file, os.O_RDONLY)
        try:
            for i in range(r1 - r0):
                view, done, at = memoryview(flat[i * span: (i + 1) * span]), 0, t.offset + ((r0 + i) * width + c0) * size
                while done < span:
                    n = os.preadv(fd, [view[done:]], at + done)
                    if n <= 0:
                        raise UserError(f"{t.file}: truncated (tensor data ends early); the file is incomplete")
                    done += n
        finally:
            os.close(fd)
        return out

    @staticmethod
    def _pread(t: TensorInfo, start: int, size: int) -> np.ndarray:
        buf = bytearray(size)
        fd = os.open(t.file, os.O_RDONLY)
        try:
            view, done = memoryview(buf), 0
            while done < size:
                n = os.preadv(fd, [view[done:]], t.offset + start + done)
                if n <= 0:
                    raise UserError(f"{t.file}: truncated (tensor data ends early); the file is incomplete")
                done += n
        finally:
            os.close(fd)
        return np.frombuffer(buf, np.uint8)


def write_file(path: Path, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
               produce: Iterator[np.ndarray], metadata: dict | None = None) -> None:
    """Write a safetensors file whose header lists `tensors` (name, shape, dtype) in order, then each
    array that `produce` yields (one at a time, same order and shapes)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    specs = list(tensors)
    for name, shape, dtype in specs:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, shape, dtype), arr in zip(specs, produce):
            arr = np.ascontiguousarray(arr, dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {arr.shape}, header says {tuple(shape)}")
            f.write(arr.reshape(-1).view(np.uint8).data)  # the array's own bytes, no copy
