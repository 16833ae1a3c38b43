"""The SigLIP family: a SiglipVisionModel / SiglipModel folder's config and preprocessing <-> VisionConfig, and the
family's one weight table (`weight_layout`), which the sharded reader and the writer apply (`pretrained`:
`load_encoder_params`, `load_encoder`, `export_encoder`).

SigLIP is the fixed-resolution special case of omnijax's packed ViT: its conv patch embedding is a
linear map over (y, x, channel) patch vectors, its learned position table is indexed by (h, w), and
blocks are pre-LayerNorm with tanh-GELU MLPs, then a post-LayerNorm and an optional attention-pooling
head.
"""
from __future__ import annotations

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
    if image < patch:
        raise UserError(f"SigLIP image_size={image} is smaller than patch_size={patch}")
    # a Conv2d with stride = kernel = patch covers image // patch patches per side (so400m: 384 // 14 = 27)
    return VisionConfig(patch=patch, temporal_patch=1, merge=1, max_side=image, embed_dim=int(hf["hidden_size"]),
                        num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
                        mlp_dim=int(hf["intermediate_size"]), position="learned", learned_grid=image // patch,
                        norm_eps=float(hf.get("layer_norm_eps", 1e-6)), post_norm=True,
                        head=bool(hf.get("vision_use_head", True)), patch_bias=True)


RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box"}  # PIL's filter codes


def config_from_folder(hf: dict, pre: dict) -> VisionConfig:
    """The vision tower of a SigLIP folder with the preprocessing of its preprocessor_config.json
    (SiglipImageProcessor: resize to `size` with `resample`, rescale by 1/255, normalise by mean/std)."""
    cfg = vision_config_from_hf(hf)
    image = cfg.learned_grid * cfg.patch
    size = pre.get("size") or {"height": int(hf.get("vision_config", hf).get("image_size", 224))}
    height, width = int(size.get("height", size.get("shortest_edge", 0))), int(size.get("width", size.get("height", 0)))
    if height != width:
        raise UserError(f"SigLIP preprocessor_config.json: size {height}x{width}; omnijax resizes to a square")
    if height // cfg.patch != cfg.learned_grid:
        raise UserError(f"SigLIP preprocessor_config.json: size {height} gives a {height // cfg.patch}-patch grid, "
                        f"the position table holds {cfg.learned_grid} (config.json image_size={image})")
    code = int(pre.get("resample", 3))
    if code not in RESAMPLE:
        raise UserError(f"SigLIP preprocessor_config.json: resample={code} is not supported "
                        f"({', '.join(f'{k}={v}' for k, v in RESAMPLE.items())})")
    if pre.get("do_rescale", True) and abs(float(pre.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
        raise UserError(f"SigLIP preprocessor_config.json: rescale_factor={pre['rescale_factor']}; omnijax feeds "
                        "pixels in [0, 1] (1/255)")
    normalize = pre.get("do_normalize", True)
    mean = [float(v) for v in pre.get("image_mean", [0.5] * 3)] if normalize else [0.0] * 3
    std = [float(v) for v in pre.get("image_std", [0.5] * 3)] if normalize else [1.0] * 3
    return VisionConfig(**{**cfg.__dict__, "image_size": height, "max_side": height, "resample": RESAMPLE[code],
                           "image_mean": mean, "image_std": std, "normalize": True, "frame_attention": True})


def config_to_hf(cfg: VisionConfig, like: dict | None = None) -> dict:
    """SiglipVisionModel's config.json: the vision part of `like` (a SiglipModel's or SiglipVisionModel's), or
    one written from `cfg`."""
    if like is not None:
        vision = dict(like.get("vision_config", like))
        return {**vision, "model_type": "siglip_vision_model", "architectures": ["SiglipVisionModel"]}
    return {"architectures": ["SiglipVisionModel"], "model_type": "siglip_vision_model",
            "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_channels": 3, "image_size": cfg.learned_grid * cfg.patch,
            "patch_size": cfg.patch, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": cfg.norm_eps,
            "attention_dropout": 0.0, "vision_use_head": cfg.head, "dtype": "float32"}


def preprocessor_to_hf(cfg: VisionConfig) -> dict:
    """SiglipImageProcessor settings equal to the preprocessing omnijax applies for `cfg`."""
    size = cfg.image_size or cfg.learned_grid * cfg.patch
    code = {v: k for k, v in RESAMPLE.items()}[cfg.resample]
    return {"image_processor_type": "SiglipImageProcessor", "do_resize": True, "size": {"height": size, "width": size},
            "resample": code, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std), "do_convert_rgb": True}


def weight_layout(model: VisionEncoder, prefix: str = "vision_model."):
    """(HF name, omnijax variable, kind, HF shape or None, row offset) of every SigLIP vision weight, in
    the kinds of `omnijax.interop.layout` (q/k/v of the pooling head share one packed in_proj)."""
    cfg = model.cfg
    d, p = cfg.embed_dim, cfg.patch
    yield prefix + "embeddings.patch_embedding.weight", model.patch_embed.kernel, "conv_patch", (d, 3, p, p), 0
    yield prefix + "embeddings.patch_embedding.bias", model.patch_embed.bias, "same", None, 0
    yield prefix + "embeddings.position_embedding.weight", model.pos_embed, "same", None, 0
    for i, block in enumerate(model.blocks):
        pre = f"{prefix}encoder.layers.{i}."
        for ln, theirs in ((block.ln1, "layer_norm1"), (block.ln2, "layer_norm2")):
            yield pre + theirs + ".weight", ln.scale, "same", None, 0
            yield pre + theirs + ".bias", ln.bias, "same", None, 0
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            yield pre + f"self_attn.{theirs}.weight", getattr(block.attn, ours), "linear_in", None, 0
            yield pre + f"self_attn.{theirs}.bias", getattr(block.attn, ours + "_bias"), "reshape", (d,), 0
        yield pre + "self_attn.out_proj.weight", block.attn.o, "linear_out", None, 0
        yield pre + "self_attn.out_proj.bias", block.attn.o_bias, "same", None, 0
        for fc in ("fc1", "fc2"):
            lin = getattr(block.mlp, fc)
            yield pre + f"mlp.{fc}.weight", lin.kernel, "linear_in", None, 0
            yield pre + f"mlp.{fc}.bias", lin.bias, "same", None, 0
    yield prefix + "post_layernorm.weight", model.post_norm.scale, "same", None, 0
    yield prefix + "post_layernorm.bias", model.post_norm.bias, "same", None, 0
    if model.head is not None:
        head, pre = model.head, prefix + "head."
        yield pre + "probe", head.probe, "reshape", (1, 1, d), 0
        for j, lin in enumerate((head.q, head.k, head.v)):
            yield pre + "attention.in_proj_weight", lin.kernel, "linear_in", (3 * d, d), j * d
            yield pre + "attention.in_proj_bias", lin.bias, "same", (3 * d,), j * d
        yield pre + "attention.out_proj.weight", head.o.kernel, "linear_in", None, 0
        yield pre + "attention.out_proj.bias", head.o.bias, "same", None, 0
        yield pre + "layernorm.weight", head.norm.scale, "same", None, 0
        yield pre + "layernorm.bias", head.norm.bias, "same", None, 0
        for fc in ("fc1", "fc2"):
            lin = getattr(head.mlp, fc)
            yield pre + f"mlp.{fc}.weight", lin.kernel, "linear_in", None, 0
            yield pre + f"mlp.{fc}.bias", lin.bias, "same", None, 0
