"""Qwen2.5-VL's (and Qwen2-VL's) vision tower as an encoder kind (`qwen_vit`) over packed patch buffers.

Inputs are the rows `omnijax.data.features.image_patches` lays out: one row per patch of `temporal_patch`
frames x patch x patch px, flattened (frame, y, x, channel), rows ordered so each 2x2 merge group is four
consecutive rows; positions are each patch's (t, h, w) grid coordinates. That is the order transformers'
Qwen2-VL processor emits too, so outputs come in the order the LLM's placeholders expect.

Attention never depends on buffer order, so the tower does not permute patches into windows as the
reference does: window attention is attention among the patches sharing (segment, t, window row, window
column) and the full-attention layers (`fullatt_block_indexes`; every layer without windows) among those
sharing (segment, t), both written as segment ids for `attention_fn()` (one temporal patch-frame never sees
another, as in the reference). Those ids are dense labels of the key tuples, computed by sorting
(`dense_ids`), exact for any number of segments, frames and windows in the buffer, and the same on every
device of a sequence-parallel group that splits a long video (the group's keys are labelled together).

The merger (norm, then the 2x2 group's four rows concatenated, Linear, GELU, Linear) is this kind's
projector (`QwenMerger`, built by `make_projector`), so stages name it `projector` (the tower is the encoder).
"""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.config import from_dict
from omnijax.layers.attention import attention_fn
from omnijax.layers.norms import rms_norm
from omnijax.layers import remat, sequence
from omnijax.mm_config import QwenVisionConfig, encoder_tokens
from omnijax.models.encoder_layers import (apply_rope_nd, as_static, compute_dtype, layer_norm, linear,
                                           transformer_flops)


def vision_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[3, head_dim/2] rotary table over (t, h, w): the first head_dim/4 pairs turn with h, the next with w
    (each at theta^(-4i/head_dim)), t turns nothing (Qwen's 2-D vision rotary)."""
    quarter = head_dim // 4
    spatial = head_dim // 2
    inv = (1.0 / np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)))
    table = np.zeros((3, head_dim // 2), np.float32)
    table[1, :quarter] = inv[:quarter]
    table[2, quarter:2 * quarter] = inv[:quarter]
    return table


def dense_ids(keys: list[jax.Array], live: jax.Array) -> jax.Array:
    """1-based labels [N] equal exactly where every key [N] (int32) is equal; 0 where not `live`.

    Inside a sequence group (`omnijax.layers.sequence`: one long video split over an esp group) the group's keys
    are gathered and labelled together, so every device gives a window the same label and sequence-parallel
    attention, which compares labels across the group, keeps the windows intact."""
    axes = sequence.sequence_group()
    if axes:
        n = live.shape[0]
        gathered = _dense_ids([jax.lax.all_gather(k, axes, axis=0, tiled=True) for k in keys],
                              jax.lax.all_gather(live, axes, axis=0, tiled=True))
        return jax.lax.dynamic_slice_in_dim(gathered, jax.lax.axis_index(axes) * n, n, axis=0)
    return _dense_ids(keys, live)


def _dense_ids(keys: list[jax.Array], live: jax.Array) -> jax.Array:
    order = jnp.lexsort(tuple(reversed(keys)))  # lexsort sorts by its last key first
    sorted_keys = [k[order] for k in keys]
    change = jnp.zeros(live.shape, bool).at[0].set(True)
    for k in sorted_keys:
        change = change.at[1:].set(change[1:] | (k[1:] != k[:-1]))
    rank = jnp.cumsum(change.astype(jnp.int32))
    ids = jnp.zeros_like(rank).at[order].set(rank)
    return jnp.where(live, ids, 0)


def attention_ids(segment_ids: jax.Array, positions: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """(frame ids, window ids) [N]: attention groups of the full and the windowed layers.

    `window` is the window side in patches (0: no windows, the window ids are the frame ids)."""
    seg = segment_ids.astype(jnp.int32)
    live = seg > 0
    pos = positions.astype(jnp.int32)
    frame = dense_ids([seg, pos[:, 0]], live)
    if not window:
        return frame, frame
    return frame, dense_ids([seg, pos[:, 0], pos[:, 1] // window, pos[:, 2] // window], live)


class QwenAttention(nnx.Module):
    """Bidirectional attention with one fused qkv projection ([D, 3, H, Dh], as HF's qkv Linear) + rotary."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs, attention: str = "auto"):
        dh = dim // heads
        self.heads, self.head_dim, self.impl = heads, dh, attention
        self.qkv = nnx.Param(jax.random.normal(rngs.params(), (dim, 3, heads, dh), jnp.float32) / math.sqrt(dim),
                             out_sharding=("embed", None, "heads", "head_dim"))
        self.qkv_bias = nnx.Param(jnp.zeros((3, heads, dh), jnp.float32), out_sharding=(None, "heads", "head_dim"))
        self.o = nnx.Param(jax.random.normal(rngs.params(), (heads, dh, dim), jnp.float32) / math.sqrt(dim),
                           out_sharding=("heads", "head_dim", "embed"))
        self.o_bias = nnx.Param(jnp.zeros((dim,), jnp.float32), out_sharding=("embed",))

    def __call__(self, x: jax.Array, ids: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
        """x [B, L, D], ids [B, L] (attention groups), positions [B, L, 3] -> [B, L, D]."""
        dt = x.dtype
        qkv = jnp.einsum("bld,dshk->bslhk", x, self.qkv[...].astype(dt)) + self.qkv_bias[...].astype(dt)[None, :, None]
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rope_nd(q, positions, inv_freq), apply_rope_nd(k, positions, inv_freq)
        flat = jnp.zeros(ids.shape, jnp.int32)  # not causal: positions only turn the rotary
        out = attention_fn()(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, q_positions=flat, kv_positions=flat,
                             causal=False, impl=self.impl)
        return jnp.einsum("blhk,hkd->bld", out, self.o[...].astype(dt)) + self.o_bias[...].astype(dt)


class QwenRMSNorm(nnx.Module):
    """RMSNorm as Qwen applies it: statistics in float32, the weight multiplied after the cast back."""

    def __init__(self, dim: int, eps: float):
        self.eps = float(eps)
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def make_norm(kind: str, dim: int, eps: float, rngs: nnx.Rngs) -> nnx.Module:
    return QwenRMSNorm(dim, eps) if kind == "rms" else layer_norm(dim, eps, rngs)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)) with biases (Qwen2.5-VL's vision MLP)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.gate = linear(dim, hidden, ("embed", "mlp"), rngs)
        self.up = linear(dim, hidden, ("embed", "mlp"), rngs)
        self.down = linear(hidden, dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class QuickGeluMLP(nnx.Module):
    """fc2(quick_gelu(fc1(x))) (Qwen2-VL's vision MLP)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.fc1 = linear(dim, hidden, ("embed", "mlp"), rngs)
        self.fc2 = linear(hidden, dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.fc1(x)
        return self.fc2(h * jax.nn.sigmoid(1.702 * h))


class QwenBlock(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, *, rngs: nnx.Rngs):
        d = cfg.embed_dim
        self.norm1 = make_norm(cfg.norm, d, cfg.norm_eps, rngs)
        self.attn = QwenAttention(d, cfg.num_heads, rngs=rngs, attention=cfg.attention)
        self.norm2 = make_norm(cfg.norm, d, cfg.norm_eps, rngs)
        self.mlp = (SwiGLU if cfg.mlp == "swiglu" else QuickGeluMLP)(d, cfg.mlp_dim, rngs=rngs)

    def __call__(self, x, ids, positions, inv_freq):
        x = x + self.attn(self.norm1(x), ids, positions, inv_freq)
        return x + self.mlp(self.norm2(x))


class QwenMerger(nnx.Module):
    """The 2x2 patch merger: norm per patch, four patches concatenated, Linear, GELU (exact), Linear.

    Takes the tower's output [N / 4, 4 * D] (four normed-to-be patch rows side by side)."""

    def __init__(self, cfg: QwenVisionConfig, out_dim: int, *, rngs: nnx.Rngs):
        d, r = cfg.embed_dim, cfg.merge * cfg.merge
        self.dim = d
        self.norm = make_norm(cfg.norm, d, 1e-6, rngs)
        self.fc1 = linear(d * r, d * r, (None, "mlp"), rngs)
        self.fc2 = linear(d * r, out_dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        n, width = x.shape
        h = self.norm(x.reshape(n, width // self.dim, self.dim)).reshape(n, width)
        return self.fc2(jax.nn.gelu(self.fc1(h), approximate=False))


class QwenVisionEncoder(nnx.Module):
    """(patches [N, Din], segment_ids [N], positions [N, 3]) -> [N / merge^2, merge^2 * D] (before the merger)."""

    def __init__(self, cfg: QwenVisionConfig, *, rngs: nnx.Rngs):
        self.config_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
        d, p, tp = cfg.embed_dim, cfg.patch, cfg.temporal_patch
        self.input_dim = tp * p * p * 3
        self.reduction = cfg.merge * cfg.merge
        self.out_dim = d * self.reduction
        # kept in the Conv3d's own shape [D, C, tp, p, p]: a linear over the flattened 3-D patch
        self.patch_embed = nnx.Param(jax.random.normal(rngs.params(), (d, 3, tp, p, p), jnp.float32)
                                     / math.sqrt(self.input_dim), out_sharding=("embed", None, None, None, None))
        self.inv_freq = as_static(vision_inv_freq(d // cfg.num_heads, cfg.rope_theta))
        self.blocks = nnx.List([QwenBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.full = tuple(range(cfg.num_layers)) if not cfg.window_size else tuple(cfg.fullatt_block_indexes)
        self.window = cfg.window_size // cfg.patch if cfg.window_size else 0  # window side in patches

    @property
    def cfg(self) -> QwenVisionConfig:
        return from_dict(QwenVisionConfig, json.loads(self.config_json))

    def make_projector(self, llm_dim: int, *, rngs: nnx.Rngs) -> QwenMerger:
        """The assembly's projector for this encoder: Qwen's own patch merger."""
        cfg = self.cfg
        if cfg.out_dim != llm_dim:
            from omnijax.errors import ConfigError
            raise ConfigError(f"qwen_vit out_dim={cfg.out_dim} must equal the LLM width {llm_dim}")
        return QwenMerger(cfg, llm_dim, rngs=rngs)

    def hidden(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """Per-patch features [N, D] after the blocks."""
        w = self.patch_embed[...]
        dt = w.dtype
        kernel = jnp.transpose(w, (2, 3, 4, 1, 0)).reshape(self.input_dim, -1)  # rows (frame, y, x, channel)
        x = inputs.astype(dt) @ kernel
        frame_ids, window_ids = attention_ids(segment_ids, positions, self.window)
        pos = positions[None]
        for i, block in enumerate(self.blocks):
            ids = frame_ids if i in self.full else window_ids
            x = remat.run_checkpointed(block, x[None], ids[None], pos, static=(self.inv_freq,))[0]
        return x

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        h = self.hidden(inputs, segment_ids, positions)
        return h.reshape(h.shape[0] // self.reduction, self.out_dim)

    def cost(self, segment_shape: tuple[int, ...]) -> float:
        """Forward FLOPs of one image [H, W, 3] or video [T, H, W, 3] (attention as if all were full)."""
        c = self.cfg
        n, _ = encoder_tokens("video" if len(segment_shape) == 4 else "image", segment_shape, c)
        merger = 2.0 * (n // self.reduction) * self.out_dim * (self.out_dim + c.out_dim)
        return 2.0 * n * self.input_dim * c.embed_dim + transformer_flops(n, c.embed_dim, c.mlp_dim, c.num_layers) \
            + merger
