"""Audio encoder: log-mel frames -> grouped downsampling -> transformer over the packed clips.

The loader computes log-mel features with numpy (omnijax/data/features.py) and pads every clip to a
multiple of `reduction` frames, and the packer places clips at offsets that are multiples of it, so
grouping `reduction` consecutive rows is a strided convolution (kernel = stride = reduction) that
never mixes two clips. The transformer then attends inside each clip (segment ids) with rotary
positions over the downsampled frame index.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import from_dict
from omnijax.mm_config import AudioConfig, encoder_tokens
from omnijax.models.encoder_layers import (EncoderBlock, as_static, compute_dtype, layer_norm, linear, rope_inv_freq,
                                           run_blocks, transformer_flops)


class AudioEncoder(nnx.Module):
    """(frames [N, n_mels], segment_ids [N], positions [N, 3]) -> [N / reduction, D]."""

    def __init__(self, cfg: AudioConfig, *, rngs: nnx.Rngs):
        self.config_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)  # static attrs must hash
        d, r = cfg.embed_dim, cfg.reduction
        self.input_dim = cfg.n_mels
        self.reduction = r
        self.out_dim = d
        self.downsample = linear(r * cfg.n_mels, d, (None, "embed"), rngs)
        self.inv_freq = as_static(rope_inv_freq(d // cfg.num_heads, 1, cfg.rope_theta))
        self.blocks = nnx.List([EncoderBlock(d, cfg.num_heads, cfg.mlp_dim, cfg.norm_eps, rngs=rngs,
                                             attention=cfg.attention) for _ in range(cfg.num_layers)])
        self.post_norm = layer_norm(d, cfg.norm_eps, rngs)

    @property
    def cfg(self) -> AudioConfig:
        return from_dict(AudioConfig, json.loads(self.config_json))

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        r = self.reduction
        n = inputs.shape[0]
        dt = compute_dtype(self.downsample.kernel)  # the params' dtype: bf16 under trainer.compute_dtype
        x = jax.nn.gelu(self.downsample(inputs.astype(dt).reshape(n // r, r * self.input_dim)), approximate=True)
        seg = segment_ids[::r][None]
        pos = (positions[::r, :1] // r)[None]
        x = run_blocks(self.blocks, x[None], seg, pos, self.inv_freq)
        return self.post_norm(x[0])

    def cost(self, segment_shape: tuple[int, ...]) -> float:
        """Forward FLOPs of one waveform segment [n_samples]."""
        c = self.cfg
        n_in, n = encoder_tokens("audio", segment_shape, c)
        return 2.0 * n_in * c.n_mels * c.embed_dim + transformer_flops(n, c.embed_dim, c.mlp_dim, c.num_layers)
