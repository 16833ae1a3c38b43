"""The LLM backbone: Llama/Qwen2-family decoder (RMSNorm, RoPE, GQA, SwiGLU) with optional MoE layers.

Works on packed buffers: `segment_ids` (0 = padding, documents 1..n) and `positions` per token.
The forward is split into `embed` -> `forward_embeddings` so the multimodal model can replace
placeholder rows with encoder outputs in between, and into per-layer `blocks` + `final_norm` +
`logits` so pipeline parallelism can stack stages (dense blocks share one pytree structure).
Params are float32; computation follows the dtype of the params/inputs (cast params to bf16 for
mixed precision), with norm statistics, attention softmax and logits in float32.
"""
from __future__ import annotations

import dataclasses
import json
import math

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.layers.remat import REMAT_MODES, parse_remat as remat_mode, remat_policy  # noqa: F401 (re-exported)
from omnijax.layers.remat import remat_mode as remat_in_force
from omnijax.layers.attention import Attention
from omnijax.layers import mrope
from omnijax.layers.mlp import MLP
from omnijax.layers.moe import MoE
from omnijax.layers.norms import RMSNorm

AUX_KEYS = ("moe_aux_loss", "moe_lb_loss", "moe_dropped_tokens")


def zero_aux() -> dict:
    """Aux scalars of a dense block (same structure as a MoE block's)."""
    return {k: jnp.zeros((), jnp.float32) for k in AUX_KEYS}


def is_moe_layer(cfg: LLMConfig, layer: int) -> bool:
    """Layers first, first+every, ... are MoE; every=0 means a dense model."""
    every, first = cfg.moe.every, cfg.moe.first
    return every > 0 and layer >= first and (layer - first) % every == 0


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + ffn(norm(x)); ffn is MLP or MoE."""

    def __init__(self, cfg: LLMConfig, *, moe: bool = False, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.is_moe = moe
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg.embed_dim, cfg.mlp_dim, rngs=rngs)
        self.mrope_section = tuple(cfg.rope.mrope_section)  # static; M-RoPE when rope_positions are given

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
                 rope_positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
        h = self.attn_norm(x)
        if rope_positions is None:
            x = x + self.attn(h, segment_ids, positions)
        else:  # [B, L, 3] (t, h, w) rotary positions beside the causal positions (omnijax/layers/mrope.py)
            x = x + mrope.attention(self.attn, h, segment_ids, positions, rope_positions, self.mrope_section)
        h = self.mlp_norm(x)
        if self.is_moe:
            y, aux = self.mlp(h, segment_ids)
        else:
            y, aux = self.mlp(h), zero_aux()
        return x + y, aux

    # KV-cache path (generation), beside the training forward: the same layer, k/v kept per token
    def _ffn(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        h = self.mlp_norm(x)
        return x + (self.mlp(h, segment_ids)[0] if self.is_moe else self.mlp(h))

    def prefill(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
                cache: tuple[jax.Array, jax.Array],
                rope_positions: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """``__call__`` over the prompt, its k/v written into the layer's cache (k, v)."""
        if rope_positions is not None:
            a, k, v = mrope.prefill(self.attn, self.attn_norm(x), segment_ids, positions, rope_positions,
                                    self.mrope_section, *cache)
            return self._ffn(x + a, segment_ids), (k, v)
        a, k, v = self.attn.prefill(self.attn_norm(x), segment_ids, positions, *cache)
        return self._ffn(x + a, segment_ids), (k, v)

    def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
               rope_positions: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per row (x [B, 1, D] at positions [B]) against the layer's cache."""
        if rope_positions is not None:
            a, k, v = mrope.decode(self.attn, self.attn_norm(x), positions, rope_positions, self.mrope_section, *cache)
            return self._ffn(x + a, jnp.ones(x.shape[:2], jnp.int32)), (k, v)
        a, k, v = self.attn.decode(self.attn_norm(x), positions, *cache)
        return self._ffn(x + a, jnp.ones(x.shape[:2], jnp.int32)), (k, v)


KVCache = tuple[tuple[jax.Array, jax.Array], ...]  # per layer (k, v), each [B, S, KVH, Dh]


def run_block(fn: Callable[..., Any], block: nnx.Module, *args: Any, remat: Any = "none") -> Any:
    """``fn(block, *args)`` under the remat mode: the layer's activations are recomputed in the backward
    (``jax.checkpoint`` around the whole layer) instead of being stored, trading FLOPs for memory."""
    mode = remat_mode(remat)
    if mode == "none":
        return fn(block, *args)
    graph, state = nnx.split(block)
    return jax.checkpoint(lambda st, *a: fn(nnx.merge(graph, st), *a), policy=remat_policy(mode))(state, *args)


def default_packing(tokens_shape: tuple[int, ...], segment_ids: jax.Array | None,
                    positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """One document per row when not given: segment_ids = 1, positions = 0..L-1."""
    b, l = tokens_shape[:2]
    if segment_ids is None:
        segment_ids = jnp.ones((b, l), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    return segment_ids, positions


class LLM(nnx.Module):
    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs):
        # Kept as a JSON string: static module attributes must be hashable for jax.jit.
        self.config_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
        self.vocab_size, self.embed_dim = cfg.vocab_size, cfg.embed_dim
        self.tie_embeddings = cfg.tie_embeddings
        self.embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.embed_dim), jnp.float32) / math.sqrt(cfg.embed_dim),
            out_sharding=("vocab", "embed"))
        self.blocks = nnx.List([Block(cfg, moe=is_moe_layer(cfg, i), rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(
                jax.random.normal(rngs.params(), (cfg.embed_dim, cfg.vocab_size), jnp.float32) / math.sqrt(cfg.embed_dim),
                out_sharding=("embed", "vocab"))

    @property
    def config(self) -> LLMConfig:
        """The LLMConfig this model was built from."""
        from omnijax.config import from_dict
        return from_dict(LLMConfig, json.loads(self.config_json))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] int -> x [B, L, D] in the embedding's dtype."""
        return jnp.take(self.embedding[...], tokens, axis=0)

    def logits(self, x: jax.Array) -> jax.Array:
        """Normalised hidden states [B, L, D] -> float32 logits [B, L, V] (no final norm here)."""
        if self.lm_head is None:
            return jnp.einsum("bld,vd->blv", x, self.embedding[...].astype(x.dtype), preferred_element_type=jnp.float32)
        return jnp.einsum("bld,dv->blv", x, self.lm_head[...].astype(x.dtype), preferred_element_type=jnp.float32)

    def forward_embeddings(self, x: jax.Array, segment_ids: jax.Array | None = None,
                           positions: jax.Array | None = None, remat: Any = None,
                           head: bool = True, rope_positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """x [B, L, D] -> (logits [B, L, V] float32, aux scalars summed over layers).

        ``head=False`` returns the final-normed hidden states [B, L, D] instead of logits: the loss
        (``models.losses.head_cross_entropy``) applies the head chunk by chunk, never all logits at once.

        ``remat`` (``parallel.remat``): none | full | save_dots, per layer (see ``run_block``); None (the
        default) takes the mode in force (``omnijax.layers.remat.use_remat``, which the trainer enters with
        ``parallel.remat``), so one device and plain data parallelism recompute layers as every layout does.

        aux["moe_aux_loss"] is already multiplied by cfg.moe.aux_loss_weight (add it to the loss as
        is); aux["moe_lb_loss"] is the unweighted sum; aux["moe_dropped_tokens"] counts (token, expert)
        assignments that overflowed capacity. All are 0 for a dense model.

        ``rope_positions`` [B, L, 3] (M-RoPE models, ``model.rope.mrope_section``): each token's temporal,
        height and width rotary positions, carried per token like ``positions``, which still decide causality.
        """
        segment_ids, positions = default_packing(x.shape, segment_ids, positions)
        remat = remat_in_force() if remat is None else remat
        aux = zero_aux()
        extra = () if rope_positions is None else (rope_positions,)
        for block in self.blocks:
            x, block_aux = run_block(lambda b, *a: b(*a), block, x, segment_ids, positions, *extra, remat=remat)
            aux = {k: aux[k] + block_aux[k] for k in AUX_KEYS}
        h = self.final_norm(x)
        return (self.logits(h) if head else h), aux

    # ------------------------------------------------------------------ KV-cache path (generation)
    def prefill(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, last: jax.Array,
                cache: KVCache, rope_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Prompt embeddings x [B, L, D] (one prompt per row from index 0, right-padded with segment id 0)
        -> (float32 logits [B, V] at index ``last`` [B] of each row, the cache holding slots [0, L)).
        M-RoPE models take the prompt's ``rope_positions`` [B, L, 3] (as ``forward_embeddings``)."""
        new = []
        extra = () if rope_positions is None else (rope_positions,)
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block.prefill(x, segment_ids, positions, layer_cache, *extra)
            new.append(layer_cache)
        h = jnp.take_along_axis(x, last.astype(jnp.int32)[:, None, None], axis=1)  # [B, 1, D]
        return self.logits(self.final_norm(h))[:, 0], tuple(new)

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
               rope_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """One token per row (tokens [B] at positions [B]) -> (float32 logits [B, V], updated cache).
        M-RoPE models take each token's ``rope_positions`` [B, 3] (positions + `qwen_processor.decode_delta`)."""
        x = self.embed(tokens[:, None])
        new = []
        extra = () if rope_positions is None else (rope_positions,)
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block.decode(x, positions, layer_cache, *extra)
            new.append(layer_cache)
        return self.logits(self.final_norm(x))[:, 0], tuple(new)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        logits, _ = self.forward_embeddings(self.embed(tokens), segment_ids, positions)
        return logits


def init_cache(cfg: LLMConfig, batch: int, length: int, dtype: Any = jnp.float32) -> KVCache:
    """An empty KV cache of `length` slots per row for every layer."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def param_count(model: nnx.Module) -> int:
    return sum(int(p.size) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
