"""Vision encoder: a ViT at native resolution over one packed patch buffer (images and video).

An H x W image is (H/p)(W/p) patches (see omnijax/data/features.py for the resolution rule); many
images, of any sizes, share one buffer [N, temporal_patch*p*p*3] with per-image segment ids, and
attention stays inside an image. Video is the same encoder over temporal patches (temporal_patch
frames per patch), so its cost grows with frames x patches. Positions are (t, h, w) grid
coordinates: rotary over the three axes (any grid) or, for imported checkpoints such as SigLIP, a
learned table indexed by (h, w). The optional merger groups merge x merge neighbouring patches
(consecutive rows by construction of the buffer) into one output token of width merge^2 * D.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import from_dict
from omnijax.mm_config import VisionConfig, encoder_tokens
from omnijax.models.encoder_layers import (EncoderBlock, GeluMLP, as_static, compute_dtype, layer_norm, linear,
                                           rope_inv_freq, run_blocks, transformer_flops)
from omnijax.layers import sequence
from omnijax.layers.attention import dot_product_attention


def relative_coordinate_features(positions: jax.Array, segment_ids: jax.Array, freqs: int) -> jax.Array:
    """Sinusoids [N, 6 * freqs] of each patch's (t, h, w) divided by its own segment's grid extent.

    Interpolable absolute position for any grid: the extent of every image/clip comes from a segment
    max over the packed buffer, so "top left" means the same thing at every resolution. The max is
    taken over the whole segment even when sequence parallelism splits it over devices
    (`omnijax.layers.sequence`), so every split computes the single-device features.
    """
    n = positions.shape[0]
    extent = sequence.segment_extent(segment_ids, positions.astype(jnp.int32))
    coords = (positions.astype(jnp.float32) + 0.5) / extent.astype(jnp.float32)  # (0, 1)
    angles = coords[:, :, None] * (jnp.pi * jnp.arange(1, freqs + 1, dtype=jnp.float32))
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(n, 6 * freqs)


class PoolingHead(nnx.Module):
    """Attention pooling with a learned probe query, one vector per segment (SigLIP's head)."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, eps: float, *, rngs: nnx.Rngs, attention: str = "auto"):
        self.heads = heads
        self.impl = attention
        self.probe = nnx.Param(jax.random.normal(rngs.params(), (dim,), jnp.float32), out_sharding=("embed",))
        self.q = linear(dim, dim, ("embed", "heads"), rngs)
        self.k = linear(dim, dim, ("embed", "heads"), rngs)
        self.v = linear(dim, dim, ("embed", "heads"), rngs)
        self.o = linear(dim, dim, ("heads", "embed"), rngs)
        self.norm = layer_norm(dim, eps, rngs)
        self.mlp = GeluMLP(dim, mlp_dim, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
        """x [N, D], segment_ids [N] (1-based) -> [num_segments, D] (segment s at row s-1)."""
        n, d = x.shape
        dh = d // self.heads
        q = jnp.broadcast_to(self.q(self.probe[...].astype(x.dtype)).reshape(1, 1, self.heads, dh), (num_segments, 1, self.heads, dh))
        k = jnp.broadcast_to(self.k(x).reshape(1, n, self.heads, dh), (num_segments, n, self.heads, dh))
        v = jnp.broadcast_to(self.v(x).reshape(1, n, self.heads, dh), (num_segments, n, self.heads, dh))
        q_seg = jnp.arange(1, num_segments + 1, dtype=jnp.int32)[:, None]
        kv_seg = jnp.broadcast_to(segment_ids[None].astype(jnp.int32), (num_segments, n))
        zero_q, zero_kv = jnp.zeros_like(q_seg), jnp.zeros_like(kv_seg)
        out, lse = dot_product_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=zero_q,
                                         kv_positions=zero_kv, causal=False, impl=self.impl, return_lse=True)
        out = sequence.merge_partial_softmax(out, lse)  # a segment split over an esp group pools all its rows
        h = self.o(out.reshape(num_segments, d))
        return h + self.mlp(self.norm(h))


class VisionEncoder(nnx.Module):
    """Packed ViT: (patches [N, Din], segment_ids [N], positions [N, 3]) -> [N / merge^2, merge^2 * D]."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        self.config_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)  # static attrs must hash
        self.learned_grid = cfg.learned_grid
        self.frame_attention = cfg.frame_attention
        d = cfg.embed_dim
        self.input_dim = cfg.temporal_patch * cfg.patch * cfg.patch * 3
        self.reduction = cfg.merge * cfg.merge
        self.out_dim = d * self.reduction
        self.patch_embed = linear(self.input_dim, d, (None, "embed"), rngs, bias=cfg.patch_bias)
        if cfg.position == "learned":
            g = cfg.learned_grid
            self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (g * g, d), jnp.float32),
                                       out_sharding=(None, "embed"))
            self.inv_freq = None
        else:
            self.pos_embed = None
            self.inv_freq = as_static(rope_inv_freq(d // cfg.num_heads, 3, cfg.rope_theta))
        self.abs_freqs = cfg.abs_freqs
        self.abs_pos = (linear(6 * cfg.abs_freqs, d, (None, "embed"), rngs) if cfg.abs_position else None)
        self.blocks = nnx.List([EncoderBlock(d, cfg.num_heads, cfg.mlp_dim, cfg.norm_eps, rngs=rngs,
                                             attention=cfg.attention) for _ in range(cfg.num_layers)])
        self.post_norm = layer_norm(d, cfg.norm_eps, rngs) if cfg.post_norm else None
        self.head = (PoolingHead(d, cfg.num_heads, cfg.mlp_dim, cfg.norm_eps, rngs=rngs, attention=cfg.attention)
                     if cfg.head else None)

    @property
    def cfg(self) -> VisionConfig:
        return from_dict(VisionConfig, json.loads(self.config_json))

    def hidden(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """Per-patch features [N, D] after the blocks (and post-norm)."""
        dt = compute_dtype(self.patch_embed.kernel)  # the params' dtype: bf16 under trainer.compute_dtype
        x = self.patch_embed(inputs.astype(dt))
        if self.pos_embed is not None:
            g = self.learned_grid
            x = x + self.pos_embed[...][positions[:, 1] * g + positions[:, 2]].astype(dt)
        if self.abs_pos is not None:  # features in float32, projected in the compute dtype
            x = x + self.abs_pos(relative_coordinate_features(positions, segment_ids, self.abs_freqs).astype(dt))
        attend = segment_ids
        if self.frame_attention:  # an image tower over video: each frame attends within itself (LLaVA-Video)
            attend = jnp.where(segment_ids > 0, segment_ids.astype(jnp.int32) * 65536 + positions[:, 0], 0)
        x = run_blocks(self.blocks, x[None], attend[None], positions[None], self.inv_freq)[0]
        return self.post_norm(x) if self.post_norm is not None else x

    def pool(self, hidden: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
        if self.head is None:
            raise ValueError("this vision encoder has no pooling head (set head: true)")
        return self.head(hidden, segment_ids, num_segments)

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        h = self.hidden(inputs, segment_ids, positions)
        return h.reshape(h.shape[0] // self.reduction, self.out_dim)

    def cost(self, segment_shape: tuple[int, ...]) -> float:
        """Forward FLOPs of one image [H, W, 3] or video [T, H, W, 3] segment."""
        c = self.cfg
        modality = "video" if len(segment_shape) == 4 else "image"
        n, _ = encoder_tokens(modality, segment_shape, c)
        return 2.0 * n * self.input_dim * c.embed_dim + transformer_flops(n, c.embed_dim, c.mlp_dim, c.num_layers)
