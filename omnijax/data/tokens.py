"""Per-sample token counts from metadata: the one place the data plane asks the encoders' rules.

Everything (packer, cost model, reports) counts encoder input rows and LLM tokens through here, so
the counts always agree with what `omnijax.data.features` produces from the payload.
"""
from __future__ import annotations

from typing import Any

from omnijax.data.sample import SampleMeta, SegmentMeta


def default_mm_config() -> Any:
    from omnijax.mm_config import MMConfig
    return MMConfig()


def modality_encoders(mm_cfg: Any) -> dict[str, str]:
    """modality -> encoder name (image/video -> vision, audio -> audio by default)."""
    return dict(mm_cfg.modalities)


_TYPED: dict[int, tuple[Any, dict[str, Any]]] = {}


def modality_configs(mm_cfg: Any) -> dict[str, Any]:
    """modality -> typed encoder config, resolved once per config object (resolving is not cheap).

    The cache holds the config object itself, so a different object is always resolved afresh;
    mutate a config before its first use, not after.
    """
    hit = _TYPED.get(id(mm_cfg))
    if hit is not None and hit[0] is mm_cfg:
        return hit[1]
    from omnijax.mm_config import encoder_configs
    encs = encoder_configs(mm_cfg)
    typed = {m: encs[n] for m, n in mm_cfg.modalities.items()}
    _TYPED[id(mm_cfg)] = (mm_cfg, typed)
    return typed


def segment_tokens(seg: SegmentMeta, mm_cfg: Any) -> tuple[int, int]:
    """(encoder input rows, LLM tokens) of one segment; text is (0, length)."""
    from omnijax.data.features import encoder_tokens
    if seg.modality == "text":
        return 0, int(seg.shape[0])
    cfgs = modality_configs(mm_cfg)
    return encoder_tokens(seg.modality, tuple(seg.shape), cfgs.get(seg.modality, mm_cfg))


def sample_tokens(meta: SampleMeta, mm_cfg: Any = None) -> tuple[dict[str, int], int]:
    """({encoder name: input rows}, total LLM tokens incl. encoder output placeholders) of a sample."""
    mm_cfg = mm_cfg if mm_cfg is not None else default_mm_config()
    names = modality_encoders(mm_cfg)
    enc: dict[str, int] = {}
    llm = 0
    for seg in meta.segments:
        rows, toks = segment_tokens(seg, mm_cfg)
        llm += toks
        if seg.modality != "text":
            enc[names[seg.modality]] = enc.get(names[seg.modality], 0) + rows
    return enc, llm
