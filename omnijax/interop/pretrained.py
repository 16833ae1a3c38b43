"""Pretrained Hugging Face folders in and out: Llama/Qwen2 LLMs, SigLIP vision towers, Whisper encoders.

In: `folder_kind` and `*_config_from_folder` translate `config.json` (+ `preprocessor_config.json` for encoders)
into omnijax configs; `load_*_params(path, target)` fill a parameter state whose leaves carry their shardings
through the sharded reader (`sharded.py`), so no host ever holds the whole model. Out: `export_llm` /
`export_encoder` write HF folders under the original names, shapes and dtypes through the writer (`writer.py`:
one tensor at a time, process 0 writing) into an `utils.AtomicFolder`, renamed into place when complete. Both
directions read one layout table per family (`layout.py`); a pipelined LLM's stacks are adapted in `stacked.py`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.errors import UserError
from omnijax.interop import hf, siglip, whisper
from omnijax.interop.layout import Tensor, encoder_tensors, llm_tensors
from omnijax.interop.sharded import load_params
from omnijax.interop.stacked import flat_params, param_dtype
from omnijax.interop.tensors import TensorIndex
from omnijax.interop.writer import dump_json, write_weights
from omnijax.mm_config import VisionConfig, WhisperConfig
from omnijax.utils import AtomicFolder

KINDS = {"llama": "llama", "qwen2": "qwen2", "siglip": "siglip", "siglip_vision_model": "siglip",
         "whisper": "whisper"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                    "generation_config.json")


# ------------------------------------------------------------------------------ folders
def _folder(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"pretrained folder not found: {path}")
    if not (path / "config.json").exists():
        raise UserError(f"{path}: no config.json (expected a Hugging Face model folder from save_pretrained)")
    return path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def folder_kind(path: str | Path) -> str:
    """"llama" | "qwen2" | "siglip" | "whisper" from config.json's model_type."""
    path = _folder(path)
    model_type = _json(path / "config.json").get("model_type")
    if model_type not in KINDS:
        raise UserError(f"{path}: model_type {model_type!r} is not supported; omnijax reads "
                        f"{', '.join(sorted(KINDS))} folders")
    return KINDS[model_type]


def llm_config_from_folder(path: str | Path) -> LLMConfig:
    kind = folder_kind(path)
    if kind not in hf.SUPPORTED:
        raise UserError(f"{path}: a {kind} folder is not an LLM (expected llama or qwen2)")
    return hf.config_from_hf(_json(Path(path) / "config.json"))


def encoder_config_from_folder(path: str | Path) -> VisionConfig | WhisperConfig:
    """The encoder config of a SigLIP or Whisper folder, preprocessing included (its preprocessor_config.json)."""
    kind = folder_kind(path)
    path = Path(path)
    pre = _json(path / "preprocessor_config.json") if (path / "preprocessor_config.json").exists() else {}
    if kind == "siglip":
        return siglip.config_from_folder(_json(path / "config.json"), pre)
    if kind == "whisper":
        return whisper.config_from_hf(_json(path / "config.json"), pre)
    raise UserError(f"{path}: a {kind} folder is not an encoder (expected siglip or whisper)")


def _source_llm_tensors(path: Path) -> tuple[LLMConfig, TensorIndex, list[Tensor]]:
    cfg = llm_config_from_folder(path)
    index = TensorIndex(path)
    tensors = llm_tensors(cfg)
    known = {t.hf for t in tensors}
    extra = [n for n in index.tensors if n not in known and not n.endswith(hf._IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if extra:
        raise UserError(f"{path}: unexpected tensor(s) for a {cfg.num_layers}-layer "
                        f"{'tied' if cfg.tie_embeddings else 'untied'} model, e.g. {extra[0]!r}")
    return cfg, index, tensors


def load_llm_params(path: str | Path, target: Any) -> nnx.State:
    """The LLM's Param state (`target`: leaves ShapeDtypeStruct with .sharding, or arrays) from a Llama/Qwen2 folder."""
    path = _folder(path)
    _, index, tensors = _source_llm_tensors(path)
    return load_params(index, tensors, target, str(path))


def load_llm(path: str | Path, target: Callable[[nnx.Module], Any] | None = None) -> nnx.Module:
    """The omnijax LLM of a Llama/Qwen2 folder, read by the sharded reader. `target(abstract model)` gives its
    Param state's ShapeDtypeStructs in the shardings to read into (serving's layout: each host reads only its
    shards); without it, on one device (jax's first), for tests, benches and tools."""
    from omnijax.models.llm import LLM

    cfg = llm_config_from_folder(path)
    abstract = nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    return nnx.merge(graphdef, load_llm_params(path, params if target is None else target(abstract)), rest)


def _whisper_prefix(index: TensorIndex) -> str:
    return "model.encoder." if "model.encoder.conv1.weight" in index else "encoder."


def _siglip_prefix(index: TensorIndex) -> str:
    """SiglipModel and older SiglipVisionModel files say `vision_model.`; transformers 5 saves a
    SiglipVisionModel bare."""
    return "" if "embeddings.patch_embedding.weight" in index else "vision_model."


def _prefix(cfg: Any, index: TensorIndex | None) -> str:
    if isinstance(cfg, WhisperConfig):
        return _whisper_prefix(index) if index is not None else "encoder."
    return _siglip_prefix(index) if index is not None else "vision_model."


def load_encoder_params(path: str | Path, target: Any) -> nnx.State:
    """A SigLIP vision tower's or a Whisper encoder's Param state from its folder (the rest is ignored)."""
    path = _folder(path)
    cfg = encoder_config_from_folder(path)
    index = TensorIndex(path)
    prefix = _prefix(cfg, index)
    flat = nnx.to_flat_state(target if isinstance(target, nnx.State) else nnx.State(target))
    has_head = any(p and p[0] == "head" for p, _ in flat)
    if isinstance(cfg, VisionConfig) and has_head != cfg.head:  # a target built without (or with) the head
        cfg = VisionConfig(**{**cfg.__dict__, "head": has_head})
    return load_params(index, encoder_tensors(cfg, prefix), target, str(path))


def load_encoder(path: str | Path) -> nnx.Module:
    """The omnijax encoder of a SigLIP or Whisper folder (its config from `encoder_config_from_folder`) on one
    device, read by the sharded reader: the encoder-side `load_llm`."""
    cfg = encoder_config_from_folder(path)
    if isinstance(cfg, WhisperConfig):
        from omnijax.models.whisper import WhisperEncoder as Encoder
    else:
        from omnijax.models.vision import VisionEncoder as Encoder
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Encoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    return nnx.merge(graphdef, load_encoder_params(path, params), rest)


def _same_llm(a: LLMConfig, b: LLMConfig) -> bool:
    keys = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "qkv_bias",
            "tie_embeddings", "norm_eps", "rope")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def export_llm(params: Any, cfg: LLMConfig, out_dir: str | Path, *, like: str | Path | None = None,
               tokenizer_dir: str | Path | None = None) -> None:
    """An HF Llama/Qwen2 folder of the LLM's Param state: config.json, safetensors under HF names/shapes (the
    dtypes of `like`'s tensors when given, else the params'), tokenizer files; written atomically."""
    like_index = None
    if like is not None:
        like = _folder(like)
        like_cfg = _json(like / "config.json")
        model_type = folder_kind(like)
        if model_type not in hf.SUPPORTED:
            raise UserError(f"{like}: a {model_type} folder is not an LLM")
        config = like_cfg if _same_llm(hf.config_from_hf(like_cfg), cfg) else {
            **like_cfg, **hf.config_to_hf(cfg, model_type, like_cfg.get("dtype") or like_cfg.get("torch_dtype")
                                          or "float32")}
        like_index = TensorIndex(like)
    else:
        model_type = "qwen2" if cfg.qkv_bias else "llama"
        dtypes = {str(param_dtype(v)) for v in flat_params(params).values()}
        config = hf.config_to_hf(cfg, model_type, dtypes.pop() if len(dtypes) == 1 else "float32")
    hf.config_from_hf(config)  # what transformers would build must be what omnijax can: fail before writing
    tensors = llm_tensors(cfg)
    with AtomicFolder(out_dir) as folder:
        write_weights(folder, tensors, params, like_index, jax.process_index() == 0)
        if jax.process_index() == 0:
            dump_json(folder / "config.json", config)
            for src in (like, tokenizer_dir):
                if src is None:
                    continue
                for name in TOKENIZER_FILES:
                    if (Path(src) / name).exists() and not (folder / name).exists():
                        shutil.copy2(Path(src) / name, folder / name)


def export_encoder(params: Any, cfg: VisionConfig | WhisperConfig, out_dir: str | Path, *,
                   like: str | Path | None = None) -> None:
    """An HF folder of an encoder's Param state: SigLIP -> SiglipVisionModel names (`vision_model.*`),
    Whisper -> the `encoder.*` tensors (under `like`'s prefix), config.json and preprocessor_config.json."""
    like_index = None
    if like is not None:
        like = _folder(like)
        like_index = TensorIndex(like)
    if isinstance(cfg, WhisperConfig):
        prefix = _prefix(cfg, like_index)
        config = _json(like / "config.json") if like is not None else whisper.config_to_hf(cfg)
        preprocessor = whisper.preprocessor_to_hf(cfg)
    elif isinstance(cfg, VisionConfig):
        prefix = _prefix(cfg, like_index)
        config = siglip.config_to_hf(cfg, _json(like / "config.json") if like is not None else None)
        preprocessor = siglip.preprocessor_to_hf(cfg)
    else:
        raise UserError(f"encoder config {type(cfg).__name__} has no Hugging Face format")
    flat = flat_params(params)
    if isinstance(cfg, VisionConfig) and cfg.head != any(p and p[0] == "head" for p in flat):
        cfg = VisionConfig(**{**cfg.__dict__, "head": not cfg.head})
    tensors = encoder_tensors(cfg, prefix)
    with AtomicFolder(out_dir) as folder:
        write_weights(folder, tensors, params, like_index, jax.process_index() == 0)
        if jax.process_index() == 0:
            dump_json(folder / "config.json", config)
            if like is not None and (like / "preprocessor_config.json").exists():
                shutil.copy2(like / "preprocessor_config.json", folder / "preprocessor_config.json")
            else:
                dump_json(folder / "preprocessor_config.json", preprocessor)
