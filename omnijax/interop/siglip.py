"""Import a Hugging Face SiglipVisionModel checkpoint (config.json + *.safetensors) into VisionEncoder.

SigLIP is the fixed-resolution special case of omnijax's packed ViT: its conv patch embedding is a
linear map over (y, x, channel) patch vectors, its learned position table is indexed by (h, w), and
blocks are pre-LayerNorm with tanh-GELU MLPs, then a post-LayerNorm and an optional attention-pooling
head. Loading is numpy only (safetensors), no network.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from omnijax.data import features
from omnijax.errors import UserError
from omnijax.mm_config import VisionConfig
from omnijax.models.vision import VisionEncoder


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """VisionConfig equivalent to a SiglipVisionConfig dict (config.json)."""
    hf = hf.get("vision_config", hf)
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise UserError(f"SigLIP hidden_act={act!r} is not supported (omnijax encoders use tanh-GELU)")
    if hf.get("num_channels", 3) != 3:
        raise UserError(f"SigLIP num_channels={hf['num_channels']}: only 3-channel images are supported")
    image, patch = int(hf.get("image_size", 224)), int(hf.get("patch_size", 16))
    if image % patch:
        raise UserError(f"SigLIP image_size={image} is not a multiple of patch_size={patch}")
    return VisionConfig(patch=patch, temporal_patch=1, merge=1, max_side=image, embed_dim=int(hf["hidden_size"]),
                        num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
                        mlp_dim=int(hf["intermediate_size"]), position="learned", learned_grid=image // patch,
                        norm_eps=float(hf.get("layer_norm_eps", 1e-6)), post_norm=True,
                        head=bool(hf.get("vision_use_head", True)), patch_bias=True)


def _set(var: nnx.Variable, value: np.ndarray, name: str) -> None:
    value = np.asarray(value, np.float32)
    if tuple(var[...].shape) != value.shape:
        raise UserError(f"SigLIP weight {name}: shape {value.shape} does not fit {tuple(var[...].shape)}")
    var[...] = jnp.asarray(value)


def _linear_t(lin: nnx.Linear, w: dict, prefix: str) -> None:
    _set(lin.kernel, w[prefix + ".weight"].T, prefix + ".weight")
    _set(lin.bias, w[prefix + ".bias"], prefix + ".bias")


def _norm(ln: nnx.LayerNorm, w: dict, prefix: str) -> None:
    _set(ln.scale, w[prefix + ".weight"], prefix + ".weight")
    _set(ln.bias, w[prefix + ".bias"], prefix + ".bias")


def load_weights(model: VisionEncoder, weights: dict[str, np.ndarray]) -> VisionEncoder:
    """Copy a SiglipVisionModel state dict (numpy) into `model` (built from `vision_config_from_hf`)."""
    w = {k.removeprefix("vision_model."): v for k, v in weights.items()}
    cfg = model.cfg
    d, h = cfg.embed_dim, cfg.num_heads
    dh = d // h
    try:
        conv = w["embeddings.patch_embedding.weight"]  # [d, 3, p, p] -> rows ordered (y, x, c)
        _set(model.patch_embed.kernel, conv.transpose(2, 3, 1, 0).reshape(-1, d), "patch_embedding.weight")
        _set(model.patch_embed.bias, w["embeddings.patch_embedding.bias"], "patch_embedding.bias")
        _set(model.pos_embed, w["embeddings.position_embedding.weight"], "position_embedding.weight")
        for i, block in enumerate(model.blocks):
            p = f"encoder.layers.{i}"
            _norm(block.ln1, w, p + ".layer_norm1")
            _norm(block.ln2, w, p + ".layer_norm2")
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                _set(getattr(block.attn, ours), w[f"{p}.self_attn.{theirs}.weight"].T.reshape(d, h, dh), f"{p}.{theirs}")
                _set(getattr(block.attn, ours + "_bias"), w[f"{p}.self_attn.{theirs}.bias"].reshape(h, dh), f"{p}.{theirs}.bias")
            _set(block.attn.o, w[f"{p}.self_attn.out_proj.weight"].T.reshape(h, dh, d), f"{p}.out_proj")
            _set(block.attn.o_bias, w[f"{p}.self_attn.out_proj.bias"], f"{p}.out_proj.bias")
            _linear_t(block.mlp.fc1, w, p + ".mlp.fc1")
            _linear_t(block.mlp.fc2, w, p + ".mlp.fc2")
        _norm(model.post_norm, w, "post_layernorm")
        if model.head is not None:
            head = model.head
            _set(head.probe, w["head.probe"].reshape(d), "head.probe")
            in_w, in_b = w["head.attention.in_proj_weight"], w["head.attention.in_proj_bias"]
            for j, lin in enumerate((head.q, head.k, head.v)):
                _set(lin.kernel, in_w[j * d:(j + 1) * d].T, "head.attention.in_proj_weight")
                _set(lin.bias, in_b[j * d:(j + 1) * d], "head.attention.in_proj_bias")
            _linear_t(head.o, w, "head.attention.out_proj")
            _norm(head.norm, w, "head.layernorm")
            _linear_t(head.mlp.fc1, w, "head.mlp.fc1")
            _linear_t(head.mlp.fc2, w, "head.mlp.fc2")
    except KeyError as exc:
        raise UserError(f"SigLIP checkpoint lacks weight {exc.args[0]!r}; is it a SiglipVisionModel?") from None
    return model


def load_siglip_vision(path: str | Path, *, seed: int = 0) -> VisionEncoder:
    """Build a VisionEncoder from a directory holding config.json and model.safetensors (or shards)."""
    path = Path(path)
    cfg_file = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not cfg_file.exists() or not files:
        raise UserError(f"{path}: expected config.json and *.safetensors (a save_pretrained directory)")
    cfg = vision_config_from_hf(json.loads(cfg_file.read_text()))
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return load_weights(VisionEncoder(cfg, rngs=nnx.Rngs(seed)), weights)


def pack_images(images_nhwc: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch of same-size images [B, H, W, 3] -> one packed buffer (patches, segment_ids, positions)."""
    rows, segs, poss = [], [], []
    for i, img in enumerate(images_nhwc):
        patches, grid = features.image_patches(img, cfg.patch, cfg.temporal_patch, cfg.merge, cfg.max_side)
        rows.append(patches)
        poss.append(features.patch_positions(grid, cfg.merge))
        segs.append(np.full(len(patches), i + 1, np.int32))
    return np.concatenate(rows), np.concatenate(segs), np.concatenate(poss)
