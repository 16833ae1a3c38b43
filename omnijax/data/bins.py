"""The plain data of a balancing plan: items, bin capacities, a plan, and one bin's fill state.

Shared by the planners (`balance`: which bin each item goes to) and the window's repair pass
(`leveling`: even out encoder rows over a window's steps); neither owns the other.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Item:
    key: int                   # identity within the window (position in arrival order)
    cost: float
    tokens: int                # LLM tokens: must fit in one row
    enc: tuple[int, ...] = ()  # encoder input rows, one entry per encoder (fixed order)


@dataclass(frozen=True)
class Capacity:
    rows: int                  # LLM rows per bin
    row_len: int               # tokens per row
    enc: tuple[int, ...] = ()  # encoder input rows per bin, one entry per encoder

    def fits_alone(self, item: Item) -> bool:
        return item.tokens <= self.row_len and self.rows > 0 and all(e <= c for e, c in zip(item.enc, self.enc))


@dataclass(frozen=True)
class Plan:
    bins: tuple[tuple[tuple[int, int], ...], ...]   # per bin: (item key, row) in placement order
    loads: tuple[float, ...]                        # cost per bin
    unplaced: tuple[int, ...] = ()                  # keys of items that fit in no bin

    def rows_used(self) -> list[int]:
        return [1 + max((r for _, r in b), default=-1) for b in self.bins]


class Bin:
    """One bin being filled: free tokens per opened row, free encoder rows, (key, row) in placement order.

    The opened rows are also kept sorted by (free tokens, row) (`by_free`), so the best-fit row is a
    bisection and the tokens used a running count: placing an item costs O(log rows), not a scan of
    every open row (a step of thousands of rows is one bin of the layout-free selection)."""
    __slots__ = ("free", "enc", "items", "by_free", "used")

    def __init__(self, cap: Capacity):
        self.free: list[int] = []          # free tokens of each opened row
        self.enc = list(cap.enc)
        self.items: list[tuple[int, int]] = []
        self.by_free: list[tuple[int, int]] = []  # (free tokens, row), sorted
        self.used = 0                      # tokens placed

    def level(self, item: Item, cap: Capacity) -> float:
        """Fullest buffer of this bin (tokens or any encoder) after adding item, as a fraction of capacity."""
        lv = (self.used + item.tokens) / (cap.rows * cap.row_len)
        for left, c, e in zip(self.enc, cap.enc, item.enc):
            if c:
                lv = max(lv, (c - left + e) / c)
        return lv

    def row_for(self, item: Item, cap: Capacity) -> int:
        """Best-fit row index for item (the fullest open row it fits, ties: the lowest; a new row if none
        fits), or -1 if the bin cannot take it."""
        for e, c in zip(item.enc, self.enc):
            if e > c:
                return -1
        k = bisect.bisect_left(self.by_free, (item.tokens, -1))
        if k < len(self.by_free):
            return self.by_free[k][1]
        return len(self.free) if len(self.free) < cap.rows and item.tokens <= cap.row_len else -1

    def _set_free(self, row: int, free: int) -> None:
        if row == len(self.free):
            self.free.append(free)
        else:
            del self.by_free[bisect.bisect_left(self.by_free, (self.free[row], row))]
            self.free[row] = free
        bisect.insort(self.by_free, (free, row))

    def place(self, key: int, tokens: int, enc: tuple[int, ...], row: int, cap: Capacity) -> None:
        """Book `tokens` in `row` (opening rows up to it) and `enc` encoder rows under `key`."""
        while row > len(self.free):
            self._set_free(len(self.free), cap.row_len)
        self._set_free(row, (self.free[row] if row < len(self.free) else cap.row_len) - tokens)
        self.used += tokens
        self.enc = [c - e for c, e in zip(self.enc, enc)]
        self.items.append((key, row))

    def add(self, item: Item, row: int, cap: Capacity) -> None:
        self.place(item.key, item.tokens, item.enc, row, cap)

    def remove(self, item: Item) -> None:
        """Take `item` out (its row stays open)."""
        pos = next(p for p, (k, _) in enumerate(self.items) if k == item.key)
        _, row = self.items.pop(pos)
        self._set_free(row, self.free[row] + item.tokens)
        self.used -= item.tokens
        self.enc = [c + e for c, e in zip(self.enc, item.enc)]

    def snapshot(self) -> tuple:
        return list(self.free), list(self.enc), list(self.items), list(self.by_free), self.used

    def restore(self, snap: tuple) -> None:
        self.free, self.enc, self.items, self.by_free, self.used = snap


def rebuild(content: tuple[tuple[tuple[int, int], ...], ...], by_key: dict[int, Item], cap: Capacity) -> list[Bin]:
    """Bins in the state of a placement (rows opened as recorded)."""
    state = [Bin(cap) for _ in content]
    for b, placed in zip(state, content):
        for key, row in placed:
            b.add(by_key[key], row, cap)
    return state


def window_time(loads, steps: int, ranks: int, microbatches: int) -> float:
    """Sum over steps of the slowest rank's cost: how long the window runs (bins ordered (step, rank, microbatch))."""
    return float(np.asarray(loads).reshape(steps, ranks, microbatches).sum(-1).max(-1).sum())
