"""Typed configs of the multimodal model (encoders, projectors, their assembly with the LLM) and each
encoder's token-count rules from a segment's shape alone.

Plain dataclasses and arithmetic (no jax import), below both the data plane (features, cost model,
packer) and the models, which both need them and never import each other. The resolution rule of
`vision_grid` is described in omnijax/data/features.py, which applies it to pixels. Build them with `omnijax.config.from_dict`; encoders are listed by name in
`MMConfig.encoders` as raw mappings whose `kind` picks the registered config class and module
(see `omnijax.models.mllm.register_encoder`), so a new encoder is one module plus one config entry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from omnijax.config import LLMConfig
from omnijax.errors import BadSample, ConfigError


@dataclass
class VisionConfig:
    """ViT over packed patch buffers at native resolution; video = temporal patches of the same ViT."""
    kind: str = "vit"
    patch: int = 4               # pixels per patch side
    temporal_patch: int = 1      # frames per patch (images are repeated to fill it)
    merge: int = 2               # merge x merge neighbouring patches become one LLM token (1 = no merger)
    max_side: int = 256          # images/frames larger than this are downscaled (area average) first
    normalize: bool = True       # loader maps pixels [0, 1] -> [-1, 1]
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 128
    position: Literal["rope", "learned"] = "rope"  # rope: (t, h, w) rotary, any grid; learned: table
    learned_grid: int = 16       # learned table is learned_grid x learned_grid (grids must fit in it)
    abs_position: bool = False   # also add a learned map of (t, h, w) / grid extent: where in the image
    abs_freqs: int = 6           # sinusoid frequencies per axis for abs_position
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    post_norm: bool = True       # layernorm after the last block (SigLIP's post_layernorm)
    head: bool = False           # attention-pooling head per image (SigLIP's head); not fed to the LLM
    patch_bias: bool = True
    attention: Literal["auto", "reference", "blockwise", "cudnn"] = "auto"  # as model.llm.attention
    # Preprocessing of a pretrained tower (its preprocessor_config.json; see omnijax/data/features.py):
    image_size: int = 0          # > 0: every image/frame resized to image_size^2 (SigLIP), grid = image_size // patch
    resample: Literal["box", "nearest", "bilinear", "bicubic", "lanczos"] = "box"  # filter of that resize
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])  # normalize: (x - mean) / std
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    frame_attention: bool = False  # video frames attend within their own frame (an image tower, LLaVA-Video)


@dataclass
class QwenVisionConfig(VisionConfig):
    """Qwen2.5-VL's vision tower (omnijax/models/qwen_vision.py), or Qwen2-VL's (`window_size` 0).

    Patches of `patch` px over `temporal_patch` frames (images are repeated to fill it), 2-D rotary (h, w)
    positions, full attention within each temporal patch-frame on the `fullatt_block_indexes` layers
    (every layer when there are no windows) and attention within `window_size` px tiles elsewhere;
    RMSNorm/SwiGLU blocks (Qwen2.5-VL) or LayerNorm/QuickGELU blocks (Qwen2-VL, `norm`/`mlp`); the 2x2
    patch merger is this kind's projector (`out_dim` = the LLM width). Images and frames are resized to
    multiples of patch*merge px with between `min_pixels` and `max_pixels` pixels (Qwen's smart resize)."""
    kind: str = "qwen_vit"
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    max_side: int = 1 << 30         # unused: min_pixels/max_pixels bound the resolution
    embed_dim: int = 64
    num_heads: int = 4
    mlp_dim: int = 128
    out_dim: int = 64               # merger output width (the LLM's hidden size)
    norm: Literal["rms", "layer"] = "rms"
    mlp: Literal["swiglu", "quick_gelu"] = "swiglu"
    window_size: int = 112          # window side in pixels; 0 = no windows (Qwen2-VL)
    fullatt_block_indexes: list[int] = field(default_factory=list)
    post_norm: bool = False
    patch_bias: bool = False
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    tokens_per_second: float = 2.0  # M-RoPE temporal positions per second of video; 0 = 1 per temporal patch (Qwen2-VL)
    fps: float = 2.0                # a video's kept-frame rate where its shard metadata records none (older shards)
    image_mean: list[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    image_std: list[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])


@dataclass
class AudioConfig:
    """Log-mel frames -> group `reduction` frames (never across clips) -> transformer."""
    kind: str = "audio"
    sample_rate: int = 16000
    n_mels: int = 32
    n_fft: int = 400             # 25 ms window at 16 kHz
    hop: int = 160               # 10 ms hop
    reduction: int = 4           # frames per encoder token (the strided "conv" of the encoder)
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention: Literal["auto", "reference", "blockwise", "cudnn"] = "auto"  # as model.llm.attention


@dataclass
class WhisperConfig(AudioConfig):
    """Whisper's encoder (omnijax/models/whisper.py) and its log-mel features (WhisperFeatureExtractor):
    conv stem (kernel 3, the second with stride 2: `reduction` = 2), sinusoidal positions, pre-LN blocks."""
    kind: str = "whisper"
    n_mels: int = 80
    reduction: int = 2
    embed_dim: int = 64
    mlp_dim: int = 256
    norm_eps: float = 1e-5
    max_source_positions: int = 1500  # encoder tokens of a 30 s window (its position table)
    chunk_frames: int = 3000     # the feature extractor's window (nb_max_frames); longer clips are cut there (as HF)
    activation: Literal["gelu", "gelu_new", "relu"] = "gelu"

    @property
    def max_frames(self) -> int:
        """Frames a clip may keep: the window, and no more than the position table covers."""
        return min(self.chunk_frames, 2 * self.max_source_positions)


@dataclass
class ProjectorConfig:
    hidden_dim: int = 0          # 0 = LLM width
    norm: bool = True            # layernorm on the encoder output first


@dataclass
class MMConfig:
    llm: LLMConfig = field(default_factory=lambda: LLMConfig(vocab_size=512))
    # encoder name -> mapping with `kind` (registry key) and that kind's config fields
    encoders: dict[str, Any] = field(default_factory=lambda: {"vision": {"kind": "vit"}, "audio": {"kind": "audio"}})
    # which encoder handles which modality
    modalities: dict[str, Any] = field(default_factory=lambda: {"image": "vision", "video": "vision", "audio": "audio"})
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)


ENCODER_CONFIGS: dict[str, type] = {"vit": VisionConfig, "qwen_vit": QwenVisionConfig, "audio": AudioConfig,
                                    "whisper": WhisperConfig}


def register_encoder_config(kind: str, cls: type) -> None:
    ENCODER_CONFIGS[kind] = cls


def encoder_config(name: str, entry: Any) -> Any:
    """The typed config of encoder `name` from its raw mapping (or an already typed config)."""
    from omnijax.config import from_dict  # local: config imports nothing from here
    if not isinstance(entry, dict):
        return entry
    kind = entry.get("kind")
    if kind not in ENCODER_CONFIGS:
        raise ConfigError(f"model.encoders.{name}.kind={kind!r}: must be one of {', '.join(sorted(ENCODER_CONFIGS))}")
    cfg = from_dict(ENCODER_CONFIGS[kind], entry, prefix=f"model.encoders.{name}.")
    return validate_encoder(name, cfg)


def validate_encoder(name: str, cfg: Any) -> Any:
    where = f"model.encoders.{name}"
    for f in ("embed_dim", "num_layers", "num_heads", "mlp_dim"):
        if getattr(cfg, f) <= 0:
            raise ConfigError(f"{where}.{f}={getattr(cfg, f)}: must be > 0")
    if cfg.embed_dim % cfg.num_heads:
        raise ConfigError(f"{where}.embed_dim={cfg.embed_dim} must be a multiple of num_heads={cfg.num_heads}")
    if isinstance(cfg, VisionConfig):
        for f in ("patch", "temporal_patch", "merge", "max_side", "learned_grid"):
            if getattr(cfg, f) <= 0:
                raise ConfigError(f"{where}.{f}={getattr(cfg, f)}: must be > 0")
        if cfg.max_side < cfg.patch * cfg.merge:
            raise ConfigError(f"{where}.max_side={cfg.max_side} must be >= patch*merge={cfg.patch * cfg.merge}")
        if cfg.image_size and cfg.image_size < cfg.patch * cfg.merge:
            raise ConfigError(f"{where}.image_size={cfg.image_size} must be 0 or >= patch*merge="
                              f"{cfg.patch * cfg.merge}")
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3 or min(cfg.image_std) <= 0:
            raise ConfigError(f"{where}.image_mean/image_std: three values each, std > 0")
    if isinstance(cfg, QwenVisionConfig):
        if cfg.out_dim <= 0 or cfg.min_pixels <= 0 or cfg.max_pixels < cfg.min_pixels:
            raise ConfigError(f"{where}: out_dim > 0 and 0 < min_pixels <= max_pixels required")
        unit = cfg.patch * cfg.merge
        if cfg.window_size and (cfg.window_size % unit or cfg.window_size < unit):
            raise ConfigError(f"{where}.window_size={cfg.window_size}: must be 0 or a multiple of patch*merge={unit}")
        bad = [i for i in cfg.fullatt_block_indexes if not 0 <= i < cfg.num_layers]
        if bad:
            raise ConfigError(f"{where}.fullatt_block_indexes: {bad} outside 0..{cfg.num_layers - 1}")
    if isinstance(cfg, AudioConfig):
        for f in ("n_mels", "n_fft", "hop", "reduction", "sample_rate"):
            if getattr(cfg, f) <= 0:
                raise ConfigError(f"{where}.{f}={getattr(cfg, f)}: must be > 0")
    if isinstance(cfg, WhisperConfig):
        if cfg.reduction != 2:
            raise ConfigError(f"{where}.reduction={cfg.reduction}: Whisper's stride-2 stem makes it 2")
        if cfg.max_source_positions <= 0 or cfg.chunk_frames <= 0:
            raise ConfigError(f"{where}.max_source_positions/chunk_frames: must be > 0")
    return cfg


def encoder_configs(cfg: MMConfig) -> dict[str, Any]:
    """name -> typed encoder config, checked against `modalities`."""
    out = {name: encoder_config(name, entry) for name, entry in cfg.encoders.items()}
    for modality, name in cfg.modalities.items():
        if modality not in ("image", "video", "audio"):
            raise ConfigError(f"model.modalities: unknown modality {modality!r}; expected image, video or audio")
        if name not in out:
            raise ConfigError(f"model.modalities.{modality}={name!r}: no such encoder; known: {', '.join(out)}")
    return out


# ---------------------------------------------------------------- token counts (from shapes only)
def _target_sides(h: int, w: int, unit: int, max_side: int | None) -> tuple[int, int]:
    scale = min(1.0, max_side / max(h, w)) if max_side else 1.0
    top = max(1, max_side // unit) if max_side else None
    out = []
    for side in (h, w):
        units = max(1, math.floor(side * scale / unit + 0.5))
        target = (min(units, top) if top else units) * unit
        if target > 2 * side:
            raise BadSample(f"image side of {side} px is too small: needs >= {(unit + 1) // 2} px "
                            f"(patch*merge={unit}, at most 2x up-scaling)")
        out.append(target)
    return out[0], out[1]


def vision_grid(shape: tuple[int, ...], patch: int, temporal_patch: int = 1, merge: int = 2,
                max_side: int | None = None, image_size: int = 0) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image [H, W, 3] or a video [T, H, W, 3], from its shape only.

    image_size > 0 (a fixed-input tower such as SigLIP): every frame becomes image_size^2 pixels, of
    which the top-left (image_size // (patch*merge)) units are patched (a valid convolution's cover)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 3:
        frames, (h, w) = 1, shape[:2]
    elif len(shape) == 4:
        frames, h, w = shape[:3]
    else:
        raise BadSample(f"vision input of shape {shape}: expected [H, W, 3] or [T, H, W, 3]")
    if shape[-1] != 3:
        raise BadSample(f"vision input of shape {shape}: expected 3 colour channels")
    if frames <= 0:
        raise BadSample(f"video with zero frames (shape {shape})")
    if h <= 0 or w <= 0:
        raise BadSample(f"empty image (shape {shape})")
    if image_size:
        side = image_size // (patch * merge) * merge
        return math.ceil(frames / temporal_patch), side, side
    th, tw = _target_sides(h, w, patch * merge, max_side)
    return math.ceil(frames / temporal_patch), th // patch, tw // patch


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, area within [min_pixels, max_pixels],
    the aspect ratio kept as closely as that allows (the rule of transformers' Qwen2VLImageProcessor)."""
    if min(height, width) <= 0:
        raise BadSample(f"empty image ({height}x{width})")
    if max(height, width) / min(height, width) > 200:
        raise BadSample(f"image of {height}x{width}: aspect ratio above 200 (Qwen2-VL's limit)")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_grid(shape: tuple[int, ...], cfg: "QwenVisionConfig") -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image [H, W, 3] or video [T, H, W, 3] under Qwen's smart resize."""
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (3, 4) or shape[-1] != 3:
        raise BadSample(f"vision input of shape {shape}: expected [H, W, 3] or [T, H, W, 3]")
    frames, (h, w) = (1, shape[:2]) if len(shape) == 3 else (shape[0], shape[1:3])
    if frames <= 0:
        raise BadSample(f"video with zero frames (shape {shape})")
    th, tw = smart_resize(h, w, cfg.patch * cfg.merge, cfg.min_pixels, cfg.max_pixels)
    return math.ceil(frames / cfg.temporal_patch), th // cfg.patch, tw // cfg.patch


def audio_frames(n_samples: int, hop: int = 160) -> int:
    """Number of log-mel frames of a clip: one per started hop."""
    if n_samples <= 0:
        raise BadSample(f"zero-length audio ({n_samples} samples)")
    return math.ceil(n_samples / hop)


def _encoder_cfg(modality: str, cfg: Any) -> Any:
    if isinstance(cfg, MMConfig):
        encs = encoder_configs(cfg)
        if modality not in cfg.modalities:
            raise BadSample(f"no encoder handles modality {modality!r}")
        return encs[cfg.modalities[modality]]
    return cfg


def encoder_tokens(modality: str, shape: tuple[int, ...], cfg: Any) -> tuple[int, int]:
    """(encoder input rows, LLM tokens) of one segment from its shape only (no payload decoding).

    `cfg` is the MMConfig or the encoder config of that modality. Text: (0, len).
    """
    if modality == "text":
        return 0, int(shape[0])
    enc = _encoder_cfg(modality, cfg)
    if modality in ("image", "video"):
        if not isinstance(enc, VisionConfig):
            raise BadSample(f"modality {modality!r} needs a vision encoder config, got {type(enc).__name__}")
        if modality == "image" and len(shape) != 3 or modality == "video" and len(shape) != 4:
            raise BadSample(f"{modality} of shape {tuple(shape)}: wrong rank")
        if isinstance(enc, QwenVisionConfig):
            t, gh, gw = qwen_grid(shape, enc)
        else:
            t, gh, gw = vision_grid(shape, enc.patch, enc.temporal_patch, enc.merge, enc.max_side, enc.image_size)
        n = t * gh * gw
        return n, n // (enc.merge * enc.merge)
    if modality == "audio":
        if not isinstance(enc, AudioConfig):
            raise BadSample(f"modality 'audio' needs an audio encoder config, got {type(enc).__name__}")
        frames = audio_frames(int(shape[0]) if len(shape) else 0, enc.hop)
        if getattr(enc, "max_frames", 0):
            frames = min(frames, enc.max_frames)
        n = math.ceil(frames / enc.reduction) * enc.reduction
        return n, n // enc.reduction
    raise BadSample(f"unknown modality {modality!r}")
