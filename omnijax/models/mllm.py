"""The multimodal model: encoders + projectors + LLM, assembled from configuration.

Every part speaks one small interface (`Component`): a forward over a packed buffer with segment
ids and positions, params annotated with logical axes, and `cost(segment_shape)` (forward FLOPs of
one segment, for balancing). Encoders are looked up by `kind` in a registry, so a new encoder is one
module plus one config entry (`register_encoder`). The model embeds the LLM token buffer, runs each
encoder over its packed inputs, projects the outputs to the LLM width and writes them into the
placeholder positions given by `<encoder>_dest` (flat indices into B*L; -1 = padding), then runs the
LLM. The loss covers text targets only (`loss_mask`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import LLMConfig, from_dict
from omnijax.mm_config import MMConfig, encoder_configs, encoder_tokens, register_encoder_config
from omnijax.errors import ConfigError
from omnijax.models.audio import AudioEncoder
from omnijax.models.llm import LLM
from omnijax.models.projector import Projector
from omnijax.models.qwen_vision import QwenVisionEncoder
from omnijax.models.vision import VisionEncoder
from omnijax.models.whisper import WhisperEncoder
from omnijax.models.losses import head_cross_entropy


class Component(Protocol):
    """What encoders (and, through `LLMComponent`, the LLM) expose to the assembly and the planner."""
    input_dim: int     # width of one packed input row
    reduction: int     # input rows per output token
    out_dim: int       # width of one output token

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array: ...
    def cost(self, segment_shape: tuple[int, ...]) -> float: ...


ENCODERS: dict[str, type] = {"vit": VisionEncoder, "qwen_vit": QwenVisionEncoder, "audio": AudioEncoder,
                             "whisper": WhisperEncoder}


def register_encoder(kind: str, config_cls: type, module_cls: type) -> None:
    """Make `kind` usable in `model.encoders.<name>.kind`: module_cls(config, rngs=) -> Component."""
    register_encoder_config(kind, config_cls)
    ENCODERS[kind] = module_cls


def llm_cost(cfg: LLMConfig, n_tokens: int) -> float:
    """Forward FLOPs of one packed document of n tokens in the LLM (linear + causal attention)."""
    d, h, kvh, dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_token = 2 * d * (h * dh + 2 * kvh * dh) + 2 * h * dh * d + 2 * 3 * d * cfg.mlp_dim
    attention = 2.0 * n_tokens * n_tokens * h * dh  # QK^T and PV, halved by causality
    return cfg.num_layers * (n_tokens * per_token + attention) + 2.0 * n_tokens * d * cfg.vocab_size


class MultimodalModel(nnx.Module):
    def __init__(self, cfg: MMConfig, *, rngs: nnx.Rngs):
        self.config_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)  # static attrs must hash
        encs = encoder_configs(cfg)
        for name, c in encs.items():
            if c.kind not in ENCODERS:
                raise ConfigError(f"model.encoders.{name}.kind={c.kind!r}: no module registered")
        self.llm = LLM(cfg.llm, rngs=rngs)
        self.encoders = nnx.Dict({name: ENCODERS[c.kind](c, rngs=rngs) for name, c in encs.items()})
        self.projectors = nnx.Dict({name: _projector(self.encoders[name], cfg, rngs) for name in encs})
        self.modalities = tuple(sorted(cfg.modalities.items()))

    @property
    def config(self) -> MMConfig:
        return from_dict(MMConfig, json.loads(self.config_json))

    def encode(self, name: str, batch: dict) -> jax.Array:
        """Projected output tokens [N_E / r_E, D_llm] of encoder `name` over its packed inputs."""
        enc = self.encoders[name]
        out = enc(batch[f"{name}_inputs"], batch[f"{name}_segment_ids"], batch[f"{name}_positions"])
        return self.projectors[name](out)

    def embed(self, batch: dict, *, zero_encoders: bool = False) -> jax.Array:
        """LLM input embeddings [B, L, D] with placeholder rows replaced by encoder outputs.

        Placeholder ids never reach the embedding table (`text_tokens`): a pretrained LLM keeps its
        vocabulary, and the tokenizer's added `<image>`/`<audio>` ids may lie beyond it."""
        x = self.llm.embed(text_tokens(batch, self.llm.config.vocab_size))
        b, l, d = x.shape
        flat = x.reshape(b * l, d)
        for name in self.encoders:
            if f"{name}_inputs" not in batch:
                continue
            proj = self.encode(name, batch).astype(flat.dtype)
            if zero_encoders:
                proj = jnp.zeros_like(proj)
            dest = batch[f"{name}_dest"]
            dest = jnp.where(dest < 0, b * l, dest)  # out of range: dropped
            flat = flat.at[dest].set(proj, mode="drop")
        return flat.reshape(b, l, d)

    def __call__(self, batch: dict, *, zero_encoders: bool = False) -> tuple[jax.Array, dict]:
        """(logits [B, L, V] float32, aux scalars)."""
        x = self.embed(batch, zero_encoders=zero_encoders)
        return self.llm.forward_embeddings(x, batch["segment_ids"], batch["positions"],
                                           rope_positions=batch.get("rope_positions"))

    def cost(self, modality: str, segment_shape: tuple[int, ...]) -> float:
        """Forward FLOPs of one segment: its encoder (if any) plus its LLM tokens in isolation."""
        cfg = self.config
        _, n_llm = encoder_tokens(modality, segment_shape, cfg)
        total = llm_cost(cfg.llm, n_llm)
        if modality != "text":
            total += self.encoders[dict(self.modalities)[modality]].cost(tuple(segment_shape))
        return total


def _projector(encoder: nnx.Module, cfg: MMConfig, rngs: nnx.Rngs) -> nnx.Module:
    """An encoder that brings its own projector (Qwen's patch merger: `make_projector`) gets it; others the
    configured LayerNorm-MLP."""
    make = getattr(encoder, "make_projector", None)
    if make is not None:
        return make(cfg.llm.embed_dim, rngs=rngs)
    return Projector(encoder.out_dim, cfg.llm.embed_dim, cfg.projector, rngs=rngs)


def text_tokens(batch: dict, vocab_size: int) -> jax.Array:
    """`batch["tokens"]` with every position an encoder output fills (`<encoder>_dest`) and every id outside
    the vocabulary set to 0: what is looked up in the embedding table (those rows are overwritten anyway)."""
    tokens = batch["tokens"]
    b, l = tokens.shape
    flat = jnp.where((tokens >= 0) & (tokens < vocab_size), tokens, 0).reshape(b * l)
    for key, dest in batch.items():
        if key.endswith("_dest") and f"{key[:-5]}_inputs" in batch:
            dest = jnp.where(dest < 0, b * l, dest).reshape(-1)
            flat = flat.at[dest].set(0, mode="drop")
    return flat.reshape(b, l)


def mm_loss(model: MultimodalModel, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """Text-target cross entropy of the multimodal model: (loss_sum, token_count, aux)."""
    x = model.embed(batch)
    h, aux = model.llm.forward_embeddings(x, batch["segment_ids"], batch["positions"], head=False,
                                          rope_positions=batch.get("rope_positions"))
    loss_sum, count = head_cross_entropy(model.llm, h, batch["targets"], batch["loss_mask"])
    return loss_sum, count, aux


def encoder_param_count(model: MultimodalModel) -> dict[str, int]:
    return {name: sum(int(p.size) for p in jax.tree.leaves(nnx.state(enc, nnx.Param)))
            for name, enc in model.encoders.items()}


def describe(model: MultimodalModel) -> dict[str, Any]:
    """Parameter counts per part (for logs/reports)."""
    count = lambda m: sum(int(p.size) for p in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    return {"llm": count(model.llm), **{f"encoder.{k}": v for k, v in encoder_param_count(model).items()},
            **{f"projector.{k}": count(p) for k, p in model.projectors.items()}}
