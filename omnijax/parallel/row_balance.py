"""LLM-side balance: the cost of packed rows (attention stays inside a document) and spreading rows
over the batch shards so that no shard carries more than its share."""
from __future__ import annotations


import numpy as np

from omnijax.data.packing import ROW_KEYS
from omnijax.errors import ConfigError


# ------------------------------------------------------------------------- LLM-side balancing
def llm_row_costs(batch: dict, coeffs: tuple[float, float]) -> np.ndarray:
    """LLM cost of each packed row: sum over its documents of a·n + b·n² (attention stays inside one);
    every row of the step where the batch carries its geometry (`row_docs`: tokens, squared lengths)."""
    a, b = coeffs
    if "row_docs" in batch:
        docs = np.asarray(batch["row_docs"], np.float64)
        return a * docs[:, 1] + b * docs[:, 2]
    seg = np.asarray(batch["segment_ids"])
    out = np.zeros(seg.shape[0])
    for r, row in enumerate(seg):
        n = np.bincount(row[row > 0])
        n = n[n > 0].astype(np.float64)
        out[r] = float((a * n + b * n * n).sum())
    return out


def balance_rows(batch: dict, shards: int, coeffs: tuple[float, float], encoders: tuple[str, ...]) -> dict:
    """Permute the packed rows so every batch shard gets about the same LLM cost (independently of
    where their encoder work runs); each shard keeps B/shards rows. Encoder destinations follow.
    Needs the whole batch's rows (a host batch of its own rows only cannot have rows moved to it)."""
    if "rows" in batch:
        raise ConfigError("balance_rows: this batch was laid out from metadata (rows read per host, already "
                          "balanced by the data plane); its rows cannot be moved again: balance_rows=False")
    seg = np.asarray(batch["segment_ids"])
    B, L = seg.shape
    if B % shards:
        raise ConfigError(f"{B} rows do not split over {shards} batch shards")
    per = B // shards
    cost = llm_row_costs(batch, coeffs)
    load, slots = np.zeros(shards), [[] for _ in range(shards)]
    for r in sorted(range(B), key=lambda r: (-cost[r], r)):
        open_ = [s for s in range(shards) if len(slots[s]) < per]
        s = min(open_, key=lambda s: (load[s], s))
        slots[s].append(r)
        load[s] += cost[r]
    # Inside a shard, order rows so that every strided split (pipeline microbatch j = rows j, j+M, ...
    # for M = 2, 4, 8, ...) gets about the same encoder rows of each encoder and LLM cost.
    weights = [cost]
    for name in encoders:
        if f"{name}_dest" in batch:
            d = np.asarray(batch[f"{name}_dest"]).astype(np.int64)
            weights.append(np.bincount(d[d >= 0] // L, minlength=B).astype(np.float64))
    w = np.stack(weights, axis=1)  # [rows, 1 + encoders]: LLM cost, then encoder input rows
    if w.shape[1] > 1:  # LLM cost in units of encoder rows, so that no dimension is ignored
        w[:, 0] *= w[:, 1:].sum() / max(w[:, 0].sum(), 1e-12)
    order = np.array([r for s in range(shards) for r in _strided_balance(sorted(slots[s]), w)], np.int64)
    new_of_old = np.empty(B, np.int64)
    new_of_old[order] = np.arange(B)
    out = dict(batch)
    for k in ROW_KEYS:  # M-RoPE's rope_positions move with their row, never recomputed
        if k in batch:
            out[k] = np.asarray(batch[k])[order]
    for name in encoders:
        if f"{name}_dest" in batch:
            d = np.asarray(batch[f"{name}_dest"]).astype(np.int64)
            moved = new_of_old[np.clip(d, 0, None) // L] * L + np.clip(d, 0, None) % L
            out[f"{name}_dest"] = np.where(d >= 0, moved, -1).astype(np.int32)
    return out


def _strided_balance(rows: list[int], w: np.ndarray) -> list[int]:
    """Order `rows` so that positions k and k + 2^j fall into balanced halves at every level: rows
    are split (heaviest first, each to the half where it adds least to the sum of squared loads of
    the dimensions of `w`) into the even and the odd positions, recursively; so any power-of-two
    stride gives balanced classes."""
    if len(rows) <= 1:
        return list(rows)
    size = [(len(rows) + 1) // 2, len(rows) // 2]
    halves: list[list[int]] = [[], []]
    load = np.zeros((2, w.shape[1]))
    for r in sorted(rows, key=lambda r: (-float(w[r].sum()), r)):
        open_ = [h for h in (0, 1) if len(halves[h]) < size[h]]
        h = min(open_, key=lambda h: (float(((load[h] + w[r]) ** 2).sum() - (load[h] ** 2).sum()), h))
        halves[h].append(r)
        load[h] += w[r]
    out = [0] * len(rows)
    out[0::2] = _strided_balance(sorted(halves[0]), w)
    out[1::2] = _strided_balance(sorted(halves[1]), w)
    return out


def shard_cost_max_over_mean(batch: dict, shards: int, coeffs: tuple[float, float]) -> float:
    cost = llm_row_costs(batch, coeffs).reshape(shards, -1).sum(axis=1)
    return float(cost.max() / cost.mean()) if cost.mean() > 0 else 1.0


def row_costs_from_lengths(lengths: list[list[int]], coeffs: tuple[float, float]) -> np.ndarray:
    """LLM cost of each packed row from its documents' token counts (`llm_row_costs` without a batch)."""
    a, b = coeffs
    out = np.zeros(len(lengths))
    for r, docs in enumerate(lengths):
        n = np.asarray(docs, np.float64)
        out[r] = float((a * n + b * n * n).sum())
    return out
