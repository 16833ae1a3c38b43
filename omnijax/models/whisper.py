"""Whisper's audio encoder over packed log-mel buffers (the encoder half of OpenAI's Whisper).

Conv stem (Conv1d k=3 then Conv1d k=3 stride 2, GELU after each), sinusoidal position table, pre-LN
blocks with biases (q, v and out projections; Whisper's k_proj has none), exact GELU MLP, final
LayerNorm. Many clips share one buffer [N, n_mels]: the packer places each clip (padded to an even
number of frames) at an even offset, so the stride-2 convolution's outputs line up with clip starts,
and every convolution tap that would reach into another clip reads zero instead, exactly as the
convolution's zero padding does at the edges of a single clip. When sequence parallelism splits a
long clip over devices, the one row on each side of a chunk comes from the neighbouring device.
Attention stays inside each clip (segment ids). Token j of a clip gets position row j of the table,
so a clip of F frames equals HF's `WhisperEncoder` on the same features when F = 2 x max_source_positions
(the 30 s windows Whisper was trained on); shorter clips are encoded at their own length.
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
from omnijax.layers import sequence
from omnijax.layers.attention import attention_fn
from omnijax.mm_config import WhisperConfig, encoder_tokens
from omnijax.models.encoder_layers import compute_dtype, layer_norm, linear, run_blocks, transformer_flops


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's position table [length, channels]: sin of the first half, cos of the second."""
    increment = np.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-increment * np.arange(channels // 2, dtype=np.float32))
    t = np.arange(length, dtype=np.float32)[:, None] * inv[None]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def _activation(name: str):
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name == "gelu_new":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.relu


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)


class WhisperAttention(nnx.Module):
    """Bidirectional attention inside each clip; biases on q, v and the output, none on k."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs, attention: str = "auto"):
        dh = dim // heads
        self.heads, self.head_dim, self.impl = heads, dh, attention
        for name in ("q", "k", "v"):
            setattr(self, name, nnx.Param(_normal(rngs, (dim, heads, dh), dim),
                                          out_sharding=("embed", "heads", "head_dim")))
        self.q_bias = nnx.Param(jnp.zeros((heads, dh), jnp.float32), out_sharding=("heads", "head_dim"))
        self.v_bias = nnx.Param(jnp.zeros((heads, dh), jnp.float32), out_sharding=("heads", "head_dim"))
        self.o = nnx.Param(_normal(rngs, (heads, dh, dim), dim), out_sharding=("heads", "head_dim", "embed"))
        self.o_bias = nnx.Param(jnp.zeros((dim,), jnp.float32), out_sharding=("embed",))

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        dt = x.dtype
        q = jnp.einsum("bld,dhk->blhk", x, self.q[...].astype(dt)) + self.q_bias[...].astype(dt)
        k = jnp.einsum("bld,dhk->blhk", x, self.k[...].astype(dt))
        v = jnp.einsum("bld,dhk->blhk", x, self.v[...].astype(dt)) + self.v_bias[...].astype(dt)
        flat = jnp.zeros(segment_ids.shape, jnp.int32)
        out = attention_fn()(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                             q_positions=flat, kv_positions=flat, causal=False, impl=self.impl)
        return jnp.einsum("blhk,hkd->bld", out, self.o[...].astype(dt)) + self.o_bias[...].astype(dt)


class WhisperBlock(nnx.Module):
    """x + attn(ln1(x)); x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, cfg: WhisperConfig, *, rngs: nnx.Rngs):
        d = cfg.embed_dim
        self.activation = cfg.activation
        self.ln1 = layer_norm(d, cfg.norm_eps, rngs)
        self.attn = WhisperAttention(d, cfg.num_heads, rngs=rngs, attention=cfg.attention)
        self.ln2 = layer_norm(d, cfg.norm_eps, rngs)
        self.fc1 = linear(d, cfg.mlp_dim, ("embed", "mlp"), rngs)
        self.fc2 = linear(cfg.mlp_dim, d, ("mlp", "embed"), rngs)

    def __call__(self, x, segment_ids, positions, inv_freq):
        x = x + self.attn(self.ln1(x), segment_ids)
        return x + self.fc2(_activation(self.activation)(self.fc1(self.ln2(x))))


def _neighbours(x: jax.Array, seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows i-1 and i+1 of x [N, C], zero where that row belongs to another segment (or to nothing)."""
    first, last = x[:1], x[-1:]
    first_seg, last_seg = seg[:1], seg[-1:]
    axes = sequence.sequence_group()
    if axes:  # a long clip split over the group: the chunk edges' neighbours live on adjacent devices
        n = jax.lax.psum(1, axes)
        fwd, bwd = [(i, i + 1) for i in range(n - 1)], [(i + 1, i) for i in range(n - 1)]
        before, before_seg = jax.lax.ppermute(last, axes, fwd), jax.lax.ppermute(last_seg, axes, fwd)
        after, after_seg = jax.lax.ppermute(first, axes, bwd), jax.lax.ppermute(first_seg, axes, bwd)
    else:
        before, after = jnp.zeros_like(first), jnp.zeros_like(last)
        before_seg, after_seg = jnp.full_like(first_seg, -1), jnp.full_like(last_seg, -1)
    prev = jnp.concatenate([before, x[:-1]])
    prev_seg = jnp.concatenate([before_seg, seg[:-1]])
    nxt = jnp.concatenate([x[1:], after])
    nxt_seg = jnp.concatenate([seg[1:], after_seg])
    keep_prev = ((prev_seg == seg) & (seg > 0))[:, None]
    keep_next = ((nxt_seg == seg) & (seg > 0))[:, None]
    return jnp.where(keep_prev, prev, 0), jnp.where(keep_next, nxt, 0)


class WhisperEncoder(nnx.Module):
    """(log-mel frames [N, n_mels], segment_ids [N], positions [N, 3]) -> [N / 2, D]."""

    def __init__(self, cfg: WhisperConfig, *, rngs: nnx.Rngs):
        self.config_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)  # static attrs must hash
        d, m = cfg.embed_dim, cfg.n_mels
        if cfg.reduction != 2:
            raise ValueError(f"Whisper's stem halves the frame rate: reduction must be 2, got {cfg.reduction}")
        self.input_dim, self.reduction, self.out_dim = m, 2, d
        self.max_positions = cfg.max_source_positions
        self.conv1 = nnx.Param(_normal(rngs, (3, m, d), 3 * m), out_sharding=(None, None, "embed"))
        self.conv1_bias = nnx.Param(jnp.zeros((d,), jnp.float32), out_sharding=("embed",))
        self.conv2 = nnx.Param(_normal(rngs, (3, d, d), 3 * d), out_sharding=(None, None, "embed"))
        self.conv2_bias = nnx.Param(jnp.zeros((d,), jnp.float32), out_sharding=("embed",))
        self.pos_embed = nnx.Param(jnp.asarray(sinusoids(cfg.max_source_positions, d)), out_sharding=(None, "embed"))
        self.blocks = nnx.List([WhisperBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.post_norm = layer_norm(d, cfg.norm_eps, rngs)

    @property
    def cfg(self) -> WhisperConfig:
        return from_dict(WhisperConfig, json.loads(self.config_json))

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        dt = compute_dtype(self.conv1)
        seg = segment_ids.astype(jnp.int32)
        x = inputs.astype(dt)
        w1, w2 = self.conv1[...].astype(dt), self.conv2[...].astype(dt)
        prev, nxt = _neighbours(x, seg)
        h = jax.nn.gelu(prev @ w1[0] + x @ w1[1] + nxt @ w1[2] + self.conv1_bias[...].astype(dt), approximate=False)
        prev, nxt = _neighbours(h, seg)
        h = (prev[::2] @ w2[0] + h[::2] @ w2[1] + nxt[::2] @ w2[2] + self.conv2_bias[...].astype(dt))
        h = jax.nn.gelu(h, approximate=False)
        pos = jnp.clip(positions[::2, 0] // 2, 0, self.max_positions - 1)
        h = h + self.pos_embed[...][pos].astype(dt)
        h = run_blocks(self.blocks, h[None], seg[::2][None], pos[None, :, None], None)[0]
        return self.post_norm(h)

    def cost(self, segment_shape: tuple[int, ...]) -> float:
        """Forward FLOPs of one waveform segment [n_samples]."""
        c = self.cfg
        n_in, n = encoder_tokens("audio", segment_shape, c)
        stem = 2.0 * n_in * 3 * c.n_mels * c.embed_dim + 2.0 * n * 3 * c.embed_dim * c.embed_dim
        return stem + transformer_flops(n, c.embed_dim, c.mlp_dim, c.num_layers)
