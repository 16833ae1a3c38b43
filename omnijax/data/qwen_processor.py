"""Qwen2-VL / Qwen2.5-VL preprocessing on the host (numpy + Pillow), as transformers' processors do it.

Images: smart resize (`omnijax.mm_config.smart_resize`: sides multiples of patch*merge = 28, area within
`min_pixels`/`max_pixels` of preprocessor_config.json) with Pillow's bicubic filter on the 8-bit pixels,
then x/255, then (x - image_mean) / image_std per channel, then `temporal_patch` copies of the frame form
one temporal patch (`Qwen2VLImageProcessorPil`). Videos: the frames go through the same resize and
normalisation; the last frame is repeated to fill the last temporal patch (`Qwen2VLVideoProcessor.patchify`).
Rows come out in omnijax's layout (features.image_patches): (t, h-block, w-block, i, j) rows of flattened
(frame, y, x, channel) patches, which the `qwen_vit` tower's patch embedding reads.

Frames and time: `sample_frames` is the video processor's rule for which frames to keep at a target fps
(between `min_frames` and `max_frames`, a multiple of `temporal_patch`), and `seconds_per_grid` the time one
temporal patch spans at the rate the kept frames have, which M-RoPE turns into temporal position steps of
tokens_per_second * seconds_per_grid (Qwen2.5-VL's time alignment, `rope_index`).

Positions: `rope_index` is transformers' `get_rope_index` for one sample, on the host; `sample_rope_positions`
applies it to a sample's metadata (what the packer carries per token), `decode_delta` is what generation adds.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from omnijax.errors import BadSample
from omnijax.mm_config import QwenVisionConfig, qwen_grid


def _resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """[T, H, W, 3] in [0, 1] (or uint8) -> [T, height, width, 3] float32 in [0, 1], Pillow bicubic.

    8-bit pixels (k/255, what decoded images and frames are) are resized as 8-bit RGB, as transformers does;
    other values per channel in 32-bit float."""
    from PIL import Image

    if frames.dtype == np.uint8:
        u8, exact = frames, True
    else:
        scaled = np.rint(frames.astype(np.float32) * np.float32(255.0))
        exact = bool(np.all((scaled >= 0) & (scaled <= 255))) and np.array_equal(scaled / np.float32(255.0), frames)
        u8 = scaled.astype(np.uint8) if exact else None
    out = np.empty((frames.shape[0], height, width, 3), np.float32)
    for i in range(frames.shape[0]):
        if exact:
            if u8.shape[1:3] == (height, width):
                out[i] = u8[i]
            else:
                out[i] = np.asarray(Image.fromarray(np.ascontiguousarray(u8[i]), "RGB").resize(
                    (width, height), resample=Image.BICUBIC), np.float32)
        else:
            for c in range(3):
                img = Image.fromarray(np.ascontiguousarray(frames[i, ..., c].astype(np.float32)), "F")
                out[i, ..., c] = np.asarray(img.resize((width, height), resample=Image.BICUBIC), np.float32) * 255.0
    return out * np.float32(1.0 / 255.0)


def patch_rows(pixels: np.ndarray, cfg: QwenVisionConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(rows [t*h*w, temporal_patch*patch*patch*3] normalised, grid (t, h, w)) of an image [H, W, 3] or a
    video [T, H, W, 3] (pixels in [0, 1] or uint8)."""
    pixels = np.asarray(pixels)
    if pixels.ndim not in (3, 4) or pixels.shape[-1] != 3:
        raise BadSample(f"vision input of shape {pixels.shape}: expected [H, W, 3] or [T, H, W, 3]")
    t, gh, gw = qwen_grid(pixels.shape, cfg)
    p, tp, m = cfg.patch, cfg.temporal_patch, cfg.merge
    frames = _resize(pixels[None] if pixels.ndim == 3 else pixels, gh * p, gw * p)
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    frames = (frames - mean) / std
    if pixels.ndim == 3:
        frames = np.repeat(frames, tp, axis=0)
    elif frames.shape[0] % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - frames.shape[0] % tp, axis=0)], axis=0)
    x = frames.reshape(t, tp, gh // m, m, p, gw // m, m, p, 3).transpose(0, 2, 5, 3, 6, 1, 4, 7, 8)
    return np.ascontiguousarray(x.reshape(t * gh * gw, tp * p * p * 3), np.float32), (t, gh, gw)


def sample_frames(total_frames: int, video_fps: float, fps: float = 2.0, temporal_patch: int = 2,
                  min_frames: int = 4, max_frames: int = 768) -> np.ndarray:
    """Indices of the frames Qwen2VLVideoProcessor keeps when sampling `fps` frames a second from a clip of
    `total_frames` at `video_fps`: total/video_fps*fps frames, clamped to [min_frames, max_frames] and the
    clip, rounded down to a multiple of `temporal_patch`, spread evenly from the first frame."""
    if total_frames <= 0 or video_fps <= 0 or fps <= 0:
        raise BadSample(f"cannot sample frames: {total_frames} frames at {video_fps} fps, target {fps} fps")
    cap = math.floor(min(max_frames, total_frames) / temporal_patch) * temporal_patch
    n = total_frames / video_fps * fps
    n = min(max(n, min_frames), cap, total_frames)
    n = math.floor(n / temporal_patch) * temporal_patch
    if n <= 0:
        raise BadSample(f"a clip of {total_frames} frames is shorter than one temporal patch ({temporal_patch})")
    return np.arange(0, total_frames, total_frames / n, dtype=np.float64)[:n].astype(np.int64)


def seconds_per_grid(temporal_patch: int, sampled_fps: float) -> float:
    """Seconds one temporal patch spans at the kept frames' rate (Qwen2.5-VL's `second_per_grid_ts`)."""
    if sampled_fps <= 0:
        raise BadSample(f"sampled fps {sampled_fps} must be > 0")
    return temporal_patch / sampled_fps


# ------------------------------------------------------------------------ M-RoPE positions (host side)
def vision_positions(start: int, grid: tuple[int, int, int], merge: int, interval: float = 1.0) -> np.ndarray:
    """[t * h/m * w/m, 3] positions of one image's or video's LLM tokens, (t, h, w) row-major."""
    t, h, w = (int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge)
    temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64) + start
    tt, hh, ww = np.meshgrid(temporal, np.arange(h) + start, np.arange(w) + start, indexing="ij")
    return np.stack([tt, hh, ww], axis=-1).reshape(-1, 3)


def rope_index(segments: Sequence[tuple], merge: int = 2, tokens_per_second: float = 2.0) -> np.ndarray:
    """M-RoPE positions [n, 3] (int32) of one sample from its segments in order:
    ("text", n_tokens) | ("image", (t, h, w)) | ("video", (t, h, w), seconds_per_temporal_patch).

    Grids are in patches (before merging). Text continues from the running position; an image/video starts
    there, its temporal positions stepping by tokens_per_second * seconds per temporal patch (Qwen2.5-VL's
    videos) or 1 (images; Qwen2-VL, tokens_per_second 0), and moves the running position by max(h, w) / merge,
    as transformers' `get_rope_index` does."""
    parts, cur = [], 0
    for seg in segments:
        kind = seg[0]
        if kind == "text":
            n = int(seg[1])
            parts.append(np.repeat((np.arange(n) + cur)[:, None], 3, axis=1))
            cur += n
        elif kind in ("image", "video"):
            grid = tuple(int(g) for g in seg[1])
            interval = 1.0  # images; Qwen2-VL's videos (tokens_per_second 0): one step per temporal patch
            if kind == "video" and tokens_per_second > 0:
                interval = tokens_per_second * (float(seg[2]) if len(seg) > 2 else 1.0)
            parts.append(vision_positions(cur, grid, merge, interval))
            cur += max(grid[1], grid[2]) // merge
        else:
            raise ValueError(f"unknown segment kind {kind!r}")
    if not parts:
        return np.zeros((0, 3), np.int32)
    return np.concatenate(parts, axis=0).astype(np.int32)


def decode_delta(rope_positions: np.ndarray, length: int) -> int:
    """What a generated token adds to its cache slot to get its (equal) rope positions: max(prompt's) + 1 -
    prompt length (transformers' `rope_deltas`)."""
    return int(np.max(rope_positions[:length])) + 1 - int(length) if length else 0


def sample_rope_positions(segments: Sequence, cfg: QwenVisionConfig | None,
                          video_fps: float | None = None) -> np.ndarray:
    """M-RoPE positions [n, 3] of one sample's LLM token run from its segment metadata alone (`SegmentMeta`s:
    modality, shape and, for a video, `fps`, the rate its frames were kept at; text segments include the vision
    start/end tokens around a placeholder run), each image/video taking its placeholder tokens' (t, h, w)
    positions from its smart-resized grid, videos stepping time at their rate (`video_fps` where given, else
    the segment's, else `cfg.fps`). Segment-local: 0 at the sample's start. `cfg` None: text only.

    What the packer carries per token; transformers' `get_rope_index` gives the same (it would join two
    media segments with no token between them into one run: here they stay two)."""
    runs = []
    for seg in segments:
        if seg.modality == "text":
            runs.append(("text", int(seg.shape[0])))
        elif cfg is None:
            raise BadSample(f"an M-RoPE sample's {seg.modality} segment needs a qwen_vit encoder")
        elif seg.modality == "image":
            runs.append(("image", qwen_grid(seg.shape, cfg)))
        elif seg.modality == "video":
            fps = float(video_fps or getattr(seg, "fps", 0.0) or cfg.fps)
            runs.append(("video", qwen_grid(seg.shape, cfg), seconds_per_grid(cfg.temporal_patch, fps)))
        else:
            raise BadSample(f"a Qwen2-VL model has no encoder for modality {seg.modality!r}")
    if cfg is None:
        return rope_index(runs)
    return rope_index(runs, cfg.merge, cfg.tokens_per_second)
