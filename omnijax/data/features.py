"""Encoder preprocessing on the host (numpy only): image/video patches, log-mel frames.

The token-count rules (`vision_grid`, `audio_frames`, `encoder_tokens`) live in omnijax/mm_config.py,
below both the data plane and the models, which both need them.

Resolution rule for images and video frames (`vision_grid`), applied identically by `image_patches`
and by the metadata-only `encoder_tokens`, so the packer and the cost model agree with the payload:
with unit = patch * merge and s = min(1, max_side / longer side), each side becomes
round(side * s / unit) * unit, at least one unit and at most floor(max_side / unit) units; pixels
are resampled to that size with a box filter (area average when shrinking). The aspect ratio is kept
up to half a unit per side; nothing is cropped. A side that would need more than 2x up-scaling
(shorter than half a unit) is rejected (`BadSample`): it would invent detail.
A tower pretrained at a fixed input size (SigLIP: `image_size` > 0) instead gets what its Hugging Face
image processor gives it: every image/frame resized to image_size x image_size with its `resample`
filter (Pillow's, on the 8-bit pixels when they are exactly 8-bit, as SiglipImageProcessor does), the
patches covering the top-left grid * patch pixels (a stride = kernel convolution's cover), and
`(x - image_mean) / image_std` per channel. Audio for a Whisper encoder follows WhisperFeatureExtractor
(`whisper_log_mel`); converted shards store decoded media at their own size and rate, so the same
shards serve either kind of encoder.
Frames of a video are grouped by `temporal_patch` (the last frame is repeated to fill the last
group); an image is one frame repeated `temporal_patch` times.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from omnijax.errors import BadSample
from omnijax.mm_config import (AudioConfig, MMConfig, VisionConfig, WhisperConfig, _encoder_cfg, _target_sides,  # noqa: F401
                                 QwenVisionConfig, audio_frames, encoder_configs, encoder_tokens, qwen_grid,
                                 vision_grid)


# ------------------------------------------------------------------------------------ vision
def _box_weights(n: int, target: int) -> np.ndarray:
    """[target, n] weights: output cell i averages the input span [i*n/target, (i+1)*n/target)."""
    edges = np.arange(target + 1) * (n / target)
    lo, hi = edges[:-1, None], edges[1:, None]
    j = np.arange(n)[None]
    overlap = np.clip(np.minimum(hi, j + 1) - np.maximum(lo, j), 0, None)
    return (overlap / overlap.sum(axis=1, keepdims=True)).astype(np.float32)


def _resize_side(x: np.ndarray, axis: int, target: int) -> np.ndarray:
    n = x.shape[axis]
    if n == target:
        return x
    return np.moveaxis(np.tensordot(_box_weights(n, target), np.moveaxis(x, axis, 0), axes=1), 0, axis)


_PIL_FILTERS = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4}


def resize_frames(frames: np.ndarray, size: int, resample: str) -> np.ndarray:
    """[T, H, W, 3] in [0, 1] -> [T, size, size, 3] with Pillow's `resample` filter.

    Exactly 8-bit pixels (k/255, what decoded JPEG/PNG/video frames are) are resized as 8-bit RGB, the
    way Hugging Face image processors resize; other values per channel in 32-bit float."""
    from PIL import Image

    if frames.shape[1:3] == (size, size):
        return frames
    method = _PIL_FILTERS[resample]
    u8 = np.rint(frames * np.float32(255.0))
    exact = bool(np.all((u8 >= 0) & (u8 <= 255))) and np.array_equal(u8 / np.float32(255.0), frames)
    out = np.empty((frames.shape[0], size, size, 3), np.float32)
    for i, frame in enumerate(frames):
        if exact:
            img = Image.fromarray(u8[i].astype(np.uint8), "RGB").resize((size, size), resample=method)
            out[i] = np.asarray(img, np.float32) / np.float32(255.0)
        else:
            for c in range(3):
                img = Image.fromarray(np.ascontiguousarray(frame[..., c]), "F").resize((size, size), resample=method)
                out[i, ..., c] = np.asarray(img, np.float32)
    return out


def image_patches(pixels: np.ndarray, patch: int, temporal_patch: int = 1, merge: int = 2,
                  max_side: int | None = None, image_size: int = 0,
                  resample: str = "box") -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patches [n, temporal_patch*patch*patch*3] and grid (t, h, w) of an image or a video.

    Rows are ordered (t, h-block, w-block, i, j) so that each merge x merge window is `merge*merge`
    consecutive rows; a row is the flattened (frame, y, x, channel) block. Values are not rescaled.
    image_size > 0: frames resized to that square with `resample` first (a fixed-input tower).
    """
    pixels = np.asarray(pixels, dtype=np.float32)
    t, gh, gw = vision_grid(pixels.shape, patch, temporal_patch, merge, max_side, image_size)
    frames = pixels[None] if pixels.ndim == 3 else pixels
    if pixels.ndim == 3:
        frames = np.repeat(frames, temporal_patch, axis=0)
    elif frames.shape[0] % temporal_patch:
        fill = temporal_patch - frames.shape[0] % temporal_patch
        frames = np.concatenate([frames, np.repeat(frames[-1:], fill, axis=0)], axis=0)
    if image_size:
        frames = resize_frames(frames, image_size, resample)[:, :gh * patch, :gw * patch]
    else:
        frames = _resize_side(_resize_side(frames, 1, gh * patch), 2, gw * patch)
    m, p, tp = merge, patch, temporal_patch
    x = frames.reshape(t, tp, gh // m, m, p, gw // m, m, p, 3)
    x = x.transpose(0, 2, 5, 3, 6, 1, 4, 7, 8)
    return np.ascontiguousarray(x.reshape(t * gh * gw, tp * p * p * 3)), (t, gh, gw)


def patch_positions(grid: tuple[int, int, int], merge: int = 2) -> np.ndarray:
    """(t, h, w) coordinates [n, 3] of the rows `image_patches` returns for this grid."""
    t, gh, gw = grid
    tt, bh, bw, i, j = np.meshgrid(np.arange(t), np.arange(gh // merge), np.arange(gw // merge),
                                   np.arange(merge), np.arange(merge), indexing="ij")
    pos = np.stack([tt, bh * merge + i, bw * merge + j], axis=-1)
    return pos.reshape(-1, 3).astype(np.int32)


# ------------------------------------------------------------------------------------- audio
def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(f) / 700.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (np.asarray(m) / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular filters [n_fft//2 + 1, n_mels] on the mel scale (HTK formula), 0 Hz..Nyquist."""
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None] - lo) / np.maximum(mid - lo, 1e-9)
    down = (hi - freqs[None]) / np.maximum(hi - mid, 1e-9)
    return np.maximum(0.0, np.minimum(up, down)).T.astype(np.float32)


def log_mel(wave: np.ndarray, sample_rate: int = 16000, n_mels: int = 32, n_fft: int = 400,
            hop: int = 160, pad_to_multiple: int = 1) -> np.ndarray:
    """Log-mel features [frames, n_mels] of a mono waveform (Hann window, power spectrum).

    Values are log10 power clamped to 8 decades below the clip's peak, standardised per clip;
    frames are padded with the clip's floor value to a multiple of `pad_to_multiple`.
    """
    wave = np.asarray(wave, dtype=np.float32).reshape(-1)
    frames = audio_frames(wave.size, hop)
    total = (frames - 1) * hop + n_fft
    wave = np.pad(wave, (0, total - wave.size))
    idx = np.arange(n_fft)[None] + hop * np.arange(frames)[:, None]
    window = np.hanning(n_fft + 1)[:-1].astype(np.float32)
    power = np.abs(np.fft.rfft(wave[idx] * window, axis=-1)) ** 2
    mel = power @ mel_filterbank(sample_rate, n_fft, n_mels)
    logm = np.log10(np.maximum(mel, 1e-10))
    logm = np.maximum(logm, logm.max() - 8.0)
    # standardised per clip: loudness-invariant, zero-centred (a constant offset would dominate the
    # encoder's tokens and hide what differs between clips)
    feats = ((logm - logm.mean()) / (logm.std() + 1e-3)).astype(np.float32)
    extra = -frames % pad_to_multiple
    if extra:
        feats = np.concatenate([feats, np.full((extra, n_mels), feats.min(), np.float32)], axis=0)
    return feats


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, np.float64)
    mel = 3.0 * hz / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hz >= 1000.0, log, mel)


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), 200.0 * mel / 3.0)


def slaney_filterbank(sample_rate: int, n_fft: int, n_mels: int, f_max: float = 8000.0) -> np.ndarray:
    """Whisper's mel filters [n_fft//2 + 1, n_mels]: Slaney mel scale, area-normalised triangles, 0..f_max Hz."""
    edges = _slaney_hz(np.linspace(_slaney_mel(0.0), _slaney_mel(f_max), n_mels + 2))
    freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    diff = np.diff(edges)
    slopes = edges[None] - freqs[:, None]
    tri = np.maximum(0.0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))
    return tri * (2.0 / (edges[2:] - edges[:-2]))[None]


def whisper_log_mel(wave: np.ndarray, cfg: WhisperConfig) -> np.ndarray:
    """WhisperFeatureExtractor's log-mel features [frames, n_mels] of one clip, at the clip's own length.

    Hann window (periodic), centred STFT with reflection, power spectrum through Slaney mel filters,
    log10 with a 1e-10 floor, clamped at the window's peak - 8, then (x + 4) / 4. HF pads every clip with
    zeros to a 30 s window; these are its first ceil(n / hop) frames (rounded up to the encoder's
    stride), and the peak is taken over every frame the clip reaches, so the values are HF's. Clips
    longer than the window are cut at it, as HF does."""
    hop, n_fft, window_frames = cfg.hop, cfg.n_fft, cfg.chunk_frames
    wave = np.asarray(wave, np.float64).reshape(-1)[:window_frames * hop]
    frames = min(audio_frames(wave.size, hop), cfg.max_frames)
    frames += -frames % cfg.reduction
    reach = min(window_frames, max(frames, -(-(wave.size + n_fft // 2) // hop)))  # frames that see the clip
    length = min(window_frames * hop, reach * hop + n_fft)
    x = np.pad(wave, (0, length - wave.size))
    x = np.pad(x, (n_fft // 2, n_fft // 2), mode="reflect")
    idx = np.arange(n_fft)[None] + hop * np.arange(reach)[:, None]
    window = np.hanning(n_fft + 1)[:-1]
    power = np.abs(np.fft.rfft(x[idx] * window, axis=-1)) ** 2
    mel = np.maximum(1e-10, power @ slaney_filterbank(cfg.sample_rate, n_fft, cfg.n_mels))
    logm = np.log10(mel).astype(np.float32)
    logm = np.maximum(logm, logm.max() - np.float32(8.0))
    return ((logm[:frames] + np.float32(4.0)) / np.float32(4.0)).astype(np.float32)


def segment_positions(modality: str, shape: tuple[int, ...], cfg: Any) -> np.ndarray:
    """Positions [n, 3] of a segment's encoder input rows from its shape alone (equal to what
    `segment_inputs` returns with the decoded rows): the plan lays buffers out before any decoding."""
    enc = _encoder_cfg(modality, cfg)
    if isinstance(enc, QwenVisionConfig) and modality in ("image", "video"):  # smart resize (qwen_processor)
        return patch_positions(qwen_grid(shape, enc), enc.merge)
    if modality in ("image", "video"):
        return patch_positions(vision_grid(shape, enc.patch, enc.temporal_patch, enc.merge, enc.max_side,
                                           enc.image_size), enc.merge)
    rows, _ = encoder_tokens(modality, shape, enc)
    pos = np.zeros((rows, 3), np.int32)
    pos[:, 0] = np.arange(rows)
    return pos


def segment_inputs(modality: str, data: np.ndarray, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """Encoder input rows [n, D] and positions [n, 3] of one non-text segment (the packer's payload)."""
    enc = _encoder_cfg(modality, cfg)
    if modality in ("image", "video"):
        if modality == "image" and data.ndim != 3 or modality == "video" and data.ndim != 4:
            raise BadSample(f"{modality} of shape {data.shape}: wrong rank")
        if isinstance(enc, QwenVisionConfig):  # Qwen2-VL's processor (omnijax/data/qwen_processor.py)
            from omnijax.data import qwen_processor
            patches, grid = qwen_processor.patch_rows(data, enc)
            return patches, patch_positions(grid, enc.merge)
        patches, grid = image_patches(data, enc.patch, enc.temporal_patch, enc.merge, enc.max_side, enc.image_size,
                                      enc.resample)
        if enc.normalize:  # (x - mean) / std per channel; the default 0.5 / 0.5 maps [0, 1] to [-1, 1]
            mean, std = np.asarray(enc.image_mean, np.float32), np.asarray(enc.image_std, np.float32)
            patches = ((patches.reshape(len(patches), -1, 3) - mean) / std).reshape(patches.shape)
        return patches, patch_positions(grid, enc.merge)
    if modality == "audio" and isinstance(enc, WhisperConfig):
        feats = whisper_log_mel(data, enc)
        pos = np.zeros((feats.shape[0], 3), np.int32)
        pos[:, 0] = np.arange(feats.shape[0])
        return feats, pos
    if modality == "audio":
        feats = log_mel(data, enc.sample_rate, enc.n_mels, enc.n_fft, enc.hop, pad_to_multiple=enc.reduction)
        pos = np.zeros((feats.shape[0], 3), np.int32)
        pos[:, 0] = np.arange(feats.shape[0])
        return feats, pos
    raise BadSample(f"unknown modality {modality!r}")
