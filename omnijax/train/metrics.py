"""Throughput and utilisation figures, where they are written (JSONL + TensorBoard), and how metrics.jsonl is
read back (`read_metrics`: the resume rule) and mended on resume (`mend_metrics`)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnijax.config import LLMConfig
from omnijax.errors import UserError
from omnijax.utils import read_jsonl

# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity).
PEAK_FLOPS = {
    "h200": 989e12, "h100": 989e12, "a100": 312e12, "a10g": 125e12, "l4": 121e12,
    "v100": 125e12, "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5p": 459e12, "tpu v6": 918e12,
}


def device_peak_flops(device: Any | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s, device name); peak is None where omnijax knows none (CPU)."""
    import jax   # here: job processes and benches that only read metrics files need not import jax

    device = device or jax.devices()[0]
    kind = str(getattr(device, "device_kind", device.platform)).lower()
    for key, peak in PEAK_FLOPS.items():
        if key in kind:
            return peak, kind
    return None, kind


def xla_cpu_threads() -> int | None:
    """Threads in this process's XLA:CPU intra-op pool (its `tf_XLAEigen` threads; 0 before jax made its CPU
    client, None where /proc is not readable). On CPUs the pool decides step times as much as the allocator does
    (docs/performance.md), so benchmark rows name it."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "tf_XLAEigen"
        except OSError:  # the thread ended while we looked
            continue
    return count


def llm_param_counts(cfg: LLMConfig) -> tuple[int, int]:
    """(total, active-per-token) parameters excluding the input embedding table."""
    d, h, kv, dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * h * dh + 2 * d * kv * dh + h * dh * d + (h + 2 * kv) * dh * int(cfg.qkv_bias)
    dense_mlp = 3 * d * cfg.mlp_dim
    moe = cfg.moe
    total = active = 0
    for layer in range(cfg.num_layers):
        is_moe = moe.every > 0 and layer >= moe.first and (layer - moe.first) % moe.every == 0
        norms = 2 * d
        if is_moe:
            expert = 3 * d * moe.mlp_dim
            total += attn + norms + d * moe.num_experts + moe.num_experts * expert
            active += attn + norms + d * moe.num_experts + moe.top_k * expert
        else:
            total += attn + norms + dense_mlp
            active += attn + norms + dense_mlp
    head = d * cfg.vocab_size + d  # logits projection (tied or not, it is computed) + final norm
    return total + head, active + head


def llm_flops_per_token(cfg: LLMConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N_active + 12·L·H·Dh·T (forward+backward; the attention term
    counts the full T×T score and value products, as the common MFU convention does)."""
    _, active = llm_param_counts(cfg)
    return 6.0 * active + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def _segment_sq_sum(segment_ids: np.ndarray) -> tuple[int, int]:
    """(tokens, sum over segments of length^2) of a packed buffer; ids are per row (2-D) or per buffer (1-D),
    or runs (`data.payload.Runs`: one per segment)."""
    if hasattr(segment_ids, "lengths") and hasattr(segment_ids, "starts"):
        n = np.asarray(segment_ids.lengths, np.int64)
        return int(n.sum()), int(np.square(n).sum())
    ids = np.asarray(segment_ids)
    if ids.ndim == 1:
        ids = ids[None]
    tokens = sq = 0
    for row in ids:
        counts = np.bincount(row[row > 0])
        tokens += int(counts.sum())
        sq += int(np.square(counts.astype(np.int64)).sum())
    return tokens, sq


@dataclass(frozen=True)
class FlopCounter:
    """Training FLOPs of one packed batch on its real segment lengths (forward + backward = 3x forward).

    Per span of n tokens of a transformer with N matmul parameters, L layers and attention width W:
    6·N·n + 12·L·W·n² (the full-square attention convention of `llm_flops_per_token`, applied per packed
    segment, since attention never crosses segment ids). The LLM counts every non-padding token
    (placeholders included: the LLM processes them); each encoder counts its buffer's segments; each
    projector 6·P per output token. Built once from the model (`for_model`), called per host batch."""
    llm_params: int
    llm_layers: int
    llm_width: int
    encoders: tuple[tuple[str, int, int, int, int], ...]   # (name, params, layers, width, rows per output)
    projectors: tuple[tuple[str, int], ...]                 # (name, params)

    @classmethod
    def for_model(cls, llm_cfg: LLMConfig, encoder_cfgs: dict[str, Any], encoder_params: dict[str, int],
                  projector_params: dict[str, int]) -> "FlopCounter":
        _, active = llm_param_counts(llm_cfg)
        encs = []
        for name, c in sorted(encoder_cfgs.items()):
            group = c.merge * c.merge if hasattr(c, "merge") else getattr(c, "reduction", 1)
            encs.append((name, int(encoder_params[name]), int(c.num_layers), int(c.embed_dim), int(group)))
        return cls(int(active), llm_cfg.num_layers, llm_cfg.num_heads * llm_cfg.head_dim, tuple(encs),
                   tuple(sorted((k, int(v)) for k, v in projector_params.items())))

    def __call__(self, batch: dict) -> float:
        """FLOPs of the batch; of the whole step where it carries the step's geometry (`row_docs`, encoder
        segment ids as runs) beside this host's own rows, or the step's totals (`row_docs`, and `enc_docs`
        where a host lays out only its own rows' encoder segments: the data plane on several processes)."""
        if "row_docs" in batch:
            tokens, sq = (int(x) for x in np.asarray(batch["row_docs"])[:, 1:].sum(axis=0))
        else:
            tokens, sq = _segment_sq_sum(batch["segment_ids"])
        flops = 6.0 * self.llm_params * tokens + 12.0 * self.llm_layers * self.llm_width * sq
        proj = dict(self.projectors)
        for name, params, layers, width, group in self.encoders:
            if name in batch.get("enc_docs", {}):  # the step's (segments, rows, squared rows), every host's
                _, rows, rsq = (int(x) for x in batch["enc_docs"][name])
            elif f"{name}_segment_ids" in batch:
                rows, rsq = _segment_sq_sum(batch[f"{name}_segment_ids"])
            else:
                continue
            flops += 6.0 * params * rows + 12.0 * layers * width * rsq + 6.0 * proj.get(name, 0) * (rows // group)
        return flops


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak: float | None) -> float | None:
    if not peak or not math.isfinite(tokens_per_s):
        return None
    return tokens_per_s * flops_per_token / (peak * num_devices)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray)) or hasattr(value, "dtype"):
        value = np.asarray(value)
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _tensorboardx_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when it is installed
    (1.6 s and a few hundred MB in every run here) only to recognise its tensors, and we write floats."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """One JSON object per logged step in metrics.jsonl, the same scalars as TensorBoard events."""

    def __init__(self, run_dir: Path, enabled: bool = True, append: bool = False):
        self.enabled = enabled
        self._jsonl = self._tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a" if append else "w")
        try:
            SummaryWriter = _tensorboardx_writer()
            self._tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # TensorBoard events are a convenience; JSONL is the contract
            self._tb = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    """A run's metrics.jsonl as the run stands, in step order. The resume rule: a resumed run logs again the
    steps after the checkpoint it resumed from, so a row whose step is not past the row before it supersedes
    every earlier row from its step on (they belong to the attempt the resume abandoned); once the resumed run
    is past where the first stopped, that is each step's last row. Only complete rows are read
    (`utils.read_jsonl`: the file may be being appended to); no file is no rows; a row without a step is a
    UserError naming the file."""
    path = Path(path)
    rows: list[dict] = []
    for n, row in enumerate(read_jsonl(path), 1):
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            raise UserError(f"{path}: row {n} has no step; not a metrics file, or a damaged one")
        while rows and rows[-1]["step"] >= step:
            rows.pop()
        rows.append(row)
    return rows


def mend_metrics(path: str | Path) -> None:
    """Before a resumed run appends to its metrics.jsonl: drop a last row cut short by a kill. Every complete
    row stays; the steps redone are logged again and `read_metrics` lets them supersede the earlier rows."""
    path = Path(path)
    if path.exists():
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])
