"""Media files referenced by JSONL records: images (Pillow), video (PyAV), audio (soundfile + soxr), `.npy`.

Two entry points per file: `media_shape` reads headers/containers only (what the planner's metadata needs,
no pixels or samples decoded) and `load_media` decodes to the sample format (images float32 [H, W, 3] and
videos float32 [T, H, W, 3] in [0, 1], audio float32 mono [N] at 16 kHz). Both derive their shape from
the same header facts, so `load_media(p).shape == media_shape(p)` holds even when a container's header
is loose (a video shorter than it claims gets its last frame repeated; audio is padded to the header's
frame count). Every failure is a `BadSample` naming the file and saying whether the format is
unsupported (a gap in what we read) or the file is corrupt (bad data), so the two are told apart.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from omnijax.config import MediaConfig
from omnijax.data.sample import SAMPLE_RATE, BadSample
from omnijax.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".mp3")
SUFFIXES = {"image": IMAGE_SUFFIXES, "video": VIDEO_SUFFIXES, "audio": AUDIO_SUFFIXES}
_PIL_FORMATS = ("JPEG", "PNG", "WEBP", "BMP")  # Image.open tries only these decoders
_MIN_AUDIO_RATE = 1000  # below this a "sample rate" is a broken header; soxr's output would explode


def _corrupt(path: Path, what: str, exc: BaseException) -> BadSample:
    return BadSample(f"{path}: corrupt or truncated {what} ({type(exc).__name__}: {exc})")


# ------------------------------------------------------------------------------------- npy
def npy_shape(path: Path) -> tuple[int, ...]:
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, _, _ = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                           else np.lib.format.read_array_header_2_0(f))
        return tuple(int(d) for d in shape)
    except (ValueError, OSError, SyntaxError) as exc:
        raise BadSample(f"{path}: not a readable .npy file ({exc})") from None


def load_npy(path: Path, modality: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise BadSample(f"{path}: not a readable .npy file ({exc})") from None
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    elif modality == "audio" and arr.dtype == np.int16:
        arr = arr.astype(np.float32) / 32768.0
    return np.asarray(arr, np.float32)


# ----------------------------------------------------------------------------------- images
# EXIF orientation (tag 0x0112) -> the transpose that shows the picture upright (EXIF 2.3, section 4.6.4).
_ORIENT_SWAPS_AXES = (5, 6, 7, 8)


def _transpose_method(orientation: int):
    from PIL import Image
    T = Image.Transpose
    return {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM, 5: T.TRANSPOSE,
            6: T.ROTATE_270, 7: T.TRANSVERSE, 8: T.ROTATE_90}.get(orientation)


def _open_image(path: Path):
    from PIL import Image
    try:
        return Image.open(path, formats=_PIL_FORMATS)  # lazy: parses the header, decodes nothing
    except Exception as exc:  # UnidentifiedImageError, SyntaxError, struct.error, DecompressionBombError...
        raise _corrupt(path, "image", exc) from None


def _orientation(im) -> int:
    """EXIF orientation from what `Image.open` already parsed (never `getexif()`, which loads a PNG's pixels).

    The loader uses this same value, so shape and pixels agree even for an eXIf chunk after the PNG data."""
    raw = im.info.get("exif")
    if not raw:
        return 1
    from PIL import Image
    try:
        exif = Image.Exif()
        exif.load(raw)
        o = int(exif.get(0x0112, 1))
    except Exception:  # an unreadable EXIF block is not a broken image: show it as stored
        return 1
    return o if 1 <= o <= 8 else 1


def image_shape(path: Path) -> tuple[int, int, int]:
    with _open_image(path) as im:
        w, h = im.size
        if _orientation(im) in _ORIENT_SWAPS_AXES:
            w, h = h, w
    if h <= 0 or w <= 0:
        raise BadSample(f"{path}: empty image ({w}x{h})")
    return (h, w, 3)


def load_image(path: Path) -> np.ndarray:
    """Any Pillow mode -> float32 RGB in [0, 1], EXIF-upright.

    16-bit greyscale (I;16*, I) scales by 65535. Transparency (RGBA, LA, PA, palette with tRNS) is
    composited onto WHITE: transparent logos, icons and scanned text are mostly dark ink on nothing,
    which a black background would erase."""
    with _open_image(path) as im:
        orientation = _orientation(im)
        try:
            im.load()
            if orientation != 1:
                im = im.transpose(_transpose_method(orientation))
            img = _to_rgb_f32(im)
        except BadSample:
            raise
        except Exception as exc:  # OSError("image file is truncated"), zlib/struct errors, ...
            raise _corrupt(path, "image", exc) from None
    if img.shape[0] == 0 or img.shape[1] == 0:
        raise BadSample(f"{path}: empty image {img.shape[:2]}")
    return img


def _to_rgb_f32(im) -> np.ndarray:
    mode = im.mode
    if mode.startswith("I;16") or mode == "I":  # 16-bit greyscale PNG/TIFF data (I holds it as int32)
        a = np.asarray(im).astype(np.float32) / 65535.0
        return np.repeat(np.clip(a, 0.0, 1.0)[..., None], 3, axis=-1)
    if mode == "F":
        return np.repeat(np.clip(np.asarray(im, np.float32), 0.0, 1.0)[..., None], 3, axis=-1)
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or (mode == "P" and "transparency" in im.info):
        a = np.asarray(im.convert("RGBA"), np.float32) / 255.0
        alpha = a[..., 3:4]
        return np.ascontiguousarray(a[..., :3] * alpha + (1.0 - alpha))
    if mode != "RGB":
        im = im.convert("RGB")  # 1, L, P, CMYK, YCbCr, LAB...
    return np.asarray(im, np.float32) / 255.0


def write_image(path: Path, img: np.ndarray, quality: int = 95) -> None:
    """float [H, W], [H, W, 3] or [H, W, 4] in [0, 1] -> 8-bit file; the format comes from the suffix."""
    from PIL import Image
    px = np.clip(np.round(np.asarray(img, np.float64) * 255), 0, 255).astype(np.uint8)
    suffix = Path(path).suffix.lower()
    if suffix not in IMAGE_SUFFIXES:
        raise ValueError(f"{path}: write_image writes {', '.join(IMAGE_SUFFIXES)}")
    im = Image.fromarray(px)
    if suffix in (".jpg", ".jpeg") and im.mode != "RGB":
        im = im.convert("RGB")
    kw = {"quality": quality} if suffix in (".jpg", ".jpeg", ".webp") else {}
    im.save(path, **kw)


# ------------------------------------------------------------------------------------ video
# Targets further apart than this (seconds) are reached by seeking to the keyframe before them instead of
# decoding every frame in between (a module constant so tests can force either path).
SEEK_GAP_S = 1.0


def _open_video(path: Path):
    import av
    try:
        container = av.open(str(path))
    except Exception as exc:  # av.error.InvalidDataError etc.
        raise _corrupt(path, "video", exc) from None
    if not container.streams.video:
        container.close()
        raise BadSample(f"{path}: corrupt or truncated video (no video stream)")
    return container


def _probe(path: Path, container) -> tuple[object, Fraction, Fraction | None, int, int]:
    """(stream, duration in seconds, frame rate, height, width) from the container's headers, nothing decoded.

    Duration: the stream's own (mp4: exact sum of sample durations) > frame count / rate > the container's
    (mkv/webm carry no per-stream duration) > the packets' timestamps (demuxed, not decoded)."""
    try:
        return _probe_header(path, container)
    except BadSample:
        raise
    except Exception as exc:  # a damaged header: no codec context, nonsense rates...
        raise _corrupt(path, "video", exc) from None


def _probe_header(path: Path, container) -> tuple[object, Fraction, Fraction | None, int, int]:
    s = container.streams.video[0]
    if s.codec_context is None:
        raise BadSample(f"{path}: corrupt or truncated video (unknown video codec)")
    h, w = int(s.codec_context.height or 0), int(s.codec_context.width or 0)
    if h <= 0 or w <= 0:
        raise BadSample(f"{path}: corrupt or truncated video (frame size {w}x{h})")
    tb = Fraction(s.time_base) if s.time_base else None
    rate = s.average_rate or s.guessed_rate
    if s.duration and tb:
        dur = Fraction(int(s.duration)) * tb
    elif s.frames and rate:
        dur = Fraction(int(s.frames)) / Fraction(rate)
    elif container.duration:
        dur = Fraction(int(container.duration) - int(container.start_time or 0), 1_000_000)
    else:
        dur = _demux_duration(path, container, s, tb, rate)
    return s, max(dur, Fraction(0)), (Fraction(rate) if rate else None), h, w


def _demux_duration(path: Path, container, s, tb, rate) -> Fraction:
    lo, hi, n = None, None, 0
    try:
        for pkt in container.demux(s):
            if pkt.size == 0:
                continue
            n += 1
            if pkt.pts is not None:
                end = pkt.pts + (pkt.duration or 0)
                lo = pkt.pts if lo is None else min(lo, pkt.pts)
                hi = end if hi is None else max(hi, end)
        container.seek(0)
    except Exception as exc:
        raise _corrupt(path, "video", exc) from None
    if lo is not None and tb and hi > lo:
        return Fraction(hi - lo) * tb
    return Fraction(n) / Fraction(rate) if rate and n else Fraction(0)


def frame_times(duration: Fraction, cfg: MediaConfig, rate: Fraction | None = None) -> list[Fraction]:
    """Seconds (from the first frame) of the frames kept: k / fps for every k / fps < duration, at least
    one, where fps = video_fps but never above the stream's own rate (no duplicated frames); over
    max_video_frames, that many spread evenly over the whole clip (coverage beats keeping its first seconds)."""
    fps = Fraction(cfg.video_fps).limit_denominator(1_000_000)
    if fps <= 0:
        raise ConfigError(f"data.media.video_fps={cfg.video_fps} must be > 0")
    if rate and rate > 0:
        fps = min(fps, Fraction(rate))
    n = max(1, math.ceil(duration * fps))
    cap = int(cfg.max_video_frames)
    if cap > 0 and n > cap:
        return [duration * k / cap for k in range(cap)]
    return [Fraction(k) / fps for k in range(n)]


def kept_fps(duration: Fraction, cfg: MediaConfig, rate: Fraction | None = None) -> float:
    """The rate of the frames `frame_times` keeps (frames a second): what a video's time is measured in
    downstream (Qwen2.5-VL's M-RoPE steps temporal positions by seconds)."""
    times = frame_times(duration, cfg, rate)
    if len(times) > 1:
        return float(1 / (times[1] - times[0]))
    fps = Fraction(cfg.video_fps).limit_denominator(1_000_000)
    return float(min(fps, Fraction(rate)) if rate and rate > 0 else fps)


def video_fps(path: Path, cfg: MediaConfig | None = None) -> float:
    """`kept_fps` of a video file from its headers (0.0 for `.npy` frames, whose rate is unknown)."""
    if Path(path).suffix.lower() == ".npy":
        return 0.0
    cfg = cfg or MediaConfig()
    container = _open_video(path)
    try:
        _, dur, rate, _, _ = _probe(path, container)
    finally:
        container.close()
    return kept_fps(dur, cfg, rate)


@dataclass(frozen=True)
class Rated:
    """A video's shape or frames with the rate its frames were kept at (what SegmentMeta.fps records)."""
    value: Any
    fps: float

    @staticmethod
    def value_of(v: Any) -> Any:
        return v.value if isinstance(v, Rated) else v

    @staticmethod
    def fps_of(v: Any) -> float:
        return float(v.fps) if isinstance(v, Rated) else 0.0


def rated(fn, cfg: MediaConfig | None = None):
    """`fn(path, modality[, cfg])` (`media_shape` / `load_media`) whose videos come back as `Rated`."""
    def read(path: Path, modality: str):
        value = fn(path, modality) if cfg is None else fn(path, modality, cfg)
        return Rated(value, video_fps(path, cfg)) if modality == "video" else value
    return read


_MP4_LIKE = (".mp4", ".m4v", ".mov")


def _boxes(f, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of the ISO-BMFF boxes in [start, end) of an open file."""
    pos = start
    while pos + 8 <= end:
        f.seek(pos)
        head = f.read(16)
        if len(head) < 8:
            return
        size, kind = int.from_bytes(head[:4], "big"), head[4:8]
        hdr = 8
        if size == 1 and len(head) == 16:
            size, hdr = int.from_bytes(head[8:16], "big"), 16
        elif size == 0:
            size = end - pos
        if size < hdr:
            return
        yield kind, pos + hdr, min(pos + size, end)
        pos += size


def mp4_rotation(path: Path) -> int:
    """Counter-clockwise degrees (0/90/180/270) the video track's tkhd matrix turns the stored frames for
    display (how phones store portrait clips). Read from the header boxes (the same value FFmpeg reports as
    a decoded frame's `rotation`; PyAV exposes no header-level getter). Anything unreadable -> 0."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            for kind, a, b in _boxes(f, 0, size):
                if kind != b"moov":
                    continue
                for tkind, ta, tb in _boxes(f, a, b):
                    if tkind != b"trak":
                        continue
                    matrix, handler = None, None
                    for ckind, ca, cb in _boxes(f, ta, tb):
                        if ckind == b"tkhd":
                            f.seek(ca)
                            body = f.read(min(cb - ca, 92))
                            off = 4 + (32 if body[0] == 1 else 20) + 16  # version/flags, times/ids/duration, reserved..volume
                            matrix = [int.from_bytes(body[off + 4 * i: off + 4 * i + 4], "big", signed=True)
                                      for i in range(9)]
                        elif ckind == b"mdia":
                            for mkind, ma, mb in _boxes(f, ca, cb):
                                if mkind == b"hdlr":
                                    f.seek(ma + 8)
                                    handler = f.read(4)
                    if handler == b"vide" and matrix and len(matrix) == 9:
                        deg = -math.degrees(math.atan2(matrix[1], matrix[0]))
                        return int(round(deg / 90.0)) % 4 * 90
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def video_shape(path: Path, cfg: MediaConfig) -> tuple[int, int, int, int]:
    container = _open_video(path)
    try:
        _, dur, rate, h, w = _probe(path, container)
    finally:
        container.close()
    if Path(path).suffix.lower() in _MP4_LIKE and mp4_rotation(path) in (90, 270):
        h, w = w, h
    return (len(frame_times(dur, cfg, rate)), h, w, 3)


def load_video(path: Path, cfg: MediaConfig) -> np.ndarray:
    """The frames nearest to `frame_times` (ties: the earlier one; robust to containers rounding timestamps
    to milliseconds), RGB float32. Targets past the last decoded frame get the last frame.

    Only the kept frames are converted to RGB; the rest are decoded (inter-frame codecs need them) unless a
    keyframe lies between two far-apart targets, where seeking skips them. mp4/mov display rotation (phone
    portrait clips) is applied; other containers' frames come out as stored."""
    container = _open_video(path)
    try:
        s, dur, rate, h, w = _probe(path, container)
        times = frame_times(dur, cfg, rate)
        try:
            frames = _decode_at(container, s, times, h, w)
        except BadSample:
            raise
        except Exception as exc:
            raise _corrupt(path, "video", exc) from None
    finally:
        container.close()
    if not frames:
        raise BadSample(f"{path}: corrupt or truncated video (no frame could be decoded)")
    frames += [frames[-1]] * (len(times) - len(frames))  # header claimed more than the decoder gave
    out = np.stack(frames).astype(np.float32) / 255.0
    turns = mp4_rotation(path) // 90 if Path(path).suffix.lower() in _MP4_LIKE else 0
    return np.ascontiguousarray(np.rot90(out, k=turns, axes=(1, 2))) if turns else out


def _keyframe_ts(s) -> list[int]:
    """Keyframe timestamps (stream time base) from the container's index (mp4: DTS; mkv cues: PTS)."""
    try:
        return sorted(e.timestamp for e in s.index_entries if e.is_keyframe)
    except Exception:
        return []


def _decode_at(container, s, times: list[Fraction], h: int, w: int, stats: dict | None = None) -> list[np.ndarray]:
    """uint8 RGB frames nearest to `times` (seconds from the first frame; ties go to the earlier frame).

    `stats` (if given) counts frames decoded, seeks and restarts (tests, bench)."""
    stats = {} if stats is None else stats
    stats.update(decoded=0, seeks=0, restarts=0)
    tb = Fraction(s.time_base) if s.time_base else Fraction(1, 1000)
    rate = Fraction(s.average_rate or s.guessed_rate or 25)
    gaps = [b - a for a, b in zip(times, times[1:])]
    keys = _keyframe_ts(s) if gaps and max(gaps) >= SEEK_GAP_S else []
    # mp4 indexes keyframes by decode time; a frame's PTS exceeds its DTS by at most the initial reorder delay
    delay = max(0, int(s.start_time) - keys[0]) if keys and s.start_time is not None else 0
    out: list[np.ndarray] = []
    cache: tuple[object, np.ndarray] | None = None

    def rgb(frame) -> np.ndarray:
        nonlocal cache
        if cache is None or cache[0] is not frame:
            cache = (frame, frame.to_ndarray(format="rgb24", width=w, height=h))
        return cache[1]

    origin: int | None = None
    prev, prev_t = None, Fraction(0)
    k, index = 0, 0
    frames: Iterator = container.decode(s)
    just_sought, sought, before = False, -1, Fraction(0)
    while k < len(times):
        frame = next(frames, None)
        if frame is None:
            break
        pts = frame.pts
        if origin is None:
            origin = pts if pts is not None else 0
        t = (pts - origin) * tb if pts is not None else Fraction(index) / rate
        index += 1
        stats["decoded"] += 1
        if just_sought:
            if t > times[k]:  # the seek overshot the target: start over, no more seeking
                stats["restarts"] += 1
                container.seek(origin, stream=s, backward=True)
                frames, prev, keys, just_sought = container.decode(s), None, [], False
                continue
            if t <= before:  # it landed behind where we were: correct but no gain, stop seeking
                keys = []
            just_sought = False
        while k < len(times) and t > times[k]:  # frame is past target k: it or prev is the nearest
            nearer_prev = prev is not None and times[k] - prev_t <= t - times[k]
            out.append(rgb(prev if nearer_prev else frame))
            k += 1
        if k == len(times):
            break
        prev, prev_t = frame, t
        if keys and k != sought and times[k] - t >= SEEK_GAP_S:  # at most one seek per target
            target = origin + int(times[k] / tb)
            i = bisect.bisect_right(keys, target - delay) - 1
            if i >= 0 and keys[i] > (pts if pts is not None else origin):
                container.seek(target - delay, stream=s, backward=True)
                stats["seeks"] += 1
                frames, prev, just_sought, sought, before = container.decode(s), None, True, k, t
    while prev is not None and k < len(times):  # targets past the last frame still see the last frame
        out.append(rgb(prev))
        k += 1
    return out


def write_video(path: Path, frames: np.ndarray, fps: float, crf: int = 18, gop: int | None = None,
                rotation: int = 0) -> None:
    """float [T, H, W, 3] in [0, 1] -> mp4/mkv/mov (libx264, yuv420p) or webm (VP9). H and W must be even.

    `rotation` (counter-clockwise degrees) is stored as display metadata, the way phones store portrait clips."""
    import av
    px = np.clip(np.round(np.asarray(frames, np.float64) * 255), 0, 255).astype(np.uint8)
    if px.ndim != 4 or px.shape[-1] != 3 or px.shape[0] == 0:
        raise ValueError(f"{path}: write_video needs frames [T>0, H, W, 3], got {px.shape}")
    t, h, w, _ = px.shape
    if h % 2 or w % 2:
        raise ValueError(f"{path}: yuv420p needs even sides, got {h}x{w}")
    suffix = Path(path).suffix.lower()
    if suffix not in (".mp4", ".m4v", ".mkv", ".mov", ".webm"):
        raise ValueError(f"{path}: write_video writes .mp4, .m4v, .mkv, .mov or .webm")
    webm = suffix == ".webm"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libvpx-vp9" if webm else "libx264", rate=Fraction(fps).limit_denominator(1001))
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        opts = {"crf": str(crf)} | ({"b": "0"} if webm else {}) | ({"g": str(gop)} if gop else {})
        s.options = opts
        if rotation:
            s.set_display_rotation(rotation)
        for i in range(t):
            for pkt in s.encode(av.VideoFrame.from_ndarray(px[i], format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)


# ------------------------------------------------------------------------------------ audio
def resampled_len(n: int, rate: int) -> int:
    """Samples soxr returns for n samples at `rate` -> SAMPLE_RATE: n * 16000 / rate rounded half up."""
    return n if rate == SAMPLE_RATE else (2 * n * SAMPLE_RATE + rate) // (2 * rate)


def _audio_info(path: Path) -> tuple[int, int]:
    import soundfile as sf
    try:
        info = sf.info(str(path))
        frames, rate = int(info.frames), int(info.samplerate)
    except Exception as exc:  # soundfile.LibsndfileError (a RuntimeError), TypeError on odd headers
        raise _corrupt(path, "audio", exc) from None
    if rate < _MIN_AUDIO_RATE:
        raise BadSample(f"{path}: corrupt or truncated audio (sample rate {rate} Hz)")
    if frames <= 0:
        raise BadSample(f"{path}: zero-length audio")
    return frames, rate


def audio_shape(path: Path) -> tuple[int]:
    frames, rate = _audio_info(path)
    return (resampled_len(frames, rate),)


def load_audio(path: Path) -> np.ndarray:
    """Channels averaged, then soxr's windowed-sinc resampler (HQ) to 16 kHz; padded to the header's length."""
    import soundfile as sf
    import soxr
    frames, rate = _audio_info(path)
    try:
        with sf.SoundFile(str(path)) as f:
            x = f.read(frames, dtype="float32", always_2d=True)
    except Exception as exc:
        raise _corrupt(path, "audio", exc) from None
    x = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    if x.size < frames:  # a file cut short of what its header claims
        x = np.pad(x, (0, frames - x.size))
    if x.size == 0:
        raise BadSample(f"{path}: zero-length audio")
    if rate != SAMPLE_RATE:
        x = soxr.resample(x, rate, SAMPLE_RATE, quality="HQ")
    n = resampled_len(frames, rate)
    if x.size != n:  # never seen; keeps the shape contract if a soxr version rounds differently
        x = np.pad(x, (0, max(0, n - x.size)))[:n]
    return np.ascontiguousarray(x, np.float32)


def write_audio(path: Path, wave_f32: np.ndarray, rate: int = SAMPLE_RATE) -> None:
    """float [N] or [N, C] in [-1, 1] -> 16-bit WAV/FLAC, Vorbis OGG or MP3, the format from the suffix."""
    import soundfile as sf
    suffix = Path(path).suffix.lower()
    fmt = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS"),
           ".oga": ("OGG", "VORBIS"), ".mp3": ("MP3", "MPEG_LAYER_III")}.get(suffix)
    if fmt is None:
        raise ValueError(f"{path}: write_audio writes .wav, .flac, .ogg or .mp3")
    sf.write(str(path), np.clip(np.asarray(wave_f32, np.float32), -1, 1), rate, format=fmt[0], subtype=fmt[1])


# --------------------------------------------------------------------------------- dispatch
def _check(path: Path, modality: str) -> str:
    path = Path(path)
    suffix = path.suffix.lower()
    if modality not in SUFFIXES:
        raise BadSample(f"{path}: no media loader for modality {modality!r}")
    if suffix != ".npy" and suffix not in SUFFIXES[modality]:
        raise BadSample(f"{path}: unsupported {modality} format {suffix or '(no suffix)'} "
                        f"(supported: {', '.join(SUFFIXES[modality] + ('.npy',))})")
    if not path.is_file():
        raise BadSample(f"{path}: media file not found")
    return suffix


def media_shape(path: Path, modality: str, cfg: MediaConfig | None = None) -> tuple[int, ...]:
    """The exact shape `load_media` returns, from headers only (no pixels or samples decoded)."""
    suffix = _check(path, modality)
    path = Path(path)
    if suffix == ".npy":
        return npy_shape(path)
    if modality == "image":
        return image_shape(path)
    if modality == "video":
        return video_shape(path, cfg or MediaConfig())
    return audio_shape(path)


def load_media(path: Path, modality: str, cfg: MediaConfig | None = None) -> np.ndarray:
    """Decode to the sample format; `BadSample` (naming the file) for anything missing, unsupported or corrupt."""
    suffix = _check(path, modality)
    path = Path(path)
    if suffix == ".npy":
        return load_npy(path, modality)
    if modality == "image":
        return load_image(path)
    if modality == "video":
        return load_video(path, cfg or MediaConfig())
    return load_audio(path)
