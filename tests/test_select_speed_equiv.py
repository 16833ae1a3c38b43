"""The fast selection (issue 47) plans exactly as the straightforward one it replaced.

The window planner's hot parts were rewritten for speed: the greedy step assignment
(`balance._assign_steps`, plain floats instead of numpy per item) and the leveling rounds' scoring
(`leveling._candidates`: per-encoder planes, each pair of steps handing only its best `tries` moves,
the squared-rows tie-break only where needed; `_still_improves` on plain ints). The layout-free
guarantee needs the very same plans, so the straightforward versions are kept here as references and
patched in; every seeded/hypothesis-drawn window must give identical plans (bins, rows, loads,
deferred), ties included (coarse costs and rows make many).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnijax.data import balance as B
from omnijax.data import leveling as L


# ------------------------------------------------------------------ references: the code before issue 47
def _ref_assign_steps(items, steps, ranks, cap, tok_cap, enc_cap):
    total, big, tok = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    enc = np.zeros((steps, len(cap.enc)))
    members = [[] for _ in range(steps)]
    unplaced = []
    for it in sorted(items, key=lambda it: (-it.cost, it.key)):
        if not cap.fits_alone(it):
            unplaced.append(it.key)
            continue
        now = np.maximum(big, total / ranks)
        after = np.maximum(np.maximum(big, it.cost), (total + it.cost) / ranks)
        ok = (tok + it.tokens <= tok_cap) & np.all(enc + np.asarray(it.enc, float) <= enc_cap, axis=-1) \
            if cap.enc else (tok + it.tokens <= tok_cap)
        if not ok.any():
            ok = np.ones(steps, bool)
        g = int(np.lexsort((np.arange(steps), total, np.where(ok, after - now, np.inf)))[0])
        members[g].append(it)
        total[g] += it.cost
        big[g] = max(big[g], it.cost)
        tok[g] += it.tokens
        enc[g] += it.enc
    return members, unplaced


def _ref_score(w, a, b, Ei, Ej, Ti, Tj):
    R = w.rows
    d = Ej[None, :, :] - Ei[:, None, :]
    Ra = R[a] + d
    others = [g for g in range(w.steps) if g != a and g != b]
    rest = R[others].max(0) if others else np.zeros(R.shape[1], np.int64)
    if b is None:
        new_max = np.maximum(rest, Ra)
        dsum = d.sum(-1) + (Tj[None, :] - Ti[:, None])
        ok = np.all(R.sum(0) + d >= w.floor, axis=-1)
        dsq = ((Ra ** 2) - R[a] ** 2).sum(-1)
    else:
        Rb = R[b] - d
        new_max = np.maximum(np.maximum(rest, Ra), Rb)
        dsum = np.zeros(d.shape[:2], np.int64)
        ok = np.ones(d.shape[:2], bool)
        dsq = ((Ra ** 2) - R[a] ** 2 + (Rb ** 2) - R[b] ** 2).sum(-1)
    dpad = w.steps * (new_max - R.max(0)).sum(-1) - dsum
    return dpad, dsq, ok & ((dpad < 0) | ((dpad == 0) & (dsq < 0)))


def _ref_pair_candidates(w, a, b, give, take, room, widest):
    n_enc = w.rows.shape[1]
    ia = np.array([w.idx[k] for k in give], np.int64)
    jb = np.array([w.idx[k] for k in take], np.int64)
    none = np.zeros((1, n_enc), np.int64)
    Ei, Ej = np.concatenate([none, w.enc[ia]]), np.concatenate([none, w.enc[jb]])
    Ti, Tj = np.concatenate([[0], w.tokens[ia]]), np.concatenate([[0], w.tokens[jb]])
    Fi, Fj = np.concatenate([[0], room[ia]]), np.concatenate([[0], room[jb]])
    fit = Tj[None, :] <= np.maximum(widest[a], Fi + Ti)[:, None]
    if b is not None:
        fit &= Ti[:, None] <= np.maximum(widest[b], Fj + Tj)[None, :]
    dpad, dsq, keep = _ref_score(w, a, b, Ei, Ej, Ti, Tj)
    keep &= fit
    keep[0, 0] = False
    ka = np.concatenate([[-1], np.asarray(give, np.int64)])
    kb = np.concatenate([[-1], np.asarray(take, np.int64)])
    if b is None:
        keep[1:, 1:] &= kb[None, 1:] < ka[1:, None]
        keep[1:, 0] = False
    ii, jj = np.nonzero(keep)
    if not ii.size:
        return None
    return np.stack([dpad[ii, jj], dsq[ii, jj], np.full(ii.size, a), np.full(ii.size, -1 if b is None else b),
                     ka[ii], kb[jj]], axis=1)


def _ref_candidates(w, limit):
    fullest = L._fullest_steps(w)
    members = [L._movable(w, sorted(k for k, b in w.where.items() if b // w.per_step == g)) for g in range(w.steps)]
    pool_keys = L._movable(w, L._pool_representatives(w))
    room, widest = L._token_room(w)
    cands = []
    for a in range(w.steps):
        for b in [*range(w.steps), None]:
            if b == a or (b is not None and a not in fullest and b not in fullest):
                continue
            take = pool_keys if b is None else members[b] if b > a else []
            c = _ref_pair_candidates(w, a, b, members[a], take, room, widest)
            if c is not None:
                cands.append(c)
    return np.concatenate(cands) if cands else None  # every improving move: level_window keeps its best `limit`


def _ref_still_improves(w, m):
    if (m.i is not None and w.step_of(m.i) != m.a) or \
            (m.j is not None and (m.j not in w.pool if m.b is None else w.step_of(m.j) != m.b)):
        return False
    zero, none = np.zeros((1, w.rows.shape[1]), np.int64), np.zeros(1, np.int64)
    Ei = w.enc[w.idx[m.i]][None] if m.i is not None else zero
    Ej = w.enc[w.idx[m.j]][None] if m.j is not None else zero
    Ti = w.tokens[[w.idx[m.i]]] if m.i is not None else none
    Tj = w.tokens[[w.idx[m.j]]] if m.j is not None else none
    return bool(_ref_score(w, m.a, m.b, Ei, Ej, Ti, Tj)[2][0, 0])


def _reference(fn, *args, **kw):
    """`fn(*args)` with the straightforward parts patched in (restored after, even on error)."""
    saved = B._assign_steps, L._candidates, L._still_improves
    B._assign_steps, L._candidates, L._still_improves = _ref_assign_steps, _ref_candidates, _ref_still_improves
    try:
        return fn(*args, **kw)
    finally:
        B._assign_steps, L._candidates, L._still_improves = saved


# ------------------------------------------------------------------ windows
def _window(seed: int):
    """A seeded window: 0-2 encoders, costs and rows coarse (many ties) or fine, keys with gaps."""
    rng = np.random.default_rng(seed)
    n, n_enc, coarse = int(rng.integers(1, 300)), int(rng.integers(0, 3)), bool(rng.random() < 0.5)
    items, keys = [], rng.choice(4 * n, n, replace=False) if rng.random() < 0.3 else np.arange(n)
    for k in keys.tolist():
        tok = int(rng.integers(1, 40 if coarse else 200))
        enc = tuple(int(rng.choice([0, 0, 8, 16, 64]) * (1 if coarse else rng.integers(1, 5))) for _ in range(n_enc))
        cost = float(tok + sum(enc)) if coarse else float(tok + 0.03 * sum(enc) ** 1.2 + rng.random())
        items.append(B.Item(k, cost, tok, enc))
    cap = B.Capacity(int(rng.integers(1, 6)), int(rng.integers(32, 256)),
                     tuple(int(rng.integers(32, 1024)) for _ in range(n_enc)))
    return items, int(rng.choice([1, 2, 3, 4, 6, 8])), int(rng.integers(1, 5)), int(rng.integers(1, 3)), cap


@pytest.mark.parametrize("seed", range(40))
def test_plan_window_equals_the_reference(seed):
    items, steps, ranks, micro, cap = _window(seed)
    assert B.plan_window(items, steps, ranks, micro, cap) == _reference(B.plan_window, items, steps, ranks, micro, cap)


@pytest.mark.parametrize("seed", range(40))
def test_leveling_with_few_tries_and_movable_equals_the_reference(seed, monkeypatch):
    """Few tries per round and few movable items per step: the pairs' own best-moves cut and the
    tie-break computed only up to it are exercised (they only matter when a round has more moves)."""
    monkeypatch.setattr(L, "MOVABLE", int(np.random.default_rng(seed).choice([8, 32, 256])))
    items, steps, ranks, micro, cap = _window(100 + seed)
    base = B.plan_window(items, steps, ranks, micro, cap, level=False)
    for tries in (1, 3, 16):
        args = (base, items, steps, ranks, micro, cap)
        assert L.level_window(*args, tries=tries) == _reference(L.level_window, *args, tries=tries)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 12), st.integers(0, 3), st.integers(0, 3)),
                min_size=1, max_size=120),
       st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.integers(1, 3), st.integers(1, 16))
def test_tie_heavy_windows_equal_the_reference(rows, steps, ranks, micro, cap_rows, tries):
    """Small integer costs, tokens and encoder rows: most choices are ties, broken as before."""
    items = [B.Item(k, float(c), 4 * t, (8 * e0, 4 * e1)) for k, (c, t, e0, e1) in enumerate(rows)]
    cap = B.Capacity(cap_rows, 48, (64, 32))
    assert B.plan_window(items, steps, ranks, micro, cap) == _reference(B.plan_window, items, steps, ranks, micro, cap)
    base = B.plan_window(items, steps, ranks, micro, cap, level=False)
    args = (base, items, steps, ranks, micro, cap)
    assert L.level_window(*args, tries=tries) == _reference(L.level_window, *args, tries=tries)


def test_windows_of_thousands_of_samples_per_step_equal_the_reference():
    """The bench's shape (one bin of many rows a step, 2 encoders, hundreds of samples a step, more
    than MOVABLE): the per-pair cut takes effect at every round."""
    rng = np.random.default_rng(7)
    items = []
    for k in range(900):
        kind = int(rng.choice(3))
        enc = (int(rng.integers(1, 60)) * 16, 0) if kind == 1 else (0, int(rng.integers(1, 40)) * 8) if kind == 2 else (0, 0)
        tok = int(rng.integers(16, 400)) + enc[0] // 16 + enc[1] // 4
        items.append(B.Item(k, float(tok + 0.02 * sum(enc) ** 1.2), tok, enc))
    cap = B.Capacity(96, 1024, (40000, 20000))
    plan = B.plan_window(items, 4, 1, 1, cap)
    assert plan == _reference(B.plan_window, items, 4, 1, 1, cap)
    assert plan != B.plan_window(items, 4, 1, 1, cap, level=False)  # leveling did move items


def test_rows_beyond_int32_planes_equal_the_reference():
    """Encoder rows so large that the score planes leave int32 (they are then int64): still the same plans.
    (Rows per step stay near 2**28, so the reference's squared rows stay within int64.)"""
    items, steps, ranks, micro, cap = _window(5)  # 2 encoders, 4 steps: leveling moves items
    big = 2**18
    items = [B.Item(it.key, it.cost, it.tokens, tuple(e * big for e in it.enc)) for it in items]
    cap = B.Capacity(cap.rows, cap.row_len, tuple(c * big for c in cap.enc))
    base = B.plan_window(items, steps, ranks, micro, cap, level=False)
    for tries in (2, 256):
        args = (base, items, steps, ranks, micro, cap)
        plan = L.level_window(*args, tries=tries)
        assert plan == _reference(L.level_window, *args, tries=tries)
        assert plan != base
