"""Which device encodes which segment: segments cut from a packed batch and costed, longest-first
placement (LPT) with long segments split over `esp` groups, and the capacity search that fits a step
(or a window of steps) into few buffer shapes. Pure numpy: the same inputs give the same placement on
every host."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from omnijax.data.payload import Runs
from omnijax.errors import ConfigError
from omnijax.parallel.device_grid import DeviceGrid


# ---------------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class Segment:
    """One image / clip / audio in the packed global batch."""

    encoder: str
    start: int          # first input row in the global `<encoder>_inputs`
    rows: int           # input rows (a multiple of the encoder's reduction)
    reduction: int
    dests: np.ndarray   # global flat LLM index of each output token (rows / reduction of them)
    cost: float

    @property
    def tokens(self) -> int:
        return self.rows // self.reduction


def segments_of(batch: dict, reductions: dict[str, int], cost_fn: Callable[[str, int], float]) -> list[Segment]:
    """Runs of equal non-zero `<enc>_segment_ids`, in buffer (arrival) order, encoders sorted by name.

    Segment ids given as `data.payload.Runs` (a step laid out from metadata) are read run by run, their
    destinations sliced per segment: nothing of the size of the step's buffers is built."""
    out = []
    for name in sorted(reductions):
        if f"{name}_segment_ids" not in batch:
            continue
        r = reductions[name]
        ids = batch[f"{name}_segment_ids"]
        if isinstance(ids, Runs):
            dest = batch[f"{name}_dest"]
            for a, n in zip(ids.starts.tolist(), ids.lengths.tolist()):
                if a % r or n % r:
                    raise ValueError(f"{name} segment at row {a} with {n} rows is not aligned to its reduction {r}")
                out.append(Segment(name, a, n, r, np.asarray(dest[a // r:(a + n) // r], np.int64),
                                   float(cost_fn(name, n))))
            continue
        seg = np.asarray(ids)
        dest = np.asarray(batch[f"{name}_dest"])
        idx = np.flatnonzero(seg > 0)
        if idx.size == 0:
            continue
        breaks = np.flatnonzero((np.diff(idx) != 1) | (np.diff(seg[idx]) != 0)) + 1
        for run in np.split(idx, breaks):
            a, n = int(run[0]), int(run.size)
            if a % r or n % r:
                raise ValueError(f"{name} segment at row {a} with {n} rows is not aligned to its reduction {r}")
            out.append(Segment(name, a, n, r, dest[a // r:(a + n) // r].astype(np.int64), float(cost_fn(name, n))))
    return out


# -------------------------------------------------------------------------------- assignment
@dataclass
class Assignment:
    """Which device encodes what: `short[d]` = segment indices encoded whole in device d's short
    buffer, `long[g]` = segments sharded over esp group g, `long_whole[d]` = short segments encoded
    whole in the room left in device d's long (sequence-parallel) buffer (their segment ids keep
    attention inside them; they only attend through the group's all-to-all); `device_cost` = encoder
    cost per device; `redundant_cost` = cost spent on replicas (coupled baseline)."""

    short: list[list[int]]
    long: list[list[int]]
    device_cost: np.ndarray
    redundant_cost: float = 0.0
    long_whole: list[list[int]] | None = None


def _lpt(order: list[int], costs: np.ndarray, load: np.ndarray, bins: int) -> list[list[int]]:
    """Longest-processing-time first onto the least-loaded bin (ties: lowest index)."""
    out = [[] for _ in range(bins)]
    for i in order:
        b = int(np.argmin(load))
        out[b].append(i)
        load[b] += costs[i]
    return out


def assign(segments: list[Segment], grid: DeviceGrid, mode: str = "balanced", long_short: bool = True,
           long_factor: float = 1.0) -> Assignment:
    """Decoupled placement: long segments onto esp groups, short ones onto devices, by cost."""
    if mode == "coupled":
        raise ValueError("the coupled placement needs the LLM geometry: use build_plan(mode='coupled')")
    D = grid.num_devices
    costs = np.array([s.cost for s in segments], np.float64)
    load = np.zeros(D)
    long: list[list[int]] = [[] for _ in range(grid.edp)]
    short_ids = list(range(len(segments)))
    if long_short and grid.esp > 1 and segments:
        share = costs.sum() / D * long_factor
        long_ids = [i for i in short_ids if costs[i] > share]
        short_ids = [i for i in short_ids if costs[i] <= share]
        group_load = np.zeros(grid.edp)
        for i in sorted(long_ids, key=lambda i: (-costs[i], i)):
            g = int(np.argmin(group_load))
            long[g].append(i)
            group_load[g] += costs[i] / grid.esp
        load += np.repeat(group_load, grid.esp)
    if mode == "balanced":
        order = sorted(short_ids, key=lambda i: (-costs[i], i))
        short = _lpt(order, costs, load, D)
    else:  # arrival: contiguous runs of the arrival order, equal counts per device
        short = [list(chunk) for chunk in np.array_split(np.array(short_ids, np.int64), D)]
        short = [[int(i) for i in c] for c in short]
        for d, ids in enumerate(short):
            load[d] += costs[ids].sum() if ids else 0.0
    return Assignment(short, long, load)


# ------------------------------------------------------------------- capacity-aware placement
def _chunks(rows: int, reduction: int, esp: int) -> list[int]:
    """Rows of each esp rank's chunk of a segment sharded over a group (whole output tokens each)."""
    per = math.ceil(rows // reduction / esp) * reduction
    return [max(0, min(rows, (k + 1) * per) - k * per) for k in range(esp)]


def _bucket_set(multiple: int, smallest: int, growth: float, largest: int) -> list[int]:
    """0 and the geometric capacities smallest * growth^k (multiples of `multiple`) up to the first >= largest."""
    out, c = [0], math.ceil(max(multiple, smallest) / multiple) * multiple
    while True:
        out.append(c)
        if c >= largest:
            return out
        c = max(c + multiple, math.ceil(c * growth / multiple) * multiple)


@dataclass
class _Fit:
    short: list[list[int]]
    whole: list[list[int]]
    split: list[list[int]]
    load: np.ndarray


def _fit_encoder(ids: list[int], must: set[int], segments: list[Segment], grid: DeviceGrid, L: int, S: int,
                 load: np.ndarray, splittable: bool, best_fit: bool) -> _Fit | None:
    """Place one encoder's segments into per-device buffers of `S` short and `L` long rows, or None.

    `must` segments are sharded over an esp group (their chunks go into the long buffers). The others,
    largest first, go whole into a short buffer or into the room left in a long buffer, on the device
    with the least encoder cost so far (`best_fit`: the tightest room instead, for tight capacities);
    one that fits nowhere whole is sharded over a group if `splittable`. Deterministic."""
    D, esp = grid.num_devices, grid.esp
    room_l, room_s = [L] * D, [S] * D
    load = load.copy()
    out = _Fit([[] for _ in range(D)], [[] for _ in range(D)], [[] for _ in range(grid.edp)], load)

    def split(i: int) -> bool:
        s = segments[i]
        ch = _chunks(s.rows, s.reduction, esp)
        ok = [g for g in range(grid.edp) if all(room_l[g * esp + k] >= ch[k] for k in range(esp))]
        if not ok:
            return False
        if best_fit:
            g = min(ok, key=lambda g: (min(room_l[g * esp + k] - ch[k] for k in range(esp)), g))
        else:
            g = min(ok, key=lambda g: (float(load[g * esp:(g + 1) * esp].sum()), g))
        for k in range(esp):
            room_l[g * esp + k] -= ch[k]
            load[g * esp + k] += s.cost / esp
        out.split[g].append(i)
        return True

    for i in sorted(must, key=lambda i: (-segments[i].rows, i)):
        if not split(i):
            return None
    for i in sorted((i for i in ids if i not in must), key=lambda i: (-segments[i].rows, i)):
        n = segments[i].rows
        opts = [(d, 0, room_s) for d in range(D) if room_s[d] >= n] + [(d, 1, room_l) for d in range(D) if room_l[d] >= n]
        if opts:
            if best_fit:
                d, kind, room = min(opts, key=lambda o: (o[2][o[0]] - n, o[1], o[0]))
            else:
                d, kind, room = min(opts, key=lambda o: (load[o[0]], o[1], o[0]))
            room[d] -= n
            load[d] += segments[i].cost
            (out.whole if kind else out.short)[d].append(i)
        elif not (splittable and split(i)):
            return None
    return out


def _fit_any(ids, must, segments, grid, L, S, load, splittable) -> _Fit | None:
    """Cost-balancing placement first; if the capacities are too tight for it, best fit."""
    return (_fit_encoder(ids, must, segments, grid, L, S, load, splittable, False)
            or _fit_encoder(ids, must, segments, grid, L, S, load, splittable, True))


def _search_caps(rows: list[list[int]], chunks: list[list[int]], reduction: int, D: int, splittable: bool,
                 min_rows: int, growth: float, fits: Callable[[int, int], bool],
                 fixed: tuple[int | None, int | None] = (None, None)) -> tuple[int, int]:
    """Smallest (long, short) capacities, by total rows per device (then the smaller long buffer),
    from the bucket set, for which `fits(L, S)` holds. `rows`/`chunks`: per part (batch or microbatch),
    the rows of every segment / the largest chunk each must-split segment puts on one device."""
    total = max((sum(r) for r in rows), default=0)
    biggest = max((max(r) for r in rows if r), default=0)
    lb = math.ceil(total / D / reduction) * reduction
    top = max(total, 1)
    Ls = _bucket_set(reduction, min_rows, growth, top) if splittable else [0]
    Ss = _bucket_set(reduction, min_rows, growth, top)
    need_l = max((max(c) for c in chunks if c), default=0)
    if fixed[0] is not None:
        Ls = [fixed[0]]
    if fixed[1] is not None:
        Ss = [fixed[1]]
    best = None
    for L in Ls:
        if L < need_l:
            continue
        if best is not None and L >= best[0]:
            break
        for S in Ss:
            if best is not None and L + S >= best[0]:
                break
            if L + S < lb or (not splittable and S < biggest):
                continue
            if fits(L, S):
                best = (L + S, L, S)
                break
    if best is None:
        raise ConfigError(f"no {fixed} capacities hold these encoder segments (largest {biggest} rows)")
    return best[1], best[2]


def _must_split(segments: list[Segment], grid: DeviceGrid, long_short: bool, long_factor: float) -> set[int]:
    """Segments whose cost is above one device's fair share of the step's encoder cost (long ones)."""
    if not (long_short and grid.esp > 1 and segments):
        return set()
    costs = np.array([s.cost for s in segments], np.float64)
    share = costs.sum() / grid.num_devices * long_factor
    return {i for i in range(len(segments)) if costs[i] > share}


def _place_balanced(parts: list[list[Segment]], grid: DeviceGrid, names: list[str], long_short: bool,
                    long_factor: float, caps: dict, min_rows: int, growth: float,
                    reductions: dict[str, int]) -> tuple[list[Assignment], dict]:
    """Capacity-aware balanced placement of one or more parts (a batch, or the microbatches of a
    window) that share capacities. Per encoder (sorted by name): the (long, short) capacities are
    the pinned ones, else the smallest in the bucket set that every part fits; then each part is
    placed by `_fit_any` (cost carried over from the encoders placed before). Returns one
    Assignment per part and the capacities."""
    D = grid.num_devices
    splittable = long_short and grid.esp > 1
    loads = [np.zeros(D) for _ in parts]
    musts = [_must_split(segs, grid, long_short, long_factor) for segs in parts]
    out = [Assignment([[] for _ in range(D)], [[] for _ in range(grid.edp)], np.zeros(D),
                      long_whole=[[] for _ in range(D)]) for _ in parts]
    caps = dict(caps)
    for n in names:
        r = reductions[n]
        ids = [[i for i, s in enumerate(segs) if s.encoder == n] for segs in parts]
        must = [{i for i in m if parts[p][i].encoder == n} for p, m in enumerate(musts)]

        def fit_all(L: int, S: int) -> list[_Fit] | None:
            fits = []
            for p, segs in enumerate(parts):
                f = _fit_any(ids[p], must[p], segs, grid, L, S, loads[p], splittable)
                if f is None:
                    return None
                fits.append(f)
            return fits

        rows = [[parts[p][i].rows for i in ids[p]] for p in range(len(parts))]
        chunks = [[max(_chunks(parts[p][i].rows, r, grid.esp)) for i in must[p]] for p in range(len(parts))]
        pinned = (caps.get(f"{n}_long"), caps.get(f"{n}_short"))
        if not splittable and pinned[0] is None:
            pinned = (0, pinned[1])
        if None not in pinned:
            L, S = pinned
            fits = fit_all(L, S)
            if fits is None:
                raise ConfigError(f"pinned capacity for {n} is too small: its segments do not fit {L} long / {S} short rows")
        else:
            L, S = _search_caps(rows, chunks, r, D, splittable, min_rows, growth,
                                lambda L, S: fit_all(L, S) is not None, pinned)
            fits = fit_all(L, S)
        caps[f"{n}_long"], caps[f"{n}_short"] = L, S
        for p, f in enumerate(fits):
            loads[p] = f.load
            a = out[p]
            for d in range(D):
                a.short[d] += f.short[d]
                a.long_whole[d] += f.whole[d]
            for g in range(grid.edp):
                a.long[g] += f.split[g]
    for p, a in enumerate(out):
        a.device_cost = loads[p]
    return out, caps


def spread_over_hosts(assignment: Assignment, segments: list[Segment], grid: DeviceGrid, host_of: np.ndarray,
                      dims: dict[str, int]) -> Assignment:
    """The same placement with whole esp groups moved between group slots so that every host decodes
    about its share of the step's payload (float32 input bytes x width, what `put_batch` decodes).

    A group's work (its devices' short and long buffers, in order) moves as one, so every device's
    cost, buffer rows and the capacities stay as they are; only which host decodes what changes.
    Two hosts and few groups: the split of the groups closest to even, searched exactly (ties: the first
    in order); else contents, heaviest payload first, go to a free slot on the host with the least payload
    so far (ties: the lower slot). Each host keeps its number of slots. Deterministic."""
    D, esp, G = grid.num_devices, grid.esp, grid.edp
    host_of = np.asarray(host_of, np.int64)
    hosts = int(host_of.max()) + 1
    if hosts <= 1 or not segments:
        return assignment
    dev_bytes = np.zeros(D)
    width = lambda i: 4.0 * dims[segments[i].encoder]  # noqa: E731
    for d in range(D):
        dev_bytes[d] += sum(segments[i].rows * width(i) for i in assignment.short[d])
        dev_bytes[d] += sum(segments[i].rows * width(i) for i in (assignment.long_whole or [[]] * D)[d])
    for g, ids in enumerate(assignment.long):
        for i in ids:
            for k, rows in enumerate(_chunks(segments[i].rows, segments[i].reduction, esp)):
                dev_bytes[g * esp + k] += rows * width(i)
    slot_host = host_of[np.arange(G) * esp]  # a slot's host: its first device's (groups sit inside a host)
    load = np.zeros(hosts)
    free = {h: [g for g in range(G) if slot_host[g] == h] for h in range(hosts)}
    group_bytes = dev_bytes.reshape(G, esp)
    target = [0] * G  # content g -> slot
    k = len(free[0])
    if hosts == 2 and math.comb(G, k) <= 4096:  # two hosts, few groups: the best split, searched exactly
        total, per = float(group_bytes.sum()), group_bytes.sum(1)
        best = min(itertools.combinations(range(G), k), key=lambda c: (abs(2 * float(per[list(c)].sum()) - total), c))
        rest = [g for g in range(G) if g not in best]
        for g, slot in [*zip(best, free[0]), *zip(rest, free[1])]:
            target[g] = slot
    else:  # heaviest first onto the host with the least payload so far
        for g in sorted(range(G), key=lambda g: (-float(group_bytes[g].sum()), g)):
            h = min((h for h in range(hosts) if free[h]), key=lambda h: (load[h], h))
            slot = free[h].pop(0)
            target[g] = slot
            np.add.at(load, host_of[slot * esp:(slot + 1) * esp], group_bytes[g])
    if target == list(range(G)):
        return assignment
    dev = np.array([target[d // esp] * esp + d % esp for d in range(D)])  # old device -> new device
    short, whole = [[] for _ in range(D)], [[] for _ in range(D)]
    cost = np.zeros(D)
    for d in range(D):
        short[dev[d]] = list(assignment.short[d])
        whole[dev[d]] = list((assignment.long_whole or [[]] * D)[d])
        cost[dev[d]] = assignment.device_cost[d]
    long = [[] for _ in range(G)]
    for g in range(G):
        long[target[g]] = list(assignment.long[g])
    return Assignment(short, long, cost, assignment.redundant_cost, whole)


BUCKET_GROWTH = 1.0625  # geometric bucket steps: at most ~6% padding from rounding; the multiplexer reuses programs
# (`Multiplexer.size_window`), so fine steps do not mean one program per window


def _bucket(need: int, multiple: int, smallest: int, growth: float = BUCKET_GROWTH) -> int:
    """Smallest capacity of the set {0} + smallest * growth^k (rounded up to `multiple`) >= need."""
    if need <= 0:
        return 0
    c = math.ceil(max(multiple, smallest) / multiple) * multiple
    while c < need:
        c = max(c + multiple, math.ceil(c * growth / multiple) * multiple)
    return c
