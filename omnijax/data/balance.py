"""Decentralized grouped reordering: a pure, deterministic assignment of a window's samples to bins.

A window holds the samples of G upcoming global batches; its bins are (step in window, dp rank,
microbatch). Every host runs the same function on the same metadata and gets the same plan, then
loads only the payloads of its own ranks: no coordinator, no payload traffic.

`plan_lpt`: items sorted longest-first by cost (ties by key), each put on the least-loaded bin
(ties by bin index) where it fits: its LLM tokens in one row (best fit among the bin's rows) and its
encoder rows under the bin's encoder capacity. An item that fits no bin is reported in `unplaced`
(the loader drops and counts it); nothing is ever placed twice or over capacity.
`plan_window`: the grouped reordering over G steps. A step lasts as long as its slowest rank, so the
window's time is the sum over steps of the max rank cost. Phase 1 assigns items (longest first) to
steps, each to the step whose estimated time max(largest item, total / ranks) grows least (ties: the
lighter step, then the lower index), within the step's aggregate capacity: large items gather in
the same steps, where the other ranks get filled up to the same level. Phase 2 runs `plan_step` on
each step (LPT over ranks, then the emptiest microbatch of the chosen rank); an item that then
fits nowhere in its step goes to the least loaded bin of any step where it fits, else to
`unplaced`. The greedy also runs on the window cut into 2 and 4 parts; the plan with the shortest
window time wins.
`level_window`: a window runs one compiled program, its encoder buffers sized for its fullest step;
a repair pass over the final placement moves and swaps items between steps (and with the unplaced
ones) until each encoder's rows per step are near the window's common level.
`plan_arrival`: the baseline without reordering: batch g's samples in arrival order, split into
equal consecutive chunks per rank and microbatch (capacity not considered).
"""
from __future__ import annotations

import heapq
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


class _Bin:
    __slots__ = ("free", "enc", "items")

    def __init__(self, cap: Capacity):
        self.free: list[int] = []          # free tokens of each opened row
        self.enc = list(cap.enc)
        self.items: list[tuple[int, int]] = []

    def level(self, item: Item, cap: Capacity) -> float:
        """Fullest buffer of this bin (tokens or any encoder) after adding item, as a fraction of capacity."""
        used_tokens = sum(cap.row_len - f for f in self.free) + item.tokens
        lv = used_tokens / (cap.rows * cap.row_len)
        for left, c, e in zip(self.enc, cap.enc, item.enc):
            if c:
                lv = max(lv, (c - left + e) / c)
        return lv

    def row_for(self, item: Item, cap: Capacity) -> int:
        """Best-fit row index for item (a new row if none fits), or -1 if the bin cannot take it."""
        if any(e > c for e, c in zip(item.enc, self.enc)):
            return -1
        best, best_free = -1, None
        for r, f in enumerate(self.free):
            if item.tokens <= f and (best_free is None or f < best_free):
                best, best_free = r, f
        if best >= 0:
            return best
        return len(self.free) if len(self.free) < cap.rows and item.tokens <= cap.row_len else -1

    def add(self, item: Item, row: int, cap: Capacity) -> None:
        if row == len(self.free):
            self.free.append(cap.row_len)
        self.free[row] -= item.tokens
        self.enc = [c - e for c, e in zip(self.enc, item.enc)]
        self.items.append((item.key, row))


def plan_lpt(items: list[Item], n_bins: int, cap: Capacity) -> Plan:
    """Longest-processing-time-first greedy over `n_bins` bins, capacity-aware. Pure and deterministic."""
    return plan_step(items, n_bins, 1, cap)


def plan_step(items: list[Item], ranks: int, microbatches: int, cap: Capacity) -> Plan:
    """LPT over ranks (a rank's cost is the sum of its microbatches: they run one after the other),
    then within the chosen rank the microbatch whose fullest buffer stays lowest (the microbatch
    split does not change the rank's cost, only its padding). Bins are ordered (rank, microbatch)."""
    if ranks <= 0 or microbatches <= 0:
        raise ValueError(f"ranks={ranks}, microbatches={microbatches}: must be > 0")
    bins = [_Bin(cap) for _ in range(ranks * microbatches)]
    loads = [0.0] * len(bins)
    heap = [(0.0, r) for r in range(ranks)]
    unplaced = []
    for item in sorted(items, key=lambda it: (-it.cost, it.key)):
        tried = []
        placed = False
        while heap:
            load, r = heapq.heappop(heap)
            tried.append((load, r))
            choice = None
            for b in sorted(range(r * microbatches, (r + 1) * microbatches), key=lambda b: (bins[b].level(item, cap), b)):
                row = bins[b].row_for(item, cap)
                if row >= 0:
                    choice = (b, row)
                    break
            if choice is not None:
                b, row = choice
                bins[b].add(item, row, cap)
                loads[b] += item.cost
                tried[-1] = (load + item.cost, r)
                placed = True
                break
        for t in tried:
            heapq.heappush(heap, t)
        if not placed:
            unplaced.append(item.key)
    return Plan(tuple(tuple(b.items) for b in bins), tuple(loads), tuple(sorted(unplaced)))


def plan_window(items: list[Item], steps: int, ranks: int, microbatches: int, cap: Capacity,
                fill: float = 0.9, max_share: float = 2.0, min_share: float = 0.5,
                splits: tuple[int, ...] = (1, 2, 4), level: bool = True) -> Plan:
    """Grouped reordering of a window of `steps` global batches; bins ordered (step, rank, microbatch).

    The greedy step assignment is a heuristic, so it also runs on the window cut into `splits`
    equal parts (items in arrival order); the plan with the smallest window time (sum over steps of
    the slowest rank) wins, ties to fewer parts. Still a pure function of the items. With `level`,
    `level_window` then evens out each encoder's rows over the window's steps (one program per window).
    """
    best, best_time = None, None
    for parts in splits:
        if steps % parts or (parts > 1 and (len(items) < parts or steps // parts < 2)):
            continue
        ordered = sorted(items, key=lambda it: it.key)
        chunks = [ordered[i * len(ordered) // parts:(i + 1) * len(ordered) // parts] for i in range(parts)]
        sub = [_plan_window(c, steps // parts, ranks, microbatches, cap, fill, max_share, min_share) for c in chunks]
        plan = Plan(tuple(b for p in sub for b in p.bins), tuple(x for p in sub for x in p.loads),
                    tuple(sorted(k for p in sub for k in p.unplaced)))
        t = (_window_time(plan.loads, steps, ranks, microbatches), len(plan.unplaced))
        if best_time is None or (t[1], t[0]) < (best_time[1], best_time[0]):
            best, best_time = plan, t
    if best is None:
        best = _plan_window(items, steps, ranks, microbatches, cap, fill, max_share, min_share)
    return level_window(best, items, steps, ranks, microbatches, cap) if level else best


def _plan_window(items: list[Item], steps: int, ranks: int, microbatches: int, cap: Capacity,
                 fill: float, max_share: float, min_share: float) -> Plan:
    """One greedy pass of `plan_window` over the whole window.

    A step takes at most `fill` of its capacity and at most `max_share` times the window's mean LLM
    tokens per step; then steps under `min_share` times the mean receive the cheapest items of the
    fullest step, so steps keep comparable sizes (and none is empty while another has two items).
    """
    if steps <= 0 or ranks <= 0 or microbatches <= 0:
        raise ValueError(f"steps={steps}, ranks={ranks}, microbatches={microbatches}: all must be > 0")
    per_step = ranks * microbatches
    mean_tokens = sum(it.tokens for it in items) / steps
    tok_cap = min(fill * per_step * cap.rows * cap.row_len,
                  max(max_share * mean_tokens, max((it.tokens for it in items), default=0)))
    enc_cap = [fill * per_step * c for c in cap.enc]
    total = np.zeros(steps)
    big = np.zeros(steps)
    tok = np.zeros(steps)
    enc = np.zeros((steps, len(cap.enc)))
    members: list[list[Item]] = [[] for _ in range(steps)]
    unplaced: list[int] = []
    for it in sorted(items, key=lambda it: (-it.cost, it.key)):
        if not cap.fits_alone(it):
            unplaced.append(it.key)
            continue
        now = np.maximum(big, total / ranks)
        after = np.maximum(np.maximum(big, it.cost), (total + it.cost) / ranks)
        ok = (tok + it.tokens <= tok_cap) & np.all(enc + np.asarray(it.enc, float) <= enc_cap, axis=-1) \
            if cap.enc else (tok + it.tokens <= tok_cap)
        if not ok.any():  # aggregate capacity exhausted: fall back to the emptiest step
            ok = np.ones(steps, bool)
        order = np.lexsort((np.arange(steps), total, np.where(ok, after - now, np.inf)))
        g = int(order[0])
        members[g].append(it)
        total[g] += it.cost
        big[g] = max(big[g], it.cost)
        tok[g] += it.tokens
        enc[g] += it.enc
    tokens_of = [sum(it.tokens for it in m) for m in members]
    while True:  # lift light steps: move the last (cheapest) item of the fullest step
        light = [g for g in range(steps) if tokens_of[g] < min_share * mean_tokens or not members[g]]
        donor = max(range(steps), key=lambda g: (tokens_of[g], -g))
        if not light or len(members[donor]) < 2:
            break
        g = min(light, key=lambda g: (tokens_of[g], g))
        it = members[donor][-1]  # its last-assigned item: the cheapest in longest-first order
        if tokens_of[donor] - it.tokens < tokens_of[g] + it.tokens and members[g]:
            break  # moving would only swap which step is light
        members[g].append(members[donor].pop())
        tokens_of[donor] -= it.tokens
        tokens_of[g] += it.tokens
    bins: list[tuple[tuple[int, int], ...]] = []
    loads: list[float] = []
    spill: list[Item] = []
    for g in range(steps):
        p = plan_step(members[g], ranks, microbatches, cap)
        bins += p.bins
        loads += p.loads
        left = set(p.unplaced)
        spill += [it for it in members[g] if it.key in left]
    if spill:  # place leftovers anywhere they fit, least loaded bin first
        state = _rebuild(tuple(bins), {x.key: x for x in items}, cap)
        for it in sorted(spill, key=lambda it: (-it.cost, it.key)):
            for b in sorted(range(len(state)), key=lambda b: (loads[b], b)):
                row = state[b].row_for(it, cap)
                if row >= 0:
                    state[b].add(it, row, cap)
                    loads[b] += it.cost
                    break
            else:
                unplaced.append(it.key)
        bins = [tuple(b.items) for b in state]
    return Plan(tuple(bins), tuple(loads), tuple(sorted(unplaced)))


def plan_arrival(items: list[Item], n_bins: int, cap: Capacity) -> Plan:
    """No reordering: consecutive chunks in arrival order; rows filled first-fit without a capacity check."""
    order = sorted(items, key=lambda it: it.key)
    chunks = np.array_split(np.arange(len(order)), n_bins)
    bins, loads = [], []
    for idx in chunks:
        free: list[int] = []
        placed = []
        for i in idx:
            it = order[i]
            row = next((r for r, f in enumerate(free) if it.tokens <= f), -1)
            if row < 0:
                free.append(max(cap.row_len, it.tokens))
                row = len(free) - 1
            free[row] -= it.tokens
            placed.append((it.key, row))
        bins.append(tuple(placed))
        loads.append(float(sum(order[i].cost for i in idx)))
    return Plan(tuple(bins), tuple(loads), ())


def rank_costs(plan: Plan, steps: int, ranks: int, microbatches: int) -> np.ndarray:
    """Cost per (step, rank) [steps, ranks]; bins are ordered (step, rank, microbatch)."""
    return np.asarray(plan.loads).reshape(steps, ranks, microbatches).sum(-1)


def max_over_mean(plan: Plan, steps: int, ranks: int, microbatches: int) -> float:
    """Time-weighted imbalance of the window: sum over steps of the slowest rank's cost divided by
    the sum over steps of the mean rank cost (1.0 = perfect; a step lasts as long as its slowest rank)."""
    c = rank_costs(plan, steps, ranks, microbatches)
    mean = c.mean(-1).sum()
    return float(c.max(-1).sum() / mean) if mean > 0 else 1.0


def lower_bound(items: list[Item], ranks: int) -> float:
    """No plan beats max(1, largest item / (window cost / ranks)): the rank holding the largest item."""
    total = sum(it.cost for it in items)
    return max(1.0, max((it.cost for it in items), default=0.0) * ranks / total) if total > 0 else 1.0


def level_window(plan: Plan, items: list[Item], steps: int, ranks: int, microbatches: int, cap: Capacity,
                 cost_slack: float = 0.05, max_moves: int = 2000, tries: int = 256) -> Plan:
    """Even out each encoder's input rows over the window's steps, as placed; bins ordered (step, rank, microbatch).

    A window runs one compiled program whose encoder buffers hold its fullest step, so every other
    step pads up to that. This repair pass over the final placement (after `plan_step` and the spill)
    lowers the window's padded rows: per encoder, steps x (its fullest step) - (its rows placed), minus
    the LLM tokens placed (rows and tokens count alike, as in the step's padded fraction). Moves: swap
    two items of different steps, move one to another step, swap a placed item with an older unplaced
    one (the placed one is deferred: a sample gives its place only to an older one, so none waits for
    ever), or place an unplaced one where room opened. Each round scores them all on
    exact integers (gain, then the steps' sum of squared rows, then a fixed order) and tries the best
    `tries` in turn, each rescored on the rows as the round's earlier moves left them. A move is kept only
    if every bin stays within capacity, no encoder ends with fewer rows placed in the window than the
    plan had (the mix is kept; deferral only trades like for like), and the window's time (sum over steps
    of the slowest rank's cost) grows by at most `cost_slack`. Pure and deterministic.
    """
    n_enc = len(cap.enc)
    if n_enc == 0 or steps < 1 or not items:
        return plan
    per_step = ranks * microbatches
    by_key = {it.key: it for it in items}
    keys = sorted(by_key)
    idx = {k: i for i, k in enumerate(keys)}
    E = np.array([by_key[k].enc for k in keys], np.int64).reshape(len(keys), n_enc)
    tok = np.array([by_key[k].tokens for k in keys], np.int64)
    bins = _rebuild(plan.bins, by_key, cap)
    loads = list(plan.loads)
    where = {key: b for b, content in enumerate(plan.bins) for key, _ in content}
    pool = {k for k in plan.unplaced if cap.fits_alone(by_key[k])}
    R = np.zeros((steps, n_enc), np.int64)
    for key, b in where.items():
        R[b // per_step] += E[idx[key]]
    if not R.any():
        return plan
    floor = R.sum(0)
    budget = (1.0 + cost_slack) * _window_time(loads, steps, ranks, microbatches)

    saved: dict[int, tuple] = {}  # bins touched by the move being tried, as they were before it

    def save(b: int) -> None:
        if b not in saved:
            saved[b] = (list(bins[b].free), list(bins[b].enc), list(bins[b].items), loads[b])

    def put(key: int, g: int, first: int) -> int:
        """Place `key` in step g (bin `first` first, then the least loaded bins); its bin or -1."""
        it = by_key[key]
        order = sorted(range(g * per_step, (g + 1) * per_step), key=lambda b: (b != first, loads[b], b))
        for b in order:
            row = bins[b].row_for(it, cap)
            if row >= 0:
                save(b)
                bins[b].add(it, row, cap)
                loads[b] += it.cost
                where[key] = b
                return b
        return -1

    def take(key: int) -> None:
        b = where.pop(key)
        save(b)
        it = by_key[key]
        content = bins[b].items
        pos = next(p for p, (k, _) in enumerate(content) if k == key)
        _, row = content.pop(pos)
        bins[b].free[row] += it.tokens
        bins[b].enc = [c + e for c, e in zip(bins[b].enc, it.enc)]
        loads[b] -= it.cost

    def attempt(i: int | None, j: int | None, a: int, b: int | None) -> bool:
        """Item i (placed, step a) -> step b (None: deferred); item j (step b, or the pool if b is None) -> step a."""
        saved.clear()
        was = {k: where.get(k) for k in (i, j) if k is not None}
        x = where.get(i, -1) if i is not None else -1
        y = where.get(j, -1) if j is not None else -1
        if i is not None:
            take(i)
        if j is not None and y >= 0:
            take(j)
        ok = j is None or put(j, a, x) >= 0
        if ok and i is not None and b is not None:
            ok = put(i, b, y) >= 0
        ok = ok and _window_time(loads, steps, ranks, microbatches) <= budget + 1e-9
        if not ok:  # undo
            for t, (free, enc, content, load) in saved.items():
                bins[t].free, bins[t].enc, bins[t].items, loads[t] = free, enc, content, load
            for k, w in was.items():
                where.pop(k, None)
                if w is not None:
                    where[k] = w
        return ok

    def score(a: int, b: int | None, Ei, Ej, Ti, Tj):
        """For every (i, j): step a gives i (to step b, or defers it) and takes j (from step b, or the pool):
        (change of the window's padded rows, change of the steps' sum of squared rows, improves)."""
        d = Ej[None, :, :] - Ei[:, None, :]
        Ra = R[a] + d
        others = [g for g in range(steps) if g != a and g != b]
        rest = R[others].max(0) if others else np.zeros(n_enc, np.int64)
        if b is None:
            new_max = np.maximum(rest, Ra)
            dsum = d.sum(-1) + (Tj[None, :] - Ti[:, None])
            ok = np.all(R.sum(0) + d >= floor, axis=-1)
            dsq = ((Ra ** 2) - R[a] ** 2).sum(-1)
        else:
            Rb = R[b] - d
            new_max = np.maximum(np.maximum(rest, Ra), Rb)
            dsum = np.zeros(d.shape[:2], np.int64)
            ok = np.ones(d.shape[:2], bool)
            dsq = ((Ra ** 2) - R[a] ** 2 + (Rb ** 2) - R[b] ** 2).sum(-1)
        dpad = steps * (new_max - R.max(0)).sum(-1) - dsum
        return dpad, dsq, ok & ((dpad < 0) | ((dpad == 0) & (dsq < 0)))

    for _ in range(max_moves):
        omax = R.max(0)
        fullest = {g for g in range(steps) for m in range(n_enc) if omax[m] > 0 and R[g, m] == omax[m]}
        members = [sorted(k for k, b in where.items() if b // per_step == g) for g in range(steps)]
        oldest: dict[tuple, int] = {}  # unplaced items alike in rows and tokens: the oldest (lowest key) stands for all
        for k in sorted(pool, reverse=True):
            oldest[(*E[idx[k]].tolist(), int(tok[idx[k]]))] = k
        pool_keys = sorted(oldest.values())
        # token room: the free tokens of each placed item's row, the largest free row of each step
        room = np.zeros(len(keys), np.int64)
        widest = np.zeros(steps, np.int64)
        for b, st in enumerate(bins):
            for key, row in st.items:
                room[idx[key]] = st.free[row]
            w = max([*st.free, cap.row_len if len(st.free) < cap.rows else 0])
            widest[b // per_step] = max(widest[b // per_step], w)
        cands = []  # [padded gain, spread gain, step a, step b (-1: pool), key i, key j]
        for a in range(steps):
            A = members[a]
            ia = np.array([idx[k] for k in A], np.int64)
            for b in [*range(steps), None]:
                if b == a or (b is not None and a not in fullest and b not in fullest):
                    continue  # a move between two steps lowers no encoder's fullest step unless one of them is it
                if b is None:
                    jb = np.array([idx[k] for k in pool_keys], np.int64)
                    j_keys = pool_keys
                else:
                    jb = np.array([idx[k] for k in members[b]], np.int64) if b > a else np.zeros(0, np.int64)
                    j_keys = members[b] if b > a else []
                # i in A or none (a pool add / move into a), j in B or none
                Ei = np.concatenate([np.zeros((1, n_enc), np.int64), E[ia]])            # [1+na, M]
                Ej = np.concatenate([np.zeros((1, n_enc), np.int64), E[jb]])            # [1+nb, M]
                Ti = np.concatenate([[0], tok[ia]])
                Tj = np.concatenate([[0], tok[jb]])
                Fi = np.concatenate([[0], room[ia]])
                Fj = np.concatenate([[0], room[jb]])
                # necessary token fit: j into step a (i's row once i leaves, or a's widest room), i into b
                fit = Tj[None, :] <= np.maximum(widest[a], Fi + Ti)[:, None]
                if b is not None:
                    fit &= Ti[:, None] <= np.maximum(widest[b], Fj + Tj)[None, :]
                dpad, dsq, keep = score(a, b, Ei, Ej, Ti, Tj)
                keep &= fit
                keep[0, 0] = False
                ka = np.concatenate([[-1], np.asarray(A, np.int64)])
                kb = np.concatenate([[-1], np.asarray(j_keys, np.int64)])
                if b is None:  # a placed item gives its place only to an older one: none waits for ever
                    keep[1:, 1:] &= kb[None, 1:] < ka[1:, None]
                    keep[1:, 0] = False
                ii, jj = np.nonzero(keep)
                if ii.size:
                    cands.append(np.stack([dpad[ii, jj], dsq[ii, jj], np.full(ii.size, a),
                                           np.full(ii.size, -1 if b is None else b), ka[ii], kb[jj]], axis=1))
        if not cands:
            break
        c = _smallest(np.concatenate(cands), tries)
        moved = 0
        zero = np.zeros((1, n_enc), np.int64)
        for _, _, a, b, i, j in c.tolist():  # best first; after a move, the rest rescored on the new rows
            bb, ii, jj = (None if b < 0 else b), (None if i < 0 else i), (None if j < 0 else j)
            if moved:
                if (ii is not None and where.get(ii, -1) // per_step != a) or \
                        (jj is not None and (jj not in pool if bb is None else where.get(jj, -1) // per_step != bb)):
                    continue  # an earlier move of this round took i or j elsewhere
                Ei = E[idx[ii]][None] if ii is not None else zero
                Ej = E[idx[jj]][None] if jj is not None else zero
                Ti = tok[[idx[ii]]] if ii is not None else np.zeros(1, np.int64)
                Tj = tok[[idx[jj]]] if jj is not None else np.zeros(1, np.int64)
                if not score(a, bb, Ei, Ej, Ti, Tj)[2][0, 0]:
                    continue
            if attempt(ii, jj, a, bb):
                di = E[idx[ii]] if ii is not None else 0
                dj = E[idx[jj]] if jj is not None else 0
                R[a] += dj - di
                if bb is not None:
                    R[bb] += di - dj
                else:
                    if jj is not None:
                        pool.discard(jj)
                    if ii is not None:
                        pool.add(ii)
                moved += 1
        if not moved:
            break
    placed = {k for k in where}
    unplaced = tuple(sorted(k for k in by_key if k not in placed))
    return Plan(tuple(tuple(b.items) for b in bins), tuple(loads), unplaced)


def _smallest(c: np.ndarray, n: int) -> np.ndarray:
    """The n lexicographically smallest rows of integer array c, sorted (without sorting all of c)."""
    if len(c) > n:
        t = np.partition(c[:, 0], n - 1)[n - 1]
        low, tie = c[c[:, 0] < t], c[c[:, 0] == t]
        need = n - len(low)
        if len(tie) > need:
            tie = tie[tie[:, 1] <= np.partition(tie[:, 1], need - 1)[need - 1]]
        c = np.concatenate([low, tie])
    return c[np.lexsort(c.T[::-1])][:n]


def _window_time(loads, steps: int, ranks: int, microbatches: int) -> float:
    """Sum over steps of the slowest rank's cost: how long the window runs."""
    return float(np.asarray(loads).reshape(steps, ranks, microbatches).sum(-1).max(-1).sum())


def _rebuild(content: tuple[tuple[tuple[int, int], ...], ...], by_key: dict[int, Item], cap: Capacity) -> list[_Bin]:
    """Bins in the state of a placement (rows opened as recorded)."""
    state = [_Bin(cap) for _ in content]
    for b, placed in zip(state, content):
        for key, row in placed:
            it = by_key[key]
            while row >= len(b.free):
                b.free.append(cap.row_len)
            b.free[row] -= it.tokens
            b.enc = [c - e for c, e in zip(b.enc, it.enc)]
            b.items.append((key, row))
    return state


def spread_step(selected: tuple[tuple[tuple[int, int], ...], ...], items: dict[int, Item], ranks: int,
                microbatches: int, cap: Capacity) -> Plan:
    """Where a step's samples run, once `plan_window` chose them layout-free: the step's selected
    bins (one per microbatch, each holding `ranks` x `cap.rows` rows) spread over `ranks` ranks, bins
    ordered (rank, microbatch) with rows renumbered per bin. Never loses an item: LPT over ranks
    (`plan_step`) within `cap` (each rank's share of the rows and encoder rows) if that places
    everything, else within the rows alone (encoder buffers then grow to a larger bucket), else the
    selected rows whole, costliest first onto the least loaded rank with a free row (always fits).
    Which samples form the step never depends on `ranks`; only where they run does."""
    out: list[tuple[tuple[int, int], ...]] = [()] * (ranks * microbatches)
    loads = [0.0] * (ranks * microbatches)
    for m, sel in enumerate(selected):
        its = [items[k] for k, _ in sel]
        plan = None
        for c in ((cap, Capacity(cap.rows, cap.row_len)) if ranks > 1 else ()):
            p = plan_step(its, ranks, 1, c)
            if not p.unplaced:
                plan = p
                break
        if plan is None:
            plan = _spread_rows(sel, items, ranks, cap.rows)
        for r in range(ranks):
            out[r * microbatches + m] = plan.bins[r]
            loads[r * microbatches + m] = plan.loads[r]
    return Plan(tuple(out), tuple(loads), ())


def _spread_rows(sel: tuple[tuple[int, int], ...], items: dict[int, Item], ranks: int, rows: int) -> Plan:
    """The selected rows whole over `ranks` ranks of `rows` rows each (LPT, ties to the lower rank)."""
    by_row: dict[int, list[int]] = {}
    for k, r in sel:
        by_row.setdefault(r, []).append(k)
    cost = {r: sum(items[k].cost for k in ks) for r, ks in by_row.items()}
    bins: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    used, loads = [0] * ranks, [0.0] * ranks
    for r in sorted(by_row, key=lambda r: (-cost[r], r)):
        free = [q for q in range(ranks) if used[q] < rows]
        if not free:
            raise ValueError(f"a step's selection has {len(by_row)} rows, more than {ranks} ranks x {rows}")
        q = min(free, key=lambda q: (loads[q], q))
        bins[q] += [(k, used[q]) for k in by_row[r]]
        used[q] += 1
        loads[q] += cost[r]
    return Plan(tuple(tuple(b) for b in bins), tuple(loads), ())
