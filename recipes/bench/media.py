"""Media decoding benchmark: samples/s of media_shape (headers only) and load_media (full decode) per format."""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

DESCRIPTION = "media: samples/s of media_shape (headers) and load_media (decode) for jpeg/png/webp/mp4/wav/flac; video seeking on vs off"


@dataclass
class BenchConfig:
    files: int = 16              # files per format
    image_h: int = 384
    image_w: int = 512
    video_frames: int = 60       # per clip, at video_src_fps; sampled at MediaConfig's defaults (2 fps, <= 64 frames)
    video_src_fps: float = 30.0
    video_side: int = 128
    audio_s: float = 5.0
    audio_rate: int = 44100      # resampled to 16 kHz on load
    long_video_s: float = 60.0   # the seeking comparison: a long clip, few kept frames, keyframe every second
    long_video_fps: float = 10.0
    long_video_side: int = 64
    long_video_frames_kept: int = 8
    repeats: int = 3             # best of
    seed: int = 0


def _image(b: BenchConfig, k: int):
    """A photo-like picture: smooth gradients, a few shapes and mild noise (so JPEG/WebP sizes are realistic)."""
    import numpy as np
    rng = np.random.default_rng(b.seed + k)
    yy, xx = np.mgrid[0:b.image_h, 0:b.image_w]
    y, x = yy / max(b.image_h, b.image_w), xx / max(b.image_h, b.image_w)
    img = np.stack([0.5 + 0.4 * np.sin(6 * x + k), y, 0.5 + 0.4 * np.cos(5 * (x + y))], -1)
    for _ in range(6):
        cy, cx, r = rng.random(3) * [b.image_h, b.image_w, 60]
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r ** 2] = rng.random(3)
    return np.clip(img + rng.normal(0, 0.02, img.shape), 0, 1)


def _video(b: BenchConfig, k: int, n: int, side: int):
    import numpy as np
    t = np.arange(n)[:, None, None, None]
    y, x = np.mgrid[0:side, 0:side][..., None] / side
    return np.clip(0.5 + 0.4 * np.sin(8 * x + t / 7 + k) * np.cos(6 * y - t / 11), 0, 1) * np.ones(3)


def write_files(b: BenchConfig, folder: Path) -> dict[str, list[Path]]:
    """b.files files per format, written with omnijax's own writers."""
    import numpy as np
    from omnijax.data import media
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[Path]] = {f: [] for f in ("jpeg", "png", "webp", "mp4", "wav", "flac")}
    for k in range(b.files):
        img = _image(b, k)
        for fmt, ext in (("jpeg", ".jpg"), ("png", ".png"), ("webp", ".webp")):
            media.write_image(folder / f"i{k}{ext}", img)
            out[fmt].append(folder / f"i{k}{ext}")
        media.write_video(folder / f"v{k}.mp4", _video(b, k, b.video_frames, b.video_side), b.video_src_fps)
        out["mp4"].append(folder / f"v{k}.mp4")
        t = np.arange(int(b.audio_s * b.audio_rate)) / b.audio_rate
        wave = 0.3 * np.sin(2 * np.pi * (220 + 20 * k) * t) + 0.05 * np.random.default_rng(k).normal(size=t.size)
        for fmt, ext in (("wav", ".wav"), ("flac", ".flac")):
            media.write_audio(folder / f"a{k}{ext}", wave, b.audio_rate)
            out[fmt].append(folder / f"a{k}{ext}")
    return out


MODALITY = {"jpeg": "image", "png": "image", "webp": "image", "mp4": "video", "wav": "audio", "flac": "audio"}


def best_rate(fn: Callable[[Path], object], paths: list[Path], repeats: int) -> float:
    """Files per second, best of `repeats` passes over `paths` (the first pass also warms the OS cache)."""
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p in paths:
            fn(p)
        best = max(best, len(paths) / (time.perf_counter() - t0))
    return best


def _seek_rows(b: BenchConfig, folder: Path) -> Iterator[dict]:
    """A long clip with a few kept frames, decoded with seeking (default) and without, alternated."""
    from omnijax.config import MediaConfig
    from omnijax.data import media
    p = folder / "long.mp4"
    n = int(b.long_video_s * b.long_video_fps)
    media.write_video(p, _video(b, 0, n, b.long_video_side), b.long_video_fps, crf=28, gop=int(b.long_video_fps))
    cfg = MediaConfig(video_fps=2.0, max_video_frames=b.long_video_frames_kept)
    default_gap = media.SEEK_GAP_S
    rates = {"seek": 0.0, "no_seek": 0.0}
    try:
        for _ in range(b.repeats):
            for name, gap in (("seek", default_gap), ("no_seek", float("inf"))):
                media.SEEK_GAP_S = gap
                rates[name] = max(rates[name], best_rate(lambda q: media.load_media(q, "video", cfg), [p] * 4, 1))
    finally:
        media.SEEK_GAP_S = default_gap
    common = {"format": "mp4", "op": "load_media", "clip_s": b.long_video_s, "src_fps": b.long_video_fps,
              "frames_kept": b.long_video_frames_kept, "keyframe_every_s": 1.0}
    yield {"variant": "mp4_long_seek", "samples_per_s": round(rates["seek"], 2), "vs": "mp4_long_no_seek",
           "speedup": round(rates["seek"] / rates["no_seek"], 3), **common}
    yield {"variant": "mp4_long_no_seek", "samples_per_s": round(rates["no_seek"], 2), **common}


def run(overrides: list[str]) -> Iterator[dict]:
    from omnijax.config import MediaConfig, build
    from omnijax.data import media
    b = build(BenchConfig, None, overrides, check=None)
    tmp = Path(tempfile.mkdtemp(prefix="omnijax_bench_media_"))
    cfg = MediaConfig()
    try:
        files = write_files(b, tmp)
        for fmt, paths in files.items():
            m = MODALITY[fmt]
            shape = media.media_shape(paths[0], m, cfg)
            size_kb = sum(p.stat().st_size for p in paths) / len(paths) / 1024
            for op, fn in (("media_shape", lambda p: media.media_shape(p, m, cfg)),
                           ("load_media", lambda p: media.load_media(p, m, cfg))):
                yield {"variant": f"{fmt}_{'shape' if op == 'media_shape' else 'load'}", "format": fmt, "op": op,
                       "samples_per_s": round(best_rate(fn, paths, b.repeats), 1), "shape": list(shape),
                       "file_kb": round(size_kb, 1), "files": len(paths)}
        yield from _seek_rows(b, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
