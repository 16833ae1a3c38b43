"""Qwen2.5-VL / Qwen2-VL folders (`Qwen2_5_VLForConditionalGeneration`, `Qwen2VLForConditionalGeneration`) in.

The folder becomes omnijax's multimodal model as its parts: the vision tower an encoder of kind `qwen_vit`
(`omnijax/models/qwen_vision.py`), its patch merger that encoder's projector, and the Qwen2 LLM with
M-RoPE (`model.llm.rope.mrope_section`). One table (`weight_layout`) names every HF tensor, the omnijax
variable it fills and the layout kind the shared reader applies (`omnijax/interop/sharded.py`:
`load_params` over `tensors.TensorIndex`, each process reading only its shards' slices).

Both spellings of the names are read: the released checkpoints' (`visual.*`, `model.layers.*`) and the
one transformers 5 keeps in memory (`model.visual.*`, `model.language_model.*`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from flax import nnx

from omnijax.config import LLMConfig
from omnijax.errors import UserError
from omnijax.interop import hf
from omnijax.interop.layout import layout
from omnijax.interop.tensors import TensorIndex
from omnijax.mm_config import MMConfig, QwenVisionConfig

MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


@dataclass(frozen=True)
class QwenVLInfo:
    """What the folder says beyond the model's shape: the placeholder ids and the family."""
    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found (expected a Hugging Face Qwen2.5-VL folder)") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def is_qwen_vl(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.exists() and _json(cfg).get("model_type") in MODEL_TYPES


def _llm_config(top: dict) -> LLMConfig:
    text = dict(top.get("text_config") or top)  # transformers 5 nests it; released folders keep it on top
    rope = text.get("rope_parameters") or text.get("rope_scaling") or top.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section:
        raise UserError("config.json: no mrope_section in the text config's rope parameters")
    theta = float(rope.get("rope_theta", text.get("rope_theta", top.get("rope_theta", 1e6))))
    plain = {**text, "model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": theta},
             "rope_scaling": None, "use_sliding_window": False,
             "tie_word_embeddings": text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))}
    cfg = hf.config_from_hf(plain)
    cfg.rope.mrope_section = [int(s) for s in section]
    return cfg


def _vision_config(top: dict, pre: dict, llm_dim: int) -> QwenVisionConfig:
    v = top.get("vision_config") or {}
    qwen25 = top["model_type"] == "qwen2_5_vl"
    try:
        heads, depth = int(v["num_heads"]), int(v["depth"])
        patch, tp, merge = int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2)), \
            int(v.get("spatial_merge_size", 2))
    except KeyError as exc:
        raise UserError(f"config.json: vision_config lacks {exc.args[0]!r}") from None
    if qwen25:
        width, mlp_dim, out_dim = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["out_hidden_size"])
        if v.get("hidden_act", "silu") != "silu":
            raise UserError(f"config.json: vision hidden_act {v['hidden_act']!r} (Qwen2.5-VL's tower uses silu)")
        extra = dict(norm="rms", mlp="swiglu", window_size=int(v.get("window_size", 112)),
                     fullatt_block_indexes=[int(i) for i in v.get("fullatt_block_indexes", [])])
    else:
        width, out_dim = int(v["embed_dim"]), int(v["hidden_size"])
        mlp_dim = int(width * float(v.get("mlp_ratio", 4)))
        if v.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise UserError(f"config.json: vision hidden_act {v['hidden_act']!r} (Qwen2-VL's tower uses quick_gelu)")
        extra = dict(norm="layer", mlp="quick_gelu", window_size=0, fullatt_block_indexes=[])
    if out_dim != llm_dim:
        raise UserError(f"config.json: the merger's width {out_dim} differs from the LLM's {llm_dim}")
    rope = v.get("rope_parameters") or {}
    size = pre.get("size") or {}
    min_pixels = int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    return QwenVisionConfig(
        patch=patch, temporal_patch=tp, merge=merge, embed_dim=width, num_layers=depth, num_heads=heads,
        mlp_dim=mlp_dim, out_dim=out_dim, rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=1e-6,
        tokens_per_second=float(v.get("tokens_per_second", 2)) if qwen25 else 0.0, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=[float(x) for x in pre.get("image_mean", [0.48145466, 0.4578275, 0.40821073])],
        image_std=[float(x) for x in pre.get("image_std", [0.26862954, 0.26130258, 0.27577711])], **extra)


def config_from_folder(path: str | Path, encoder: str = "vision") -> tuple[MMConfig, QwenVLInfo]:
    """(the MMConfig of the folder's model, its placeholder ids); the tower is encoder `encoder`."""
    path = Path(path)
    top = _json(path / "config.json")
    if top.get("model_type") not in MODEL_TYPES:
        raise UserError(f"{path}: model_type {top.get('model_type')!r} is not a Qwen2-VL/Qwen2.5-VL folder")
    pre_path = path / "preprocessor_config.json"
    pre = _json(pre_path) if pre_path.exists() else {}
    llm = _llm_config(top)
    vision = _vision_config(top, pre, llm.embed_dim)
    from dataclasses import asdict
    mm = MMConfig(llm=llm, encoders={encoder: asdict(vision)}, modalities={"image": encoder, "video": encoder})
    ids = {k: int(top.get(k, -1)) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id")}
    return mm, QwenVLInfo(top["model_type"], **ids)


# ------------------------------------------------------------------------------ the table
def _prefixes(index: TensorIndex | None) -> tuple[str, str]:
    """(vision prefix, LLM prefix that replaces `model.`) as this folder spells them."""
    if index is not None and any(n.startswith("model.visual.") for n in index.tensors):
        return "model.visual.", "model.language_model."
    return "visual.", "model."


def weight_layout(model: nnx.Module, encoder: str = "vision",
                  index: TensorIndex | None = None) -> Iterator[tuple]:
    """(HF name, omnijax variable, layout kind[, HF shape]) for every weight of a MultimodalModel built from
    `config_from_folder` (the family's one name/shape table)."""
    vis, text = _prefixes(index)
    for name, var, kind in hf.weight_layout(model.llm):
        yield (name if name == "lm_head.weight" else text + name[len("model."):]), var, kind
    enc, merger = model.encoders[encoder], model.projectors[encoder]
    yield vis + "patch_embed.proj.weight", enc.patch_embed, "same"
    for i, blk in enumerate(enc.blocks):
        pre = f"{vis}blocks.{i}."
        for hf_norm, norm in (("norm1", blk.norm1), ("norm2", blk.norm2)):
            yield pre + hf_norm + ".weight", norm.scale, "same"
            if getattr(norm, "bias", None) is not None:
                yield pre + hf_norm + ".bias", norm.bias, "same"
        yield pre + "attn.qkv.weight", blk.attn.qkv, "linear_in"
        yield pre + "attn.qkv.bias", blk.attn.qkv_bias, "bias"
        yield pre + "attn.proj.weight", blk.attn.o, "linear_out"
        yield pre + "attn.proj.bias", blk.attn.o_bias, "same"
        names = ("gate_proj", "up_proj", "down_proj") if hasattr(blk.mlp, "gate") else ("fc1", "fc2")
        mods = (blk.mlp.gate, blk.mlp.up, blk.mlp.down) if hasattr(blk.mlp, "gate") else (blk.mlp.fc1, blk.mlp.fc2)
        for hf_name, lin in zip(names, mods):
            yield pre + f"mlp.{hf_name}.weight", lin.kernel, "linear_in"
            yield pre + f"mlp.{hf_name}.bias", lin.bias, "same"
    yield vis + "merger.ln_q.weight", merger.norm.scale, "same"
    if getattr(merger.norm, "bias", None) is not None:
        yield vis + "merger.ln_q.bias", merger.norm.bias, "same"
    for hf_i, lin in (("0", merger.fc1), ("2", merger.fc2)):
        yield vis + f"merger.mlp.{hf_i}.weight", lin.kernel, "linear_in"
        yield vis + f"merger.mlp.{hf_i}.bias", lin.bias, "same"


def tensors(cfg: MMConfig, encoder: str = "vision", index: TensorIndex | None = None) -> list:
    from omnijax.models.mllm import MultimodalModel

    model = nnx.eval_shape(lambda: MultimodalModel(cfg, rngs=nnx.Rngs(0)))
    return layout(model, weight_layout(model, encoder, index))


def load_params(path: str | Path, target: Any, encoder: str = "vision") -> nnx.State:
    """The MultimodalModel's Param state (`target`: leaves ShapeDtypeStruct with .sharding, or arrays) from a
    Qwen2-VL / Qwen2.5-VL folder, every process reading only the slices its shards hold."""
    from omnijax.interop import sharded

    path = Path(path)
    cfg, _ = config_from_folder(path, encoder)
    index = TensorIndex(path)
    table = tensors(cfg, encoder, index)
    known = {t.hf for t in table}
    extra = [n for n in index.tensors if n not in known and not n.endswith(hf._IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and cfg.llm.tie_embeddings)]
    if extra:
        raise UserError(f"{path}: unexpected tensor(s) for this config, e.g. {extra[0]!r}")
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(target if isinstance(target, nnx.State) else nnx.State(target))]
    if not any(p[:2] == ("llm", "stages") for p, _ in flat):
        return sharded.load_params(index, table, target, str(path))
    # a pipelined LLM (`llm/stages/...`, [stage, repeat, layer, ...]): the shared reader stacks a bare LLM's
    # layers into its stages, so the LLM is read as one, under its own paths, and the rest beside it
    import dataclasses

    llm = sharded.load_params(index, [dataclasses.replace(t, path=t.path[1:]) for t in table if t.path[0] == "llm"],
                              nnx.from_flat_state([(p[1:], v) for p, v in flat if p[0] == "llm"]), str(path))
    rest = sharded.load_params(index, [t for t in table if t.path[0] != "llm"],
                               nnx.from_flat_state([(p, v) for p, v in flat if p[0] != "llm"]), str(path))
    target_of = dict(flat)
    return nnx.from_flat_state([(("llm", *p), _like(target_of[("llm", *p)], v)) for p, v in nnx.to_flat_state(llm)]
                               + list(nnx.to_flat_state(rest)))


def _like(target: Any, loaded: Any) -> Any:
    """`loaded`'s array in `target`'s Variable structure: a pipelined stack is a Param holding a Param, and the
    trainer's optimizer state keeps that structure."""
    arr = loaded
    while isinstance(arr, nnx.Variable):
        arr = arr.get_value()
    inner = target.get_value() if isinstance(target, nnx.Variable) else None
    if isinstance(inner, nnx.Variable):
        return target.replace(inner.replace(arr))
    return target.replace(arr) if isinstance(target, nnx.Variable) else arr


def load_model(path: str | Path, target: Any = None, encoder: str = "vision") -> nnx.Module:
    """The MultimodalModel of a Qwen2-VL / Qwen2.5-VL folder with its parameters; `target(abstract model)`
    gives its Param state in the shardings to read into (``serve.generate.param_target``), else one device."""
    from omnijax.models.mllm import MultimodalModel

    cfg, _ = config_from_folder(path, encoder)
    abstract = nnx.eval_shape(lambda: MultimodalModel(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    params = load_params(path, target(abstract) if target is not None else params, encoder)
    return nnx.merge(graphdef, params, rest)


# ------------------------------------------------------------------------------ out
_FOLDER_FILES = ("config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                 "processor_config.json", "chat_template.json", "chat_template.jinja", "generation_config.json")


def export(params: Any, out_dir: str | Path, like: str | Path, encoder: str = "vision") -> None:
    """A Qwen2_5_VL/Qwen2VL folder of a MultimodalModel's Param state, under `like`'s names, shapes and dtypes
    (the folder the model started from): safetensors written tensor by tensor through the shared writer (every
    process gathering, process 0 writing, renamed into place when complete), `like`'s config, processor,
    chat template and tokenizer files beside them."""
    import shutil

    import jax

    from omnijax.interop.pretrained import TOKENIZER_FILES
    from omnijax.interop.writer import write_weights
    from omnijax.utils import AtomicFolder

    like = Path(like)
    cfg, _ = config_from_folder(like, encoder)
    index = TensorIndex(like)
    table = tensors(cfg, encoder, index)
    with AtomicFolder(out_dir) as folder:
        write_weights(folder, table, params, index, jax.process_index() == 0)
        if jax.process_index() == 0:
            for name in _FOLDER_FILES + TOKENIZER_FILES:
                if (like / name).exists() and not (folder / name).exists():
                    shutil.copy2(like / name, folder / name)
