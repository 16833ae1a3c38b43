"""Hugging Face interop: Llama / Qwen2 checkpoints (config.json + safetensors) <-> omnijax LLM.

Weights map one to one; only layouts differ. HF stores a Linear as [out, in]; omnijax keeps
[in, out] with the head axis split out: q [D, H, Dh], k/v [D, KVH, Dh], o [H, Dh, D]. Both sides use
the "rotate half" rotary layout, so no q/k permutation is needed. Conversions are transposes and
reshapes only, so export -> import is bit-exact.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.config import LLMConfig, RopeConfig, from_dict
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


# ---------------------------------------------------------------------------- weight map
def _linear_in(shape: tuple[int, ...]) -> tuple[Callable, Callable]:
    """omnijax [in, *out] <-> HF [prod(out), in]."""
    def to_ours(w):
        return w.T.reshape(shape)

    def to_hf(p):
        return p.reshape(shape[0], -1).T
    return to_ours, to_hf


def _linear_out(shape: tuple[int, ...]) -> tuple[Callable, Callable]:
    """omnijax [*in, out] (o: [H, Dh, D]) <-> HF [out, prod(in)]."""
    def to_ours(w):
        return w.T.reshape(shape)

    def to_hf(p):
        return p.reshape(-1, shape[-1]).T
    return to_ours, to_hf


def _same(shape):
    return (lambda w: w.reshape(shape)), (lambda p: p)


def _bias(shape):
    """omnijax [heads, Dh] <-> HF [heads * Dh]."""
    return (lambda w: w.reshape(shape)), (lambda p: p.reshape(-1))


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


_KINDS = {"same": _same, "linear_in": _linear_in, "linear_out": _linear_out, "bias": _bias}


def _weight_map(model: LLM) -> Iterator[tuple[str, nnx.Variable, Callable, Callable]]:
    """(HF name, omnijax variable, HF->omnijax, omnijax->HF) for every weight."""
    for name, var, kind in weight_layout(model):
        yield name, var, *_KINDS[kind](var.shape)


# --------------------------------------------------------------------------------- files
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not names:
            raise UserError(f"{index}: empty weight_map")
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise UserError(f"{index} lists missing shard(s): {', '.join(missing[:3])}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors weights found (omnijax reads safetensors, not .bin; "
                        "re-save with save_pretrained(safe_serialization=True))")
    return files


def load_model(path: str | Path, dtype: Any = jnp.float32) -> LLM:
    """Load a Llama/Qwen2 checkpoint directory into an omnijax LLM with params of `dtype`.

    dtype=None keeps each tensor's stored dtype. Unsupported architectures, missing files and
    weights that do not fit config.json raise UserError naming the file and the problem.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint directory not found: {path}")
    if not (path / "config.json").exists():
        raise UserError(f"{path}: no config.json (expected a Hugging Face model directory)")
    cfg = config_from_hf(_read_json(path / "config.json"))
    files = _weight_files(path)
    model = nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0)))
    wanted = {name: (var, to_ours) for name, var, to_ours, _ in _weight_map(model)}
    found: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                if name not in wanted:
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings):
                        continue
                    raise UserError(f"{file.name}: unexpected weight {name!r} for a {cfg.num_layers}-layer "
                                    f"{'tied' if cfg.tie_embeddings else 'untied'} model")
                var, to_ours = wanted[name]
                value = to_ours(np.asarray(f.get_tensor(name)))
                if value.shape != var.shape:
                    raise UserError(f"{file.name}: weight {name!r} has shape {value.shape}, config.json implies "
                                    f"{var.shape}")
                var.set_value(jnp.asarray(value, dtype=dtype))
                found.add(name)
    missing = sorted(set(wanted) - found)
    if missing:
        raise UserError(f"{path}: checkpoint lacks {len(missing)} weight(s), e.g. {missing[0]!r}")
    return model


def save_model(model: LLM, path: str | Path, model_type: str | None = None) -> Path:
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM loads.

    model_type defaults to qwen2 when the model has q/k/v biases, else llama.
    """
    from safetensors.numpy import save_file

    cfg = model.config
    model_type = model_type or ("qwen2" if cfg.qkv_bias else "llama")
    if model_type not in SUPPORTED:
        raise UserError(f"model_type {model_type!r} is not supported; omnijax exports {', '.join(SUPPORTED)}")
    if model_type == "llama" and cfg.qkv_bias:
        raise UserError("a model with q/k/v biases exports as qwen2 (Llama's attention_bias also biases o_proj)")
    if model_type == "qwen2" and not cfg.qkv_bias:
        raise UserError("qwen2 always has q/k/v biases; export this model as llama")
    tensors, dtypes = {}, set()
    for name, var, _, to_hf in _weight_map(model):
        arr = np.asarray(jax.device_get(var[...]))
        tensors[name] = np.ascontiguousarray(to_hf(arr))
        dtypes.add(str(arr.dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, model_type, dtype), indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
