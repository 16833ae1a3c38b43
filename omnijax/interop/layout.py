"""The layout table of a Hugging Face format: one `Tensor` per omnijax parameter, naming the HF tensor (or the
rows of a packed one) it comes from and the layout kind that relates the two (omnijax shape S, HF shape T):
  same        S == T (or S = T[offset : offset + S[0]] for parts of a packed tensor)
  reshape     same elements, other shape (small tensors: biases, probes); read whole
  linear_in   omnijax [in, *out] = HF [offset + prod(out), in].T
  linear_out  omnijax [*in, out] = HF [out, prod(in)].T
  conv_patch  omnijax [p*p*C, d] rows (y, x, c) = HF Conv2d [d, C, p, p]
  conv1d      omnijax [k, in, out] = HF Conv1d [out, in, k]
Each family names its tensors once (`hf.weight_layout`, `siglip.weight_layout`, `whisper.weight_layout`,
`qwen_vl.weight_layout`); `layout` turns those entries into the table the sharded reader (`sharded.py`) and the
writer (`writer.py`) share."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.errors import UserError
from omnijax.interop import hf, siglip, whisper
from omnijax.mm_config import VisionConfig, WhisperConfig



@dataclass(frozen=True)
class Tensor:
    """One omnijax parameter and the HF tensor (or part of one) it comes from."""
    hf: str
    path: tuple
    kind: str
    shape: tuple[int, ...]      # omnijax shape
    hf_shape: tuple[int, ...]   # the whole HF tensor's shape
    offset: int = 0             # rows of the HF tensor before this part


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "same":
        return shape
    if kind == "linear_in":
        return (math.prod(shape[1:]), shape[0])
    if kind == "linear_out":
        return (shape[-1], math.prod(shape[:-1]))
    if kind == "conv1d":
        return (shape[2], shape[1], shape[0])
    if kind == "bias":
        return (math.prod(shape),)
    raise ValueError(kind)


def layout(module: nnx.Module, entries: Iterable[tuple]) -> list[Tensor]:
    """Tensors from (HF name, variable, kind[, HF shape, offset]) entries of an abstract module."""
    paths = {id(v): tuple(p) for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}
    out = []
    for name, var, kind, *rest in entries:
        shape = tuple(var.shape)
        hf_shape = tuple(rest[0]) if rest and rest[0] is not None else _hf_shape(kind, shape)
        if kind == "bias":
            kind = "reshape"
        out.append(Tensor(name, paths[id(var)], kind, shape, hf_shape, rest[1] if len(rest) > 1 else 0))
    return out


def llm_tensors(cfg: LLMConfig) -> list[Tensor]:
    from omnijax.models.llm import LLM

    model = nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0)))
    return layout(model, hf.weight_layout(model))


def encoder_tensors(cfg: VisionConfig | WhisperConfig, prefix: str | None = None) -> list[Tensor]:
    if isinstance(cfg, WhisperConfig):
        from omnijax.models.whisper import WhisperEncoder

        model = nnx.eval_shape(lambda: WhisperEncoder(cfg, rngs=nnx.Rngs(0)))
        return layout(model, whisper.weight_layout(model, "encoder." if prefix is None else prefix))
    if isinstance(cfg, VisionConfig):
        if cfg.position != "learned" or cfg.merge != 1 or cfg.temporal_patch != 1 or not cfg.post_norm \
                or not cfg.patch_bias:
            raise UserError("this vision encoder has no Hugging Face counterpart: only SigLIP-shaped towers "
                            "(position=learned, merge=1, temporal_patch=1, post_norm, patch_bias) export")
        from omnijax.models.vision import VisionEncoder

        model = nnx.eval_shape(lambda: VisionEncoder(cfg, rngs=nnx.Rngs(0)))
        return layout(model, siglip.weight_layout(model, "vision_model." if prefix is None else prefix))
    raise UserError(f"encoder config {type(cfg).__name__} has no Hugging Face format")


def to_hf(t: Tensor, arr: np.ndarray) -> np.ndarray:
    """The HF rows of `t` (its whole tensor, or its rows of a packed one) from omnijax's full array."""
    if t.kind == "same":
        return arr
    if t.kind == "reshape":
        return arr.reshape(t.hf_shape)
    if t.kind == "linear_in":
        return arr.reshape(t.shape[0], -1).T
    if t.kind == "linear_out":
        return arr.reshape(-1, t.shape[-1]).T
    if t.kind == "conv_patch":
        d, c, p, _ = t.hf_shape
        return arr.reshape(p, p, c, d).transpose(3, 2, 0, 1)
    if t.kind == "conv1d":
        return arr.transpose(2, 1, 0)
    raise ValueError(t.kind)
