"""The Llama / Qwen2 family: config.json <-> LLMConfig, and the family's one weight table (`weight_layout`).

Weights map one to one; only layouts differ. HF stores a Linear as [out, in]; omnijax keeps
[in, out] with the head axis split out: q [D, H, Dh], k/v [D, KVH, Dh], o [H, Dh, D]. Both sides use
the "rotate half" rotary layout, so no q/k permutation is needed. Conversions are transposes and
reshapes only (the layout kinds of `layout.py`), so export -> import is bit-exact. Folders are read by the
sharded reader and written by the writer through `pretrained` (`load_llm_params`, `load_llm`, `export_llm`).
"""
from __future__ import annotations

from typing import Any, Iterator

from flax import nnx

from omnijax.config import LLMConfig, RopeConfig
from omnijax.errors import UserError
from omnijax.models.llm import LLM

SUPPORTED = ("llama", "qwen2")
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older exports carry


# ------------------------------------------------------------------------------- config
def _rope_from_hf(hf: dict) -> RopeConfig:
    """Read rope settings from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4.x)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("config.json: partial_rotary_factor != 1 is not supported by omnijax")
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind not in ("linear", "llama3", "yarn"):
        raise UserError(f"config.json: rope type {kind!r} is not supported; omnijax implements default, linear, "
                        "llama3 and yarn")
    max_pos = int(hf.get("max_position_embeddings", 8192))
    original = int(params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                   or max_pos)
    factor = params.get("factor")
    if factor is None:
        if kind != "yarn":
            raise UserError(f"config.json: rope type {kind!r} needs a 'factor'")
        factor = max_pos / original
    cfg = RopeConfig(theta=theta, scaling=kind, factor=float(factor), original_max_position=original)
    if kind == "llama3":
        cfg.low_freq_factor = float(params.get("low_freq_factor", 1.0))
        cfg.high_freq_factor = float(params.get("high_freq_factor", 4.0))
    if kind == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim") or params.get("truncate", True) is False:
            raise UserError("config.json: yarn with mscale/mscale_all_dim/truncate=false is not supported by omnijax")
        cfg.beta_fast = float(params.get("beta_fast") or 32.0)
        cfg.beta_slow = float(params.get("beta_slow") or 1.0)
        cfg.attention_factor = float(params.get("attention_factor") or 0.0)
    return cfg


def config_from_hf(hf: dict) -> LLMConfig:
    """Translate a Llama/Qwen2 config.json dict to LLMConfig; unsupported features raise UserError."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"config.json: model_type {kind!r} is not supported; omnijax imports {', '.join(SUPPORTED)}")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        n_layers, mlp, vocab = int(hf["num_hidden_layers"]), int(hf["intermediate_size"]), int(hf["vocab_size"])
    except KeyError as exc:
        raise UserError(f"config.json: missing required field {exc.args[0]!r}") from None
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (omnijax uses SwiGLU/silu)")
    if kind == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise UserError("config.json: Llama attention_bias/mlp_bias (biases on o_proj/MLP) are not supported")
    if kind == "qwen2" and hf.get("use_sliding_window"):
        raise UserError("config.json: Qwen2 use_sliding_window=true is not supported (omnijax attends to the full "
                        "document)")
    return LLMConfig(
        vocab_size=vocab, embed_dim=d, num_layers=n_layers, num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d // heads), mlp_dim=mlp,
        qkv_bias=kind == "qwen2", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(hf),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)))


def config_to_hf(cfg: LLMConfig, model_type: str, dtype: str = "float32") -> dict:
    """The config.json that transformers reads back to the same architecture."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope.theta,
                            "rope_type": "default" if cfg.rope.scaling == "none" else cfg.rope.scaling}
    if cfg.rope.scaling != "none":
        rope["factor"] = cfg.rope.factor
    if cfg.rope.scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope.original_max_position
    if cfg.rope.scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor)
    if cfg.rope.scaling == "yarn":
        rope.update(beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow)
        if cfg.rope.attention_factor > 0:
            rope["attention_factor"] = cfg.rope.attention_factor
    out = {
        "architectures": [_ARCH[model_type]], "model_type": model_type, "dtype": dtype, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": rope, "initializer_range": 0.02, "use_cache": True,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out


# ---------------------------------------------------------------------------- the weight table
def weight_layout(model: LLM) -> Iterator[tuple[str, nnx.Variable, str]]:
    """(HF name, omnijax variable, layout kind) for every weight, in the HF checkpoint's order.

    Kinds: "same" (identical arrays), "linear_in" (omnijax [in, *out] = HF [prod(out), in].T),
    "linear_out" (omnijax [*in, out] = HF [out, prod(in)].T), "bias" (omnijax [heads, Dh] = HF [heads*Dh])."""
    yield "model.embed_tokens.weight", model.embedding, "same"
    for i, blk in enumerate(model.blocks):
        if blk.is_moe:
            raise UserError(f"layer {i} is a mixture-of-experts layer; Llama/Qwen2 checkpoints have no MoE layers")
        pre = f"model.layers.{i}."
        a = blk.attn
        yield pre + "input_layernorm.weight", blk.attn_norm.scale, "same"
        yield pre + "post_attention_layernorm.weight", blk.mlp_norm.scale, "same"
        for name in ("q", "k", "v"):
            yield pre + f"self_attn.{name}_proj.weight", getattr(a, name), "linear_in"
            bias = getattr(a, f"{name}_bias")
            if bias is not None:
                yield pre + f"self_attn.{name}_proj.bias", bias, "bias"
        yield pre + "self_attn.o_proj.weight", a.o, "linear_out"
        yield pre + "mlp.gate_proj.weight", blk.mlp.gate, "linear_in"
        yield pre + "mlp.up_proj.weight", blk.mlp.up, "linear_in"
        yield pre + "mlp.down_proj.weight", blk.mlp.down, "linear_in"
    yield "model.norm.weight", model.final_norm.scale, "same"
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head, "linear_in"

