"""Decentralized grouped reordering: a pure, deterministic assignment of a window's samples to bins.

A window holds the samples of G upcoming global batches; its bins are (step in window, dp rank,
microbatch). Every host runs the same function on the same metadata and gets the same plan, then
loads only the payloads of its own ranks: no coordinator, no payload traffic.

`plan_step`: one step's items over its ranks, sorted longest-first by cost (ties by key), each put on
the least-loaded rank (ties by index) where it fits: its LLM tokens in one row (best fit among the
bin's rows) and its encoder rows under the bin's encoder capacity. An item that fits no bin is
reported in `unplaced` (the loader defers it to the next window, never drops it); nothing is ever
placed twice or over capacity.
`plan_window`: the grouped reordering over G steps. A step lasts as long as its slowest rank, so the
window's time is the sum over steps of the max rank cost. Phase 1 assigns items (longest first) to
steps, each to the step whose estimated time max(largest item, total / ranks) grows least (ties: the
lighter step, then the lower index), within the step's aggregate capacity: large items gather in
the same steps, where the other ranks get filled up to the same level. Phase 2 runs `plan_step` on
each step (LPT over ranks, then the emptiest microbatch of the chosen rank); an item that then
fits nowhere in its step goes to the least loaded bin of any step where it fits, else to
`unplaced`. The greedy also runs on the window cut into 2 and 4 parts; the plan with the shortest
window time wins.
`plan_window` then levels the window (`leveling.level_window`): one compiled program per window, its
encoder buffers sized for its fullest step, so items move between steps until each encoder's rows per
step are near the window's common level.
`spread_step`: where a step's chosen samples run, spread over the dp ranks.
"""
from __future__ import annotations

import heapq

import numpy as np

from omnijax.data.bins import Bin, Capacity, Item, Plan, rebuild, window_time
from omnijax.data.leveling import level_window

__all__ = ["Item", "Capacity", "Plan", "Bin", "plan_step", "plan_window", "level_window",
           "rank_costs", "max_over_mean", "lower_bound", "spread_step"]


def plan_step(items: list[Item], ranks: int, microbatches: int, cap: Capacity) -> Plan:
    """LPT over ranks (a rank's cost is the sum of its microbatches: they run one after the other),
    then within the chosen rank the microbatch whose fullest buffer stays lowest (the microbatch
    split does not change the rank's cost, only its padding). Bins are ordered (rank, microbatch).
    A rank whose rows are all open and too full for any item still to come leaves the heap, so a step
    spread over thousands of ranks does not try every full rank for every item."""
    if ranks <= 0 or microbatches <= 0:
        raise ValueError(f"ranks={ranks}, microbatches={microbatches}: must be > 0")
    bins = [Bin(cap) for _ in range(ranks * microbatches)]
    loads = [0.0] * len(bins)
    heap = [(0.0, r) for r in range(ranks)]
    unplaced = []
    order = sorted(items, key=lambda it: (-it.cost, it.key))
    least = [0] * (len(order) + 1)  # fewest tokens of any item from position i on
    least[-1] = cap.row_len + 1
    for i in range(len(order) - 1, -1, -1):
        least[i] = min(order[i].tokens, least[i + 1])

    def full(b: Bin, i: int) -> bool:  # every row of b open and too full for any item from position i on
        return len(b.free) >= cap.rows and (not b.by_free or b.by_free[-1][0] < least[i])

    def closed(r: int, i: int) -> bool:  # no row of rank r can take an item from position i on: drop it
        if microbatches == 1:
            return full(bins[r], i)
        return all(full(bins[b], i) for b in range(r * microbatches, (r + 1) * microbatches))

    if ranks == 1 and microbatches == 1:  # the layout-free selection's shape: one bin, the same choices without the heap
        only, open_ = bins[0], True
        for i, item in enumerate(order):
            row = only.row_for(item, cap) if open_ else -1
            if row >= 0:
                only.add(item, row, cap)
                loads[0] += item.cost
            else:
                unplaced.append(item.key)
            open_ = open_ and not full(only, i + 1)
        return Plan((tuple(only.items),), tuple(loads), tuple(sorted(unplaced)))
    for i, item in enumerate(order):
        tried = []
        placed = False
        while heap:
            load, r = heapq.heappop(heap)
            tried.append((load, r))
            choice = None
            mbs = range(r * microbatches, (r + 1) * microbatches)
            for b in (mbs if microbatches == 1 else sorted(mbs, key=lambda b: (bins[b].level(item, cap), b))):
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
        for t in tried:  # ranks full for every item still to come leave the heap: O(log ranks) an item
            if not closed(t[1], i + 1):
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
        t = (window_time(plan.loads, steps, ranks, microbatches), len(plan.unplaced))
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
    members, unplaced = _assign_steps(items, steps, ranks, cap, tok_cap, [fill * per_step * c for c in cap.enc])
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
        state = rebuild(tuple(bins), {x.key: x for x in items}, cap)
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


def _assign_steps(items: list[Item], steps: int, ranks: int, cap: Capacity, tok_cap: float,
                  enc_cap: list[float]) -> tuple[list[list[Item]], list[int]]:
    """Phase 1 of `_plan_window`: each item (longest first, ties by key) to the step whose estimated
    time max(largest item, total / ranks) grows least among those within the aggregate capacity (all
    steps if none is), ties: the lighter step, then the lower index; items no bin holds alone are
    unplaced. Plain floats over the steps (a window has a few): a numpy call per item and step costs
    more than the arithmetic (same IEEE operations, so the same choices)."""
    total = [0.0] * steps
    big = [0.0] * steps
    now = [0.0] * steps  # each step's estimated time max(big, total / ranks), kept as steps change
    tok = [0.0] * steps
    enc = [[0.0] * len(cap.enc) for _ in range(steps)]
    members: list[list[Item]] = [[] for _ in range(steps)]
    unplaced: list[int] = []
    inf = float("inf")
    for it in sorted(items, key=lambda it: (-it.cost, it.key)):
        if not cap.fits_alone(it):
            unplaced.append(it.key)
            continue
        cost, tokens, ie = float(it.cost), it.tokens, it.enc
        g = g_any = -1  # the best step within capacity (growth inf outside it) / among all steps
        bg = bt = ag = at = inf
        any_fit = False
        for s in range(steps):
            t, b = total[s], big[s]
            hi = cost if cost > b else b
            q = (t + cost) / ranks
            grow = (q if q > hi else hi) - now[s]
            if s == 0 or grow < ag or (grow == ag and t < at):
                ag, at, g_any = grow, t, s
            fits = tok[s] + tokens <= tok_cap
            if fits:
                for e, x, c in zip(enc[s], ie, enc_cap):
                    if not e + x <= c:
                        fits = False
                        break
            key = grow if fits else inf
            any_fit = any_fit or fits
            if s == 0 or key < bg or (key == bg and t < bt):
                bg, bt, g = key, t, s
        if not any_fit:  # aggregate capacity exhausted: fall back to the emptiest step (every step counts)
            g = g_any
        members[g].append(it)
        total[g] += cost
        big[g] = max(big[g], cost)
        now[g] = max(big[g], total[g] / ranks)
        tok[g] += tokens
        enc[g] = [e + x for e, x in zip(enc[g], ie)]
    return members, unplaced


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
