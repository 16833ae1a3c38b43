"""Window leveling: even out each encoder's input rows over a window's steps, as placed.

A window runs one compiled program whose encoder buffers hold its fullest step, so every other step
pads up to that. `level_window` is a repair pass over a finished placement (`balance.plan_window`):
rounds of moves between steps (and with the deferred items), each kept only if it lowers the
window's padded rows within every bin's capacity and a small budget on the window's time.
The state is plain data (`Window`: arrays of the items' rows and tokens, the bins as placed, the
encoder rows per step); each part of a round is a named function over it.
Cost (issue 47: a host plans its 128-row groups every step): a round scores each pair of steps on
[I, J] integer planes, one encoder at a time (int32 where no value can leave its range), keeps only that
pair's best `tries` moves and computes the squared-rows tie-break only on those; the plans are exactly
those of scoring every move (tests/test_select_speed_equiv.py keeps that straightforward version).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnijax.data.bins import Bin, Capacity, Item, Plan, rebuild, window_time


@dataclass
class Window:
    """A placement being leveled. Bins are ordered (step, rank, microbatch); `rows[g, m]` is encoder m's
    input rows placed in step g; `pool` holds the deferred items that fit a bin alone."""
    steps: int
    per_step: int
    cap: Capacity
    by_key: dict[int, Item]
    idx: dict[int, int]            # key -> row of `enc`/`tokens`
    enc: np.ndarray                # [items, encoders] encoder rows per item (keys in sorted order)
    tokens: np.ndarray             # [items] LLM tokens per item
    bins: list[Bin]
    loads: list[float]
    where: dict[int, int]          # placed key -> its bin
    pool: set[int]
    rows: np.ndarray               # [steps, encoders]
    floor: np.ndarray              # [encoders] rows placed before leveling: no encoder may end below
    budget: float                  # the most window time a kept move may leave
    time: tuple[int, int, int]     # (steps, ranks, microbatches) for `window_time`
    saved: dict[int, tuple] = field(default_factory=dict)  # bins the move being tried touched, as they were

    def step_of(self, key: int) -> int:
        return self.where.get(key, -1) // self.per_step


@dataclass(frozen=True)
class Move:
    """Step `a` gives item i (to step b, or defers it when b is None) and takes item j (from step b, or
    from the pool when b is None); either item may be None (a one-way move)."""
    a: int
    b: int | None
    i: int | None
    j: int | None


def level_window(plan: Plan, items: list[Item], steps: int, ranks: int, microbatches: int, cap: Capacity,
                 cost_slack: float = 0.05, max_moves: int = 2000, tries: int = 256) -> Plan:
    """Even out each encoder's input rows over the window's steps, as placed; bins ordered (step, rank, microbatch).

    This lowers the window's padded rows: per encoder, steps x (its fullest step) - (its rows placed),
    minus the LLM tokens placed (rows and tokens count alike, as in the step's padded fraction). Moves:
    swap two items of different steps, move one to another step, swap a placed item with an older
    unplaced one (the placed one is deferred: a sample gives its place only to an older one, so none
    waits for ever), or place an unplaced one where room opened. Each round scores them all on exact
    integers (gain, then the steps' sum of squared rows, then a fixed order) and tries the best `tries`
    in turn, each rescored on the rows as the round's earlier moves left them. A move is kept only if
    every bin stays within capacity, no encoder ends with fewer rows placed in the window than the plan
    had (the mix is kept; deferral only trades like for like), and the window's time (sum over steps of
    the slowest rank's cost) grows by at most `cost_slack`. Pure and deterministic.
    """
    if not cap.enc or steps < 1 or not items:
        return plan
    w = _window(plan, items, steps, ranks, microbatches, cap, cost_slack)
    if not w.rows.any():
        return plan
    for _ in range(max_moves):
        cands = _candidates(w, tries)
        if cands is None or not _apply_round(w, _smallest(cands, tries)):
            break
    unplaced = tuple(sorted(k for k in w.by_key if k not in w.where))
    return Plan(tuple(tuple(b.items) for b in w.bins), tuple(w.loads), unplaced)


def _window(plan: Plan, items: list[Item], steps: int, ranks: int, microbatches: int, cap: Capacity,
            cost_slack: float) -> Window:
    """The leveling state of `plan`: item arrays, rebuilt bins, encoder rows per step, the time budget."""
    n_enc = len(cap.enc)
    per_step = ranks * microbatches
    by_key = {it.key: it for it in items}
    keys = sorted(by_key)
    idx = {k: i for i, k in enumerate(keys)}
    enc = np.array([by_key[k].enc for k in keys], np.int64).reshape(len(keys), n_enc)
    where = {key: b for b, content in enumerate(plan.bins) for key, _ in content}
    rows = np.zeros((steps, n_enc), np.int64)
    for key, b in where.items():
        rows[b // per_step] += enc[idx[key]]
    loads = list(plan.loads)
    return Window(steps=steps, per_step=per_step, cap=cap, by_key=by_key, idx=idx, enc=enc,
                  tokens=np.array([by_key[k].tokens for k in keys], np.int64),
                  bins=rebuild(plan.bins, by_key, cap), loads=loads, where=where,
                  pool={k for k in plan.unplaced if cap.fits_alone(by_key[k])}, rows=rows, floor=rows.sum(0),
                  budget=(1.0 + cost_slack) * window_time(loads, steps, ranks, microbatches),
                  time=(steps, ranks, microbatches))


# ------------------------------------------------------------------ trying one move on the bins
def _save(w: Window, b: int) -> None:
    if b not in w.saved:
        w.saved[b] = (w.bins[b].snapshot(), w.loads[b])


def _put(w: Window, key: int, g: int, first: int) -> int:
    """Place `key` in step g (bin `first` first, then the least loaded bins); its bin or -1."""
    it = w.by_key[key]
    order = sorted(range(g * w.per_step, (g + 1) * w.per_step), key=lambda b: (b != first, w.loads[b], b))
    for b in order:
        row = w.bins[b].row_for(it, w.cap)
        if row >= 0:
            _save(w, b)
            w.bins[b].add(it, row, w.cap)
            w.loads[b] += it.cost
            w.where[key] = b
            return b
    return -1


def _take(w: Window, key: int) -> None:
    b = w.where.pop(key)
    _save(w, b)
    it = w.by_key[key]
    w.bins[b].remove(it)
    w.loads[b] -= it.cost


def _try_move(w: Window, m: Move) -> bool:
    """Carry out `m` on the bins if every item finds room and the window's time stays in budget; else undo."""
    w.saved.clear()
    was = {k: w.where.get(k) for k in (m.i, m.j) if k is not None}
    x = w.where.get(m.i, -1) if m.i is not None else -1
    y = w.where.get(m.j, -1) if m.j is not None else -1
    if m.i is not None:
        _take(w, m.i)
    if m.j is not None and y >= 0:
        _take(w, m.j)
    ok = m.j is None or _put(w, m.j, m.a, x) >= 0
    if ok and m.i is not None and m.b is not None:
        ok = _put(w, m.i, m.b, y) >= 0
    ok = ok and window_time(w.loads, *w.time) <= w.budget + 1e-9
    if not ok:
        for t, (snap, load) in w.saved.items():
            w.bins[t].restore(snap)
            w.loads[t] = load
        for k, where in was.items():
            w.where.pop(k, None)
            if where is not None:
                w.where[k] = where
    return ok


def _record(w: Window, m: Move) -> None:
    """Book a carried-out move into the rows per step and the pool."""
    di = w.enc[w.idx[m.i]] if m.i is not None else 0
    dj = w.enc[w.idx[m.j]] if m.j is not None else 0
    w.rows[m.a] += dj - di
    if m.b is not None:
        w.rows[m.b] += di - dj
    else:
        if m.j is not None:
            w.pool.discard(m.j)
        if m.i is not None:
            w.pool.add(m.i)


# ------------------------------------------------------------------ scoring moves on the rows alone
def _score(w: Window, a: int, b: int | None, Ei: np.ndarray, Ej: np.ndarray, Ti: np.ndarray, Tj: np.ndarray):
    """For every (i, j): step a gives i (to step b, or defers it) and takes j (from step b, or the pool):
    (change of the window's padded rows, whether the mix floor holds), both [I, J].

    Computed one encoder at a time on [I, J] planes built from per-item vectors (a step's rows after the
    move are R[a] + Ej - Ei), so a round's pair of 256-item steps costs a few passes over 64k integers;
    the squared-rows tie-break is `_spread_change`, only on the pairs that need it. Exact integers."""
    R = w.rows
    n = R.shape[1]
    others = [g for g in range(w.steps) if g != a and g != b]
    rest = R[others].max(0).tolist() if others else [0] * n
    top = int(R.max(0).sum())
    # int32 planes (half the memory traffic) when no value can leave int32's range, else int64: exact either way
    e = max(int(np.abs(Ei).max(initial=0)), int(np.abs(Ej).max(initial=0)))
    t = max(int(np.abs(Ti).max(initial=0)), int(np.abs(Tj).max(initial=0)))
    dt = np.int32 if 2 * (w.steps + 1) * n * (int(np.abs(R).max(initial=0)) + e) + 2 * t < 2**31 - 1 else np.int64
    grow = np.zeros((len(Ei), len(Ej)), dt)  # sum over encoders of the new maximum (minus the old: `top`)
    ok = None
    for m in range(n):
        ei, ej = Ei[:, m].astype(dt), Ej[:, m].astype(dt)
        Ra = (int(R[a, m]) + ej)[None, :] - ei[:, None]
        if b is None:
            # the mix floor: R.sum(0) + d >= floor, i.e. R[a] + d >= floor - (R.sum(0) - R[a])
            above = Ra >= int(w.floor[m] - R[:, m].sum() + R[a, m])
            ok = above if ok is None else ok & above
        else:
            np.maximum(Ra, (int(R[b, m]) + ei)[:, None] - ej[None, :], out=Ra)
        np.maximum(Ra, rest[m], out=Ra)
        grow += Ra
    grow -= top
    grow *= w.steps
    if ok is None:
        ok = np.ones(grow.shape, bool)
    if b is None:
        grow -= (Ej.sum(-1) + Tj).astype(dt)[None, :]
        grow += (Ei.sum(-1) + Ti).astype(dt)[:, None]
    return grow, ok


def _spread_change(w: Window, a: int, b: int | None, Ei: np.ndarray, Ej: np.ndarray) -> np.ndarray:
    """Change of the steps' sum of squared rows for the paired rows of Ei and Ej (same length): step a
    gets Ej - Ei (and step b the opposite). Exact integers."""
    d = Ej - Ei
    Ra = w.rows[a] + d
    out = (Ra * Ra).sum(-1) - int((w.rows[a] * w.rows[a]).sum())
    if b is not None:
        Rb = w.rows[b] - d
        out += (Rb * Rb).sum(-1) - int((w.rows[b] * w.rows[b]).sum())
    return out


def _improves(w: Window, a: int, b: int | None, ei: list[int], ej: list[int], ti: int, tj: int) -> bool:
    """`_score`'s verdict for one move on plain integers (a numpy call costs more than the arithmetic)."""
    R = w.rows.tolist()
    n = len(ei)
    rest = [max((R[g][m] for g in range(w.steps) if g != a and g != b), default=0) for m in range(n)]
    dpad, dsq = 0, 0
    for m in range(n):
        d = ej[m] - ei[m]
        ra = R[a][m] + d
        top = max(R[g][m] for g in range(w.steps))
        new = max(rest[m], ra)
        dsq += ra * ra - R[a][m] * R[a][m]
        if b is None:
            if sum(R[g][m] for g in range(w.steps)) + d < int(w.floor[m]):
                return False
            dpad -= d
        else:
            rb = R[b][m] - d
            new = max(new, rb)
            dsq += rb * rb - R[b][m] * R[b][m]
        dpad += w.steps * (new - top)
    if b is None:
        dpad -= tj - ti
    return dpad < 0 or (dpad == 0 and dsq < 0)


def _fullest_steps(w: Window) -> set[int]:
    """Steps holding some encoder's most rows (a move between two other steps lowers no maximum)."""
    top = w.rows.max(0)
    return {g for g in range(w.steps) for m in range(w.rows.shape[1]) if top[m] > 0 and w.rows[g, m] == top[m]}


def _pool_representatives(w: Window) -> list[int]:
    """Deferred items alike in rows and tokens: the oldest (lowest key) stands for all."""
    oldest: dict[tuple, int] = {}
    for k in sorted(w.pool, reverse=True):
        oldest[(*w.enc[w.idx[k]].tolist(), int(w.tokens[w.idx[k]]))] = k
    return sorted(oldest.values())


MOVABLE = 256  # items per step (and of the pool) a round scores: all of them in windows of this size or less


def _movable(w: Window, keys: list[int], limit: int | None = None) -> list[int]:
    """The items of a step a round scores: all of them up to `limit`, else (a step of thousands of
    samples) the `limit` ones with the most and the fewest rows of each encoder, and then the fewest
    tokens, ties by key: the moves that change an encoder's rows per step most or least, so the
    scoring matrices of a round stay limit x limit whatever the batch size. Deterministic."""
    limit = MOVABLE if limit is None else limit
    if len(keys) <= limit:
        return keys
    arr = np.asarray(keys, np.int64)
    rows = w.enc[[w.idx[k] for k in keys]]
    n_enc = rows.shape[1]
    per = max(1, limit // (2 * n_enc + 1))
    pick: set[int] = set()
    for m in range(n_enc):
        order = np.lexsort((arr, rows[:, m]))
        pick.update(arr[order[:per]].tolist())
        pick.update(arr[np.lexsort((arr, -rows[:, m]))[:per]].tolist())
    order = np.lexsort((arr, w.tokens[[w.idx[k] for k in keys]]))
    for k in arr[order].tolist():
        if len(pick) >= limit:
            break
        pick.add(k)
    return sorted(pick)


def _token_room(w: Window) -> tuple[np.ndarray, np.ndarray]:
    """Free tokens of each placed item's row (by item), and the largest free row of each step."""
    room = np.zeros(len(w.idx), np.int64)
    widest = np.zeros(w.steps, np.int64)
    for b, st in enumerate(w.bins):
        for key, row in st.items:
            room[w.idx[key]] = st.free[row]
        free = max([*st.free, w.cap.row_len if len(st.free) < w.cap.rows else 0])
        widest[b // w.per_step] = max(widest[b // w.per_step], free)
    return room, widest


def _side(w: Window, keys: list[int], room: np.ndarray) -> tuple[np.ndarray, ...]:
    """One side of a round's moves, the entry 'none' first: keys (-1), encoder rows, tokens, free tokens
    of their rows. Built once a round per step (and the pool), not once per pair of steps."""
    ix = np.array([w.idx[k] for k in keys], np.int64)
    none = np.zeros((1, w.rows.shape[1]), np.int64)
    return (np.concatenate([[-1], np.asarray(keys, np.int64)]), np.concatenate([none, w.enc[ix]]),
            np.concatenate([[0], w.tokens[ix]]), np.concatenate([[0], room[ix]]))


def _pair_candidates(w: Window, a: int, b: int | None, give: tuple[np.ndarray, ...], take: tuple[np.ndarray, ...],
                     widest: np.ndarray, limit: int) -> np.ndarray | None:
    """Improving moves between step a (gives one of `give` or none) and step b or the pool (gives one of
    `take` or none; both `_side`s), as rows [padded gain, spread gain, a, b (-1: pool), key i (-1: none),
    key j (-1: none)]: the pair's best `limit` of them."""
    ka, Ei, Ti, Fi = give
    kb, Ej, Tj, Fj = take
    # necessary token fit: j into step a (i's row once i leaves, or a's widest room), i into b
    fit = Tj[None, :] <= np.maximum(widest[a], Fi + Ti)[:, None]
    if b is not None:
        fit &= Ti[:, None] <= np.maximum(widest[b], Fj + Tj)[None, :]
    dpad, keep = _score(w, a, b, Ei, Ej, Ti, Tj)
    keep &= fit
    keep &= dpad <= 0
    keep[0, 0] = False
    if b is None:  # a placed item gives its place only to an older one: none waits for ever
        keep[1:, 1:] &= kb[None, 1:] < ka[1:, None]
        keep[1:, 0] = False
    neg = dpad[keep]
    neg = neg[neg < 0]
    if len(neg) >= limit:  # `limit` moves lower the padded rows: only those up to the limit-th best can be tried
        keep &= dpad <= np.partition(neg, limit - 1)[limit - 1]
    ii, jj = np.nonzero(keep)
    pad = dpad[ii, jj]
    dsq = _spread_change(w, a, b, Ei[ii], Ej[jj])
    better = (pad < 0) | (dsq < 0)  # lower padded rows, or the same and a smaller spread
    if not better.any():
        return None
    ii, jj = ii[better], jj[better]
    # only the round's best `limit` moves are tried: those of this pair are among its own best `limit`
    return _smallest(np.stack([pad[better], dsq[better], np.full(ii.size, a), np.full(ii.size, -1 if b is None else b),
                               ka[ii], kb[jj]], axis=1), limit)


def _candidates(w: Window, limit: int) -> np.ndarray | None:
    """The improving moves of this round that can be among its best `limit` (each pair of steps' own best
    `limit`, `_pair_candidates` rows), or None when no move improves."""
    fullest = _fullest_steps(w)
    of_step: list[list[int]] = [[] for _ in range(w.steps)]
    for k, b in w.where.items():  # one pass over the placed items, not one per step
        of_step[b // w.per_step].append(k)
    room, widest = _token_room(w)
    sides = [_side(w, _movable(w, sorted(keys)), room) for keys in of_step]
    pool, nothing = _side(w, _movable(w, _pool_representatives(w)), room), _side(w, [], room)
    cands = []
    for a in range(w.steps):
        for b in [*range(w.steps), None]:
            if b == a or (b is not None and a not in fullest and b not in fullest):
                continue
            # a pair of steps is scored once (a < b: swaps and moves both ways); the pool with every step
            take = pool if b is None else sides[b] if b > a else nothing
            c = _pair_candidates(w, a, b, sides[a], take, widest, limit)
            if c is not None:
                cands.append(c)
    return np.concatenate(cands) if cands else None


def _still_improves(w: Window, m: Move) -> bool:
    """Whether `m` is still possible and improving after the round's earlier moves."""
    if (m.i is not None and w.step_of(m.i) != m.a) or \
            (m.j is not None and (m.j not in w.pool if m.b is None else w.step_of(m.j) != m.b)):
        return False  # an earlier move of this round took i or j elsewhere
    n = w.rows.shape[1]
    ei = w.enc[w.idx[m.i]].tolist() if m.i is not None else [0] * n
    ej = w.enc[w.idx[m.j]].tolist() if m.j is not None else [0] * n
    ti = int(w.tokens[w.idx[m.i]]) if m.i is not None else 0
    tj = int(w.tokens[w.idx[m.j]]) if m.j is not None else 0
    return _improves(w, m.a, m.b, ei, ej, ti, tj)

def _apply_round(w: Window, best: np.ndarray) -> int:
    """Try the round's best candidates in order (after the first kept one, each rescored); moves kept."""
    moved = 0
    for _, _, a, b, i, j in best.tolist():
        m = Move(a, None if b < 0 else b, None if i < 0 else i, None if j < 0 else j)
        if moved and not _still_improves(w, m):
            continue
        if _try_move(w, m):
            _record(w, m)
            moved += 1
    return moved


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
