"""Per-sample cost model: encoder cost + LLM cost, each a·n + b·n² per attention span.

Spans: every image, video clip and audio clip is one encoder span (n = its encoder input rows);
every packed sample is one LLM span (n = its LLM tokens, encoder outputs included), because
attention never crosses segment ids.

Default coefficients (`CostModel.from_flops`) are training FLOPs (forward + backward = 3x forward)
in MFLOP of a transformer with width d, MLP width m, L layers:
    a = 3 * 2 * L * (4 d² + 3 d m) [+ 3 * 2 * d * vocab for the LLM head]   (projections + gated MLP)
    b = 3 * 2 * L * 2 d            (QKᵀ and AV per token pair; halved for the causal LLM)
`recipes/calibrate_cost.py` replaces them with seconds fitted from timings of the real modules
(`fit_coeffs`), which also captures what FLOPs miss (memory-bound layers, kernel overheads).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from omnijax.data.sample import SampleMeta
from omnijax.data.tokens import default_mm_config, modality_encoders, segment_tokens
from omnijax.errors import UserError


@dataclass
class Coeffs:
    a: float = 1.0   # per token
    b: float = 0.0   # per token pair (attention)

    def __call__(self, n: float | np.ndarray) -> float | np.ndarray:
        return self.a * n + self.b * np.square(n)


@dataclass
class CostModel:
    llm: Coeffs = field(default_factory=Coeffs)
    encoders: dict[str, Coeffs] = field(default_factory=dict)
    unit: str = "MFLOP"

    @classmethod
    def from_flops(cls, mm_cfg: Any = None) -> "CostModel":
        """FLOP-based defaults from the model config (see module docstring)."""
        from omnijax.mm_config import encoder_configs
        mm_cfg = mm_cfg if mm_cfg is not None else default_mm_config()
        m = mm_cfg.llm
        width = m.num_heads * m.head_dim
        llm = Coeffs(6 * m.num_layers * (2 * m.embed_dim * width + 2 * m.embed_dim * m.num_kv_heads * m.head_dim
                                         + 3 * m.embed_dim * m.mlp_dim) + 6 * m.embed_dim * m.vocab_size,
                     6 * m.num_layers * 2 * width / 2)
        encs = {}
        for name, e in encoder_configs(mm_cfg).items():
            encs[name] = Coeffs(6 * e.num_layers * (4 * e.embed_dim ** 2 + 3 * e.embed_dim * e.mlp_dim),
                                6 * e.num_layers * 2 * e.embed_dim)
        scale = 1e-6
        return cls(Coeffs(llm.a * scale, llm.b * scale),
                   {k: Coeffs(v.a * scale, v.b * scale) for k, v in encs.items()}, "MFLOP")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        if not path.exists():
            raise UserError(f"cost model file not found: {path}; run `python -m recipes calibrate_cost`")
        d = json.loads(path.read_text())
        return cls(Coeffs(**d["llm"]), {k: Coeffs(**v) for k, v in d["encoders"].items()}, d.get("unit", "s"))


@dataclass(frozen=True)
class SampleCost:
    encoder: float
    llm: float
    llm_tokens: int
    encoder_rows: tuple[tuple[str, int], ...]   # (encoder name, input rows), sorted by name

    @property
    def total(self) -> float:
        return self.encoder + self.llm


def sample_cost(meta: SampleMeta, model: CostModel, mm_cfg: Any) -> SampleCost:
    """Encoder and LLM cost of one sample from its metadata."""
    names = modality_encoders(mm_cfg)
    enc_cost, llm_tokens, rows = 0.0, 0, {}
    for seg in meta.segments:
        n_in, n_llm = segment_tokens(seg, mm_cfg)
        llm_tokens += n_llm
        if seg.modality != "text":
            name = names[seg.modality]
            coeff = model.encoders.get(name)
            if coeff is None:
                raise UserError(f"cost model has no coefficients for encoder {name!r}")
            enc_cost += float(coeff(n_in))
            rows[name] = rows.get(name, 0) + n_in
    return SampleCost(enc_cost, float(model.llm(llm_tokens)), llm_tokens, tuple(sorted(rows.items())))


def fit_coeffs(time_fn: Callable[[int], float], sizes: list[int], repeats: int = 3) -> tuple[Coeffs, dict]:
    """Fit t(n) ≈ c + a n + b n² (non-negative) to the median of `repeats` timings per size.

    `time_fn(n)` returns the seconds of one span of n tokens (forward + backward of the real module).
    The constant c (dispatch overhead) is reported but not part of the per-sample cost.
    """
    from scipy.optimize import nnls
    if len(sizes) < 3:
        raise UserError("fit_coeffs needs at least 3 sizes")
    ns = np.array(sorted(set(int(n) for n in sizes)), np.float64)
    ts = np.array([np.median([time_fn(int(n)) for _ in range(repeats)]) for n in ns])
    X = np.stack([np.ones_like(ns), ns, ns * ns], -1)
    scale = X.max(0)
    coef, _ = nnls(X / scale, ts)
    c, a, b = coef / scale
    pred = X @ np.array([c, a, b])
    r2 = 1 - np.sum((ts - pred) ** 2) / max(np.sum((ts - ts.mean()) ** 2), 1e-30)
    return Coeffs(float(a), float(b)), {"const_s": float(c), "r2": float(r2), "sizes": ns.tolist(), "times_s": ts.tolist()}
