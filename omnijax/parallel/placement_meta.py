"""A second pass over an encoder placement: local moves that lower the most loaded device.

`encoder_placement._place_balanced` (what `routing.build_plan` and `routing.place_segments` run)
places each encoder in turn, largest segment first by rows, into the smallest capacities that hold
the step; when those are tight it falls back to best fit, which packs by room and not by cost. On a
host with few segments per device (weak scaling: ~1–10), or after a long clip fills one esp group,
that leaves devices 20–30% above the mean although the host's total is on the mean.
`refine_assignment` keeps the capacities and repeatedly takes work off the most loaded device (else
the next most loaded, so a move that clears the way comes first): the move that lowers the highest
load among the devices it touches (the sorted loads fall), else one that lowers Σ load² (two
devices can block each other otherwise); the best placement seen is kept. Moves:

- move a whole segment (short buffer, or the room of a long buffer) to another device;
- swap a whole segment with a cheaper one of the same encoder on another device;
- split a whole segment over an esp group (long-short: its chunks go into the group's long buffers);
- move a split segment to another esp group;
- split several whole segments of one group at once (each alone may not fit where together they
  free the room).

Each move keeps every buffer within its capacity, so the plan's shapes (and compiled programs) do not
change. Deterministic (ties: move kind in the order above, then lowest index), pure numpy on the host.
"""
from __future__ import annotations

import numpy as np

from omnijax.parallel.device_grid import DeviceGrid
from omnijax.parallel.encoder_placement import Assignment, Segment, _chunks

_EPS = 1e-9


def _rows_used(assignment: Assignment, segments: list[Segment], grid: DeviceGrid, names: list[str]):
    D, esp = grid.num_devices, grid.esp
    short = {n: np.zeros(D, np.int64) for n in names}
    long = {n: np.zeros(D, np.int64) for n in names}
    for d in range(D):
        for i in assignment.short[d]:
            short[segments[i].encoder][d] += segments[i].rows
        for i in (assignment.long_whole or [[]] * D)[d]:
            long[segments[i].encoder][d] += segments[i].rows
    for g, ids in enumerate(assignment.long):
        for i in ids:
            s = segments[i]
            long[s.encoder][g * esp:(g + 1) * esp] += np.array(_chunks(s.rows, s.reduction, esp), np.int64)
    return short, long


def refine_assignment(assignment: Assignment, segments: list[Segment], grid: DeviceGrid, capacities: dict,
                      *, splittable: bool = True, max_moves: int | None = None, scan: int = 8) -> Assignment:
    """The placement after local moves that lower the most loaded device (see module doc); a new
    Assignment, `assignment` is left as it is. `capacities`: `<enc>_short` / `<enc>_long` rows per
    device (missing: 0). `splittable`: long-short SP is on (esp > 1), so segments may be split."""
    D, esp, G = grid.num_devices, grid.esp, grid.edp
    if not segments:
        return assignment
    splittable = splittable and esp > 1
    names = sorted({s.encoder for s in segments})
    cost = np.array([s.cost for s in segments], np.float64)
    rows = np.array([s.rows for s in segments], np.int64)
    enc = np.array([names.index(s.encoder) for s in segments])
    cap_s = np.array([int(capacities.get(f"{n}_short", 0)) for n in names], np.int64)
    cap_l = np.array([int(capacities.get(f"{n}_long", 0)) for n in names], np.int64)
    short_used, long_used = _rows_used(assignment, segments, grid, names)
    used = np.zeros((2, len(names), D), np.int64)            # [kind: 0 short, 1 long, encoder, device]
    for k, n in enumerate(names):
        used[0, k], used[1, k] = short_used[n], long_used[n]
    cap = np.stack([cap_s, cap_l])                            # [kind, encoder]
    # where each segment is: kind 0 short on device, 1 whole in a long buffer on device, 2 split over group
    kind = np.full(len(segments), -1)
    place = np.full(len(segments), -1)
    for d in range(D):
        for i in assignment.short[d]:
            kind[i], place[i] = 0, d
        for i in (assignment.long_whole or [[]] * D)[d]:
            kind[i], place[i] = 1, d
    for g, ids in enumerate(assignment.long):
        for i in ids:
            kind[i], place[i] = 2, g
    load = np.zeros(D)
    whole = kind < 2
    np.add.at(load, place[whole], cost[whole])
    split = np.flatnonzero(kind == 2)
    np.add.at(load, (place[split][:, None] * esp + np.arange(esp)).ravel(), np.repeat(cost[split] / esp, esp))
    chunk = {}

    def chunks(i: int) -> np.ndarray:
        if i not in chunk:
            chunk[i] = np.array(_chunks(int(rows[i]), segments[i].reduction, esp), np.int64)
        return chunk[i]

    limit = max_moves if max_moves is not None else 4 * len(segments) + 8 * D
    best_max, best_state = float(load.max()), (kind.copy(), place.copy(), load.copy())
    for _ in range(limit):
        move = None
        gmax = float(load.max())
        for d in np.argsort(-load, kind="stable")[:min(D, scan)].tolist():
            move = _best_move(d, load, gmax, whole, kind, place, cost, rows, enc, used, cap, G, esp, splittable, chunks)
            if move is not None:
                break
        if move is None:
            break
        if move[0] == "move":
            _, i, x, kt = move
            d = place[i]
            used[kind[i], enc[i], d] -= rows[i]
            used[kt, enc[i], x] += rows[i]
            load[d] -= cost[i]
            load[x] += cost[i]
            kind[i], place[i] = kt, x
        elif move[0] == "swap":
            _, i, j = move
            d, x, ki, kj = place[i], place[j], kind[i], kind[j]
            used[ki, enc[i], d] += rows[j] - rows[i]
            used[kj, enc[i], x] += rows[i] - rows[j]
            load[d] += cost[j] - cost[i]
            load[x] += cost[i] - cost[j]
            kind[i], place[i], kind[j], place[j] = kj, x, ki, d
        elif move[0] in ("split", "splitall"):  # one segment, or several of one group, over esp group g
            _, ids, g = move
            for i in ([ids] if move[0] == "split" else ids):
                d = place[i]
                used[kind[i], enc[i], d] -= rows[i]
                used[1, enc[i], g * esp:(g + 1) * esp] += chunks(i)
                load[d] -= cost[i]
                load[g * esp:(g + 1) * esp] += cost[i] / esp
                kind[i], place[i] = 2, g
                whole[i] = False
        else:
            _, i, g = move
            gd = place[i]
            used[1, enc[i], gd * esp:(gd + 1) * esp] -= chunks(i)
            used[1, enc[i], g * esp:(g + 1) * esp] += chunks(i)
            load[gd * esp:(gd + 1) * esp] -= cost[i] / esp
            load[g * esp:(g + 1) * esp] += cost[i] / esp
            place[i] = g
        if load.max() < best_max:
            best_max, best_state = float(load.max()), (kind.copy(), place.copy(), load.copy())
    kind, place, load = best_state
    out = Assignment([[] for _ in range(D)], [[] for _ in range(G)], load, assignment.redundant_cost,
                     [[] for _ in range(D)])
    for i in range(len(segments)):
        if kind[i] == 0:
            out.short[place[i]].append(i)
        elif kind[i] == 1:
            out.long_whole[place[i]].append(i)
        elif kind[i] == 2:
            out.long[place[i]].append(i)
    return out


def _best_move(d, load, gmax, whole, kind, place, cost, rows, enc, used, cap, G, esp, splittable, chunks):
    """The best move that takes work off device d, among those that lower the highest load of the
    devices they touch (so the loads sorted high to low fall) or else lower Σ load² (two devices
    that each hold a segment to split block each other otherwise; such a move may lift another
    device above the current max, and the caller keeps the best placement seen). Ranked by
    (not the first kind, touched devices' new max, change of Σ load², move kind). None if none."""
    tol = 1e-12 * max(gmax, 1e-300)
    best = None

    def offer(m: float, was: float, dssq: float, order: int, move: tuple):
        nonlocal best
        lexi = m < was - tol          # the touched devices' highest load drops: the sorted loads fall
        if (lexi or dssq < -tol * gmax) and (best is None or (not lexi, m, dssq, order) < best[:4]):
            best = (not lexi, m, dssq, order, move)

    ld = load[d]
    mine = np.flatnonzero(whole & (place == d))
    for i in mine[np.argsort(-cost[mine], kind="stable")].tolist():
        c, e, r, ki = cost[i], enc[i], rows[i], kind[i]
        # 1. the whole segment to device x, into its short (0) or long (1) buffer
        for kt in (0, 1):
            room = used[kt, e] + r <= cap[kt, e]
            room[d] = False
            if room.any():
                dssq = np.where(room, 2 * c * (load - ld + c), np.inf)
                x = int(np.argmin(dssq))
                offer(max(load[x] + c, ld - c), max(load[x], ld), float(dssq[x]), 0, ("move", i, x, kt))
        # 2. swap with a cheaper whole segment j of the same encoder on another device
        js = np.flatnonzero(whole & (enc == e) & (place != d) & (cost < c))
        if js.size:
            x, kj, dl = place[js], kind[js], c - cost[js]
            ok = (used[kj, e, x] - rows[js] + r <= cap[kj, e]) & (used[ki, e, d] - r + rows[js] <= cap[ki, e])
            if ok.any():
                dssq = np.where(ok, 2 * dl * (load[x] - ld + dl), np.inf)
                k = int(np.argmin(dssq))
                offer(max(load[x[k]] + dl[k], ld - dl[k]), max(load[x[k]], ld), float(dssq[k]), 1,
                      ("swap", i, int(js[k])))
        # 3. split over an esp group: its chunks into the group's long buffers
        if splittable:
            ch = chunks(i)
            lu = used[1, e].reshape(G, esp).copy()
            if ki == 1:
                lu[d // esp, d % esp] -= r
            fits = (lu + ch <= cap[1, e]).all(1)
            if fits.any():
                after = load.copy()
                after[d] -= c
                grp = after.reshape(G, esp)
                ssq = (after ** 2).sum() - (grp ** 2).sum(1) + ((grp + c / esp) ** 2).sum(1)
                new = np.maximum((grp + c / esp).max(1), after[d])
                dssq = ssq - (load ** 2).sum()
                was = np.maximum(load.reshape(G, esp).max(1), ld)
                for g in np.flatnonzero(fits).tolist():
                    offer(float(new[g]), float(was[g]), float(dssq[g]), 2, ("split", i, g))
    # 4. a split segment of d's group to another group
    gd = d // esp
    if splittable:
        grp = load.reshape(G, esp)
        for i in np.flatnonzero((kind == 2) & (place == gd)).tolist():
            c, e, ch = cost[i], enc[i], chunks(i)
            fits = (used[1, e].reshape(G, esp) + ch <= cap[1, e]).all(1)
            fits[gd] = False
            if fits.any():
                q = c / esp
                dssq = 2 * q * ((grp - grp[gd]).sum(1) + esp * q)   # Σ load² over both groups' devices
                new = np.maximum((grp + q).max(1), (grp[gd] - q).max())
                was = np.maximum(grp.max(1), grp[gd].max())
                for g in np.flatnonzero(fits).tolist():
                    offer(float(new[g]), float(was[g]), float(dssq[g]), 3, ("regroup", i, g))
        # 5. split several whole segments of d's group at once: each alone may not fit (its chunks land
        # on a device whose long buffer the other one fills) where together they free that room
        for e in np.unique(enc[whole & (place // esp == gd)]).tolist():
            ws = np.flatnonzero(whole & (enc == e) & (place // esp == gd))
            if ws.size < 2:
                continue
            ws = ws[np.argsort(-cost[ws], kind="stable")][:16]
            lu = used[1, e, gd * esp:(gd + 1) * esp].copy()
            gl = load[gd * esp:(gd + 1) * esp].copy()
            was = float(gl.max())
            for k, i in enumerate(ws.tolist()):
                lu += chunks(i)
                if kind[i] == 1:
                    lu[place[i] - gd * esp] -= rows[i]
                gl[place[i] - gd * esp] -= cost[i]
                gl += cost[i] / esp
                if k and (lu <= cap[1, e]).all():
                    dssq = float((gl ** 2).sum() - (load[gd * esp:(gd + 1) * esp] ** 2).sum())
                    offer(float(gl.max()), was, dssq, 4, ("splitall", tuple(int(j) for j in ws[:k + 1]), gd))
    return None if best is None else best[4]
