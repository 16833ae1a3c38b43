"""Rotary position embeddings with the scaling schemes Llama 3.x and Qwen2 checkpoints use.

Frequencies are a host-side pure function of (head_dim, RopeConfig) so they become compile-time
constants; rotation uses the "rotate half" layout (first half of head_dim pairs with the second half),
which is the layout Hugging Face Llama/Qwen2 weights are stored for.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.config import RopeConfig
from omnijax.errors import ConfigError


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def inv_frequencies(head_dim: int, cfg: RopeConfig) -> tuple[np.ndarray, float]:
    """Return (inverse frequencies [head_dim//2] float32, attention scale applied to cos/sin).

    none:   theta^(-2i/d)
    linear: positions interpolated by `factor` (all frequencies / factor)
    llama3: low frequencies / factor, high frequencies kept, smooth ramp between (Llama 3.1 paper)
    yarn:   per-dimension blend of interpolation/extrapolation over a ramp set by beta_fast/beta_slow
            rotations, and cos/sin scaled by 0.1*ln(factor)+1 (YaRN, Peng et al. 2023)
    """
    if head_dim % 2:
        raise ConfigError(f"head_dim={head_dim}: must be even for rotary embeddings")
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    base_freq = (1.0 / (np.float32(cfg.theta) ** exponents)).astype(np.float32)
    scale = 1.0
    if cfg.scaling == "none":
        inv = base_freq
    elif cfg.scaling == "linear":
        inv = base_freq / np.float32(cfg.factor)
    elif cfg.scaling == "llama3":
        if cfg.high_freq_factor <= cfg.low_freq_factor:
            raise ConfigError("model.rope.high_freq_factor must be > model.rope.low_freq_factor for llama3 scaling")
        old = float(cfg.original_max_position)
        low_wavelen = old / cfg.low_freq_factor
        high_wavelen = old / cfg.high_freq_factor
        wavelen = 2 * math.pi / base_freq
        inv = np.where(wavelen > low_wavelen, base_freq / cfg.factor, base_freq)
        smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * inv / cfg.factor + smooth * inv
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, inv).astype(np.float32)
    elif cfg.scaling == "yarn":
        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(cfg.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

        low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
        inv = (base_freq / cfg.factor) * (1 - extrapolate) + base_freq * extrapolate
        scale = cfg.attention_factor if cfg.attention_factor > 0 else _yarn_mscale(cfg.factor)
    else:  # pragma: no cover - the config Literal rejects this earlier
        raise ConfigError(f"model.rope.scaling={cfg.scaling!r}: must be none, linear, llama3 or yarn")
    return np.asarray(inv, np.float32), float(scale)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, scale: float = 1.0) -> jax.Array:
    """Rotate x [B, L, H, Dh] by angles positions [B, L] * inv_freq; computed in float32."""
    inv = jnp.asarray(np.asarray(inv_freq, np.float32))
    angles = positions.astype(jnp.float32)[..., None] * inv  # [B, L, Dh/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
