"""Media files referenced by JSONL records: .npy arrays, WAV audio and PNG images, numpy only.

Each format has a `*_shape` reader that parses the header alone (what metadata needs) and a loader
that returns the sample-format array (images/videos float32 in [0, 1], audio float32 mono at 16 kHz).
Unsupported or corrupt files raise `BadSample` naming the file.
"""
from __future__ import annotations

import struct
import wave
import zlib
from pathlib import Path

import numpy as np

from omnijax.data.sample import SAMPLE_RATE, BadSample

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------- npy
def npy_shape(path: Path) -> tuple[int, ...]:
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, _, _ = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                           else np.lib.format.read_array_header_2_0(f))
        return tuple(int(d) for d in shape)
    except (ValueError, OSError) as exc:
        raise BadSample(f"{path}: not a readable .npy file ({exc})") from None


def load_npy(path: Path, modality: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise BadSample(f"{path}: not a readable .npy file ({exc})") from None
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    elif modality == "audio" and arr.dtype == np.int16:
        arr = arr.astype(np.float32) / 32768.0
    return np.asarray(arr, np.float32)


# ------------------------------------------------------------------------------------- wav
def _resampled_len(n: int, rate: int) -> int:
    return n if rate == SAMPLE_RATE else int(round(n * SAMPLE_RATE / rate))


def wav_shape(path: Path) -> tuple[int]:
    try:
        with wave.open(str(path), "rb") as w:
            return (_resampled_len(w.getnframes(), w.getframerate()),)
    except (wave.Error, EOFError, OSError) as exc:
        raise BadSample(f"{path}: not a readable WAV file ({exc})") from None


def load_wav(path: Path) -> np.ndarray:
    """PCM WAV (8/16/32-bit) -> float32 mono at 16 kHz (channels averaged, linear resampling)."""
    try:
        with wave.open(str(path), "rb") as w:
            ch, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError, OSError) as exc:
        raise BadSample(f"{path}: not a readable WAV file ({exc})") from None
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 4:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    else:
        raise BadSample(f"{path}: {8 * width}-bit WAV is not supported (8, 16 or 32-bit PCM)")
    x = x[: (x.size // ch) * ch].reshape(-1, ch).mean(axis=1)
    m = _resampled_len(x.size, rate)
    if m != x.size:
        x = np.interp(np.arange(m) * (rate / SAMPLE_RATE), np.arange(x.size), x).astype(np.float32)
    return x.astype(np.float32)


def write_wav(path: Path, wave_f32: np.ndarray, rate: int = SAMPLE_RATE) -> None:
    pcm = (np.clip(wave_f32, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


# ------------------------------------------------------------------------------------- png
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}


def _png_chunks(data: bytes, path: Path):
    if data[:8] != PNG_SIGNATURE:
        raise BadSample(f"{path}: not a PNG file")
    pos = 8
    while pos + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[pos: pos + 8])
        yield kind, data[pos + 8: pos + 8 + n]
        pos += 12 + n


def _ihdr(data: bytes, path: Path) -> tuple[int, int, int, int, int]:
    for kind, body in _png_chunks(data, path):
        if kind == b"IHDR" and len(body) >= 13:
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body[:13])
            return h, w, depth, ctype, interlace
        break
    raise BadSample(f"{path}: PNG without IHDR header")


def png_shape(path: Path) -> tuple[int, int, int]:
    try:
        with open(path, "rb") as f:
            head = f.read(33)
    except OSError as exc:
        raise BadSample(f"{path}: cannot read ({exc})") from None
    h, w, _, _, _ = _ihdr(head, path)
    return (h, w, 3)


def load_png(path: Path) -> np.ndarray:
    """8-bit, non-interlaced PNG (grey, grey+alpha, RGB, RGBA) -> float32 [H, W, 3] in [0, 1]."""
    data = Path(path).read_bytes()
    h, w, depth, ctype, interlace = _ihdr(data, path)
    if depth != 8 or ctype not in _CHANNELS or interlace:
        raise BadSample(f"{path}: only 8-bit non-interlaced grey/RGB(A) PNGs are supported "
                        f"(bit depth {depth}, colour type {ctype}, interlace {interlace})")
    c = _CHANNELS[ctype]
    try:
        raw = zlib.decompress(b"".join(body for kind, body in _png_chunks(data, path) if kind == b"IDAT"))
    except zlib.error as exc:
        raise BadSample(f"{path}: corrupt PNG data ({exc})") from None
    stride = w * c
    if len(raw) != h * (stride + 1):
        raise BadSample(f"{path}: PNG data has {len(raw)} bytes, expected {h * (stride + 1)}")
    rows = np.frombuffer(raw, np.uint8).reshape(h, stride + 1)
    out = np.zeros((h, w, c), np.int32)
    prev = np.zeros((w, c), np.int32)
    for y in range(h):
        kind, line = rows[y, 0], rows[y, 1:].reshape(w, c).astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 1:  # Sub: running sum along the row
            cur = np.cumsum(line, axis=0) % 256
        elif kind == 2:  # Up
            cur = (line + prev) % 256
        elif kind in (3, 4):  # Average / Paeth depend on the left pixel: walk the row
            cur = np.empty_like(line)
            left = np.zeros(c, np.int32)
            upleft = np.zeros(c, np.int32)
            for x in range(w):
                up = prev[x]
                if kind == 3:
                    pred = (left + up) // 2
                else:
                    p = left + up - upleft
                    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - upleft)
                    pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
                cur[x] = (line[x] + pred) % 256
                left, upleft = cur[x], up
        else:
            raise BadSample(f"{path}: PNG row {y} has unknown filter {kind}")
        out[y] = cur
        prev = cur
    img = out.astype(np.float32) / 255.0
    if c in (1, 2):
        img = np.repeat(img[..., :1], 3, axis=-1)
    return np.ascontiguousarray(img[..., :3])


def write_png(path: Path, img: np.ndarray) -> None:
    """Minimal RGB PNG writer (filter 0), used by tests and examples."""
    px = np.clip(np.round(np.asarray(img) * 255), 0, 255).astype(np.uint8)
    h, w, _ = px.shape
    raw = b"".join(b"\x00" + px[y].tobytes() for y in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    Path(path).write_bytes(PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


# --------------------------------------------------------------------------------- dispatch
def media_shape(path: Path, modality: str) -> tuple[int, ...]:
    suffix = path.suffix.lower()
    if not path.exists():
        raise BadSample(f"media file not found: {path}")
    if suffix == ".npy":
        return npy_shape(path)
    if suffix == ".wav" and modality == "audio":
        return wav_shape(path)
    if suffix == ".png" and modality == "image":
        return png_shape(path)
    raise BadSample(f"{path}: {modality} files must be .npy" + (", .wav" if modality == "audio" else "")
                    + (", .png" if modality == "image" else ""))


def load_media(path: Path, modality: str) -> np.ndarray:
    suffix = path.suffix.lower()
    if not path.exists():
        raise BadSample(f"media file not found: {path}")
    if suffix == ".npy":
        return load_npy(path, modality)
    if suffix == ".wav" and modality == "audio":
        return load_wav(path)
    if suffix == ".png" and modality == "image":
        return load_png(path)
    raise BadSample(f"{path}: unsupported file type for {modality}")
