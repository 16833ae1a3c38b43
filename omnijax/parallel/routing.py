"""Host-side plan of encoder work and of the encoder -> LLM resharding (pure and deterministic).

Every device encodes (decoupled parallelism): the encoder mesh is a second view of the LLM's
devices, `(edp, esp)`, where `esp` groups are runs of consecutive devices in the LLM mesh's
flattened order, i.e. its innermost (fastest) axes. Per step the plan

1. cuts the packed global batch into encoder segments (one image / clip / audio each) and costs
   them (`a·n + b·n²` per segment);
2. splits them into *long* segments (cost above one device's fair share, when `esp > 1`), each
   sharded over an `esp` group with sequence-parallel attention, and *short* ones, packed whole
   into per-device buffers (longest-first greedy on cost, or arrival order for the baseline);
3. routes every encoder output token to every device that holds its LLM position (the LLM block
   `(batch shard, cp rank)`, replicated over `pp` and `tp`), as fixed-capacity send/receive tables
   for one `all_to_all`.

The *coupled* baseline places encoder work as a trainer that bolts encoders onto the first
pipeline stage would: each batch shard's segments are encoded on the `pp=0` devices of that shard,
replicated over its `cp` and `tp` ranks, in arrival order.

Everything here is numpy on the host: the same inputs give the same plan on every host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal

import numpy as np

from omnijax.errors import ConfigError

MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")
Mode = Literal["balanced", "arrival", "coupled"]


# ----------------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceGrid:
    """The LLM mesh shape plus the encoder view's `esp` size, as the planner needs them."""

    sizes: tuple[int, ...]  # in MESH_AXES order
    esp: int = 1

    def __post_init__(self):
        if len(self.sizes) != len(MESH_AXES):
            raise ValueError(f"sizes must give {len(MESH_AXES)} axes {MESH_AXES}")
        if self.esp < 1 or self.num_devices % self.esp:
            raise ConfigError(f"parallel.encoder: esp={self.esp} must divide the {self.num_devices} devices")

    @classmethod
    def from_layout(cls, layout, esp: int = 1) -> "DeviceGrid":
        return cls(tuple(int(layout.sizes[a]) for a in MESH_AXES), esp)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    @property
    def edp(self) -> int:
        return self.num_devices // self.esp

    def size(self, axis: str) -> int:
        return self.sizes[MESH_AXES.index(axis)]

    @property
    def batch_shards(self) -> int:
        return self.size("dp") * self.size("fsdp") * self.size("ep")

    def coords(self) -> np.ndarray:
        """[D, 6] mesh coordinates of every device, in flattened (row-major) mesh order."""
        return np.stack(np.unravel_index(np.arange(self.num_devices), self.sizes), axis=1)

    def batch_shard(self) -> np.ndarray:
        c = self.coords()
        dp, fsdp, ep = (MESH_AXES.index(a) for a in ("dp", "fsdp", "ep"))
        return (c[:, dp] * self.size("fsdp") + c[:, fsdp]) * self.size("ep") + c[:, ep]

    def axis(self, name: str) -> np.ndarray:
        return self.coords()[:, MESH_AXES.index(name)]

    def receivers(self, first_stage_only: bool = False) -> dict[tuple[int, int], np.ndarray]:
        """(batch shard, cp rank) -> devices holding that LLM block (all its pp and tp replicas, or
        only the pp=0 ones when the encoder outputs feed the first pipeline stage directly)."""
        shard, cp, pp = self.batch_shard(), self.axis("cp"), self.axis("pp")
        stage = (pp == 0) if first_stage_only else np.ones_like(pp, bool)
        return {(s, c): np.flatnonzero((shard == s) & (cp == c) & stage)
                for s in range(self.batch_shards) for c in range(self.size("cp"))}

    def esp_axes(self) -> tuple[str, ...]:
        """Mesh axes that make up one esp group: the innermost non-trivial axes whose sizes multiply to esp."""
        if self.esp == 1:
            return ()
        axes, prod = [], 1
        for name in reversed(MESH_AXES):
            n = self.size(name)
            if n == 1:
                continue
            axes.insert(0, name)
            prod *= n
            if prod >= self.esp:
                break
        if prod != self.esp:
            inner = "x".join(f"{a}{self.size(a)}" for a in reversed(MESH_AXES) if self.size(a) > 1)
            raise ConfigError(f"parallel.encoder: esp={self.esp} must equal the product of the innermost LLM mesh axes "
                              f"(so esp groups stay on the fast links); innermost first: {inner or 'none'}")
        return tuple(axes)


def parse_encoder_layout(text: str, num_devices: int) -> tuple[int, int]:
    """`"edp4xesp2"` -> (edp, esp); `""` -> (num_devices, 1). The product must be the device count."""
    text = text.strip().lower()
    sizes = {"edp": 1, "esp": 1}
    if text:
        for token in text.split("x"):
            name = token.rstrip("0123456789")
            digits = token[len(name):]
            if name not in sizes or not digits:
                raise ConfigError(f"parallel.encoder={text!r}: cannot read '{token}'; write e.g. 'edp4xesp2'")
            sizes[name] = int(digits)
        if "edp" not in text:
            sizes["edp"] = num_devices // max(sizes["esp"], 1)
    else:
        sizes["edp"] = num_devices
    if sizes["edp"] * sizes["esp"] != num_devices:
        raise ConfigError(f"parallel.encoder={text!r}: edp{sizes['edp']} x esp{sizes['esp']} = "
                          f"{sizes['edp'] * sizes['esp']} devices, but there are {num_devices}")
    return sizes["edp"], sizes["esp"]


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
    """Runs of equal non-zero `<enc>_segment_ids`, in buffer (arrival) order, encoders sorted by name."""
    out = []
    for name in sorted(reductions):
        if f"{name}_segment_ids" not in batch:
            continue
        seg = np.asarray(batch[f"{name}_segment_ids"])
        dest = np.asarray(batch[f"{name}_dest"])
        r = reductions[name]
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


def assign(segments: list[Segment], grid: DeviceGrid, mode: Mode = "balanced", long_short: bool = True,
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


# -------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    """Per-device arrays (leading axis = device, flattened LLM mesh order) plus statistics.

    `devices`: the devices the arrays' leading axis holds, in order (None: all of them). A host that
    plans with `fill_devices` keeps only its own devices' buffers and routing rows, so its memory grows
    with its own devices, not with the cluster's."""

    arrays: dict[str, np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)
    capacities: tuple = ()
    devices: tuple[int, ...] | None = None


BUCKET_GROWTH = 1.25  # geometric bucket steps: at most ~20% padding from rounding, few distinct shapes


def _bucket(need: int, multiple: int, smallest: int, growth: float = BUCKET_GROWTH) -> int:
    """Smallest capacity of the set {0} + smallest * growth^k (rounded up to `multiple`) >= need."""
    if need <= 0:
        return 0
    c = math.ceil(max(multiple, smallest) / multiple) * multiple
    while c < need:
        c = max(c + multiple, math.ceil(c * growth / multiple) * multiple)
    return c


def llm_geometry(batch_rows: int, row_len: int, grid: DeviceGrid,
                 order: Callable[[int, int], np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every global flat LLM index: (batch shard, cp rank, local flat index in that block).

    `order(row_len, cp)` is the stored order of a row under context parallelism (the LLM's
    load-balanced layout), so a position's cp rank and local index follow where it is stored."""
    S, C = grid.batch_shards, grid.size("cp")
    if batch_rows % S:
        raise ConfigError(f"{batch_rows} LLM rows do not split over {S} batch shards")
    if row_len % C:
        raise ConfigError(f"row length {row_len} does not split over cp={C}")
    b_loc, l_loc = batch_rows // S, row_len // C
    stored_at = np.empty(row_len, np.int64)
    stored_at[order(row_len, C)] = np.arange(row_len)
    b = np.repeat(np.arange(batch_rows), row_len)
    l = stored_at[np.tile(np.arange(row_len), batch_rows)]
    return b // b_loc, l // l_loc, (b % b_loc) * l_loc + (l % l_loc)


def build_plan(batch: dict, grid: DeviceGrid, reductions: dict[str, int], dims: dict[str, int],
               cost_fn: Callable[[str, int], float], *, order: Callable[[int, int], np.ndarray],
               mode: Mode = "balanced", long_short: bool = True, long_factor: float = 1.0,
               min_rows: int = 16, min_route: int = 8, capacities: dict | None = None,
               first_stage_only: bool = False, growth: float = BUCKET_GROWTH,
               fill_devices: Collection[int] | None = None) -> Plan:
    """Encoder buffers per device and the routing tables of the encoder -> LLM all-to-all.

    `fill_devices`: the devices whose buffers and routing rows this host builds (its own): the plan's
    arrays then hold only those (`Plan.devices`), and only their segments' payloads are read
    (`batch[<enc>_inputs]` may be a `data.payload.LazyRows` that decodes a segment only when sliced).
    Placement, capacities and statistics stay those of the whole step. None: every device.

    Arrays (leading axis D = devices): `<enc>_short_{inputs,segment_ids,positions}` [D, Ns, ...],
    `<enc>_long_{...}` [D, Nl, ...], `route_send` [D, D, C] (local output row or the pad row),
    `route_recv` [D, D, C] (local flat LLM index or the drop index). Capacities come from
    geometric buckets (`growth`; 0 for a buffer nothing uses), or `capacities` to pin them (a
    partial dict pins those keys only). `first_stage_only` routes outputs to the pp=0 replicas only
    (the pipeline's input stage), for plans executed inside the pipeline.

    mode "balanced" places capacity-aware (`_place_balanced`): per encoder the smallest (long,
    short) capacities that hold the step, short segments also filling the room long chunks leave in
    the long buffers, cost balanced per device. "arrival" and "coupled" keep their placement and
    size the buffers to it.
    """
    tokens = np.asarray(batch["tokens"])
    B, L = tokens.shape
    shard_of, cp_of, local_of = llm_geometry(B, L, grid, order)
    receivers = grid.receivers(first_stage_only)
    segments = segments_of(batch, reductions, cost_fn)
    names = sorted(n for n in reductions if f"{n}_segment_ids" in batch)
    pinned = dict(capacities or {})
    geometry = (shard_of, cp_of, local_of, receivers)

    if mode != "balanced":
        if mode == "coupled":
            assignment, source_of = _coupled(segments, grid, shard_of)
        else:
            assignment, source_of = assign(segments, grid, mode, long_short, long_factor), None
        return _materialize(batch, grid, reductions, dims, segments, names, assignment, source_of, pinned,
                            geometry, long_short, min_rows, min_route, growth, fill_devices)
    try:
        (assignment,), caps = _place_balanced([segments], grid, names, long_short, long_factor, pinned, min_rows,
                                              growth, reductions)
        return _materialize(batch, grid, reductions, dims, segments, names, assignment, None, caps, geometry,
                            long_short, min_rows, min_route, growth, fill_devices)
    except ConfigError:
        if not pinned:
            raise
    # The pinned capacities are too tight for the placement made inside them (a heuristic), or its
    # routes need more than the pinned route capacity: the unpinned placement still fits if its own
    # capacities lie inside the pins (so capacities that grew to cover it always work).
    enc_pins = {k: v for k, v in pinned.items() if k != "route"}
    (assignment,), caps = _place_balanced([segments], grid, names, long_short, long_factor, {}, min_rows, growth,
                                          reductions)
    too_small = [k for k, v in caps.items() if v > enc_pins.get(k, v)]
    if too_small:
        raise ConfigError(f"pinned capacities too small for this batch: {', '.join(f'{k} needs {caps[k]} > {pinned[k]}' for k in too_small)}")
    return _materialize(batch, grid, reductions, dims, segments, names, assignment, None, {**caps, **pinned},
                        geometry, long_short, min_rows, min_route, growth, fill_devices)


def _materialize(batch, grid, reductions, dims, segments, names, assignment, source_of, caps, geometry,
                 long_short, min_rows, min_route, growth, fill_devices=None) -> Plan:
    """Buffers and routing tables of an assignment; capacities not in `caps` are bucketed to the need."""
    D = grid.num_devices
    shard_of, cp_of, local_of, receivers = geometry
    B, L = np.asarray(batch["tokens"]).shape
    # --- encoder buffers: rows per device and encoder
    seg_rows = {n: [[] for _ in range(D)] for n in names}       # short
    long_rows = {n: [[] for _ in range(D)] for n in names}      # (segment, chunk lo, chunk hi)
    for d, ids in enumerate(assignment.short):
        for i in ids:
            seg_rows[segments[i].encoder][d].append(i)
    for g, ids in enumerate(assignment.long):
        for i in ids:
            s = segments[i]
            per = math.ceil(s.tokens / grid.esp) * s.reduction
            for k in range(grid.esp):
                lo, hi = k * per, min(s.rows, (k + 1) * per)
                if lo < hi:
                    long_rows[s.encoder][g * grid.esp + k].append((i, lo, hi))
    for d, ids in enumerate(assignment.long_whole or []):
        for i in ids:
            long_rows[segments[i].encoder][d].append((i, 0, segments[i].rows))
    caps = dict(caps)
    for n in names:
        r = reductions[n]
        need_s = max(sum(segments[i].rows for i in seg_rows[n][d]) for d in range(D))
        need_l = max(sum(hi - lo for _, lo, hi in long_rows[n][d]) for d in range(D))
        caps.setdefault(f"{n}_short", _bucket(need_s, r, min_rows, growth))
        caps.setdefault(f"{n}_long", _bucket(need_l, r, min_rows, growth) if (long_short and grid.esp > 1) else 0)
        if need_s > caps[f"{n}_short"] or need_l > caps[f"{n}_long"]:
            raise ConfigError(f"pinned capacity for {n} is too small: needs {need_s} short / {need_l} long rows")

    kept = list(range(D)) if fill_devices is None else sorted({int(d) for d in fill_devices})
    fill = set(kept)
    slot = {d: k for k, d in enumerate(kept)}  # device -> its row in this host's arrays
    arrays: dict[str, np.ndarray] = {}
    out_row: dict[tuple[int, int, int], int] = {}  # (segment, token j, device) -> output row there (replicated)
    hold_dev = [np.full(s.tokens, -1, np.int64) for s in segments]  # token j of segment i: first device holding it
    hold_row = [np.full(s.tokens, -1, np.int64) for s in segments]  # ... and its output row on that device
    offset = 0
    for n in names:
        r = reductions[n]
        x = batch[f"{n}_inputs"]  # sliced per segment: only the filled devices' segments are read
        pos = np.asarray(batch[f"{n}_positions"])
        if hasattr(x, "load"):  # lazy payloads: decode this host's segments together, in parallel
            spans = [(segments[i].start + lo, segments[i].start + hi) for rows_of in (seg_rows[n], long_rows[n])
                     for d in sorted(fill) for item in rows_of[d]
                     for i, lo, hi in [(item, 0, segments[item].rows) if isinstance(item, (int, np.integer)) else item]]
            x.load(spans)
        for part, rows_of in (("short", seg_rows[n]), ("long", long_rows[n])):
            cap = caps[f"{n}_{part}"]
            inp = np.zeros((len(kept), cap, dims[n]), np.float32)
            sid = np.zeros((len(kept), cap), np.int32)
            ppos = np.zeros((len(kept), cap, 3), np.int32)
            for d in range(D):
                used = 0
                for item in rows_of[d]:
                    i, lo, hi = (item, 0, segments[item].rows) if part == "short" else item
                    s = segments[i]
                    m = hi - lo
                    if d in fill:
                        k = slot[d]
                        inp[k, used:used + m] = x[s.start + lo:s.start + hi]
                        ppos[k, used:used + m] = pos[s.start + lo:s.start + hi]
                        sid[k, used:used + m] = i + 1  # unique per segment across devices (esp groups gather)
                    j0, j1, row0 = lo // r, hi // r, offset + used // r
                    if source_of is not None:  # replicated placements pick a source per destination
                        for j in range(j0, j1):
                            out_row[(i, j, d)] = row0 + (j - j0)
                    free = hold_dev[i][j0:j1] < 0
                    hold_dev[i][j0:j1][free] = d
                    hold_row[i][j0:j1][free] = (row0 + np.arange(j1 - j0))[free]
                    used += m
            arrays[f"{n}_{part}_inputs"], arrays[f"{n}_{part}_segment_ids"] = inp, sid
            arrays[f"{n}_{part}_positions"] = ppos
            offset += cap // r
    pad_row = offset  # the executor appends one zero row after all outputs

    # --- routing: every output token to every replica holding its LLM position
    drop = (B // grid.batch_shards) * (L // grid.size("cp"))
    if source_of is None:
        src, dst, out, to = _route_pairs(segments, hold_dev, hold_row, receivers, shard_of, cp_of, local_of)
    else:
        items = []
        for i, s in enumerate(segments):
            for j, f in enumerate(s.dests):
                if f < 0:
                    continue
                for d in receivers[(int(shard_of[f]), int(cp_of[f]))]:
                    a = source_of(i, int(d))
                    items.append((a, int(d), out_row[(i, j, a)], int(local_of[f])))
        src, dst, out, to = (np.array(c, np.int64) for c in zip(*items)) if items else [np.zeros(0, np.int64)] * 4
    key = src * D + dst
    order = np.argsort(key, kind="stable")  # a pair's tokens keep their (segment, token) order
    key, src, dst, out, to = key[order], src[order], dst[order], out[order], to[order]
    first = np.searchsorted(key, key, side="left")
    slot_in_pair = np.arange(key.size) - first
    pair_keys = np.unique(key)
    need = int(slot_in_pair.max()) + 1 if key.size else 0
    C = caps.setdefault("route", _bucket(max(need, 1), 1, min_route))
    if need > C:
        raise ConfigError(f"pinned route capacity {C} is too small: a device pair exchanges {need} tokens")
    send = np.full((len(kept), D, C), pad_row, np.int32)
    recv = np.full((len(kept), D, C), drop, np.int32)
    here = np.array([d in fill for d in range(D)])
    s_ok, d_ok = here[src], here[dst]
    rank = np.full(D, -1, np.int64)
    rank[kept] = np.arange(len(kept))
    send[rank[src[s_ok]], dst[s_ok], slot_in_pair[s_ok]] = out[s_ok]
    recv[rank[dst[d_ok]], src[d_ok], slot_in_pair[d_ok]] = to[d_ok]
    arrays["route_send"], arrays["route_recv"] = send, recv
    pairs = pair_keys

    stats = _stats(segments, assignment, grid, caps, names, reductions, batch, pairs)
    return Plan(arrays, stats, tuple(sorted(caps.items())), None if fill_devices is None else tuple(kept))


def _route_pairs(segments, hold_dev, hold_row, receivers, shard_of, cp_of, local_of):
    """(source device, destination device, output row at the source, flat LLM index at the destination)
    of every routed token, in (segment, token, receiver) order, vectorised over tokens."""
    empty = np.zeros(0, np.int64)
    if not segments:
        return empty, empty, empty, empty
    dests = np.concatenate([s.dests for s in segments])
    hold = np.concatenate([h[:len(s.dests)] for h, s in zip(hold_dev, segments)])
    rows = np.concatenate([h[:len(s.dests)] for h, s in zip(hold_row, segments)])
    ok = dests >= 0
    dests, hold, rows = dests[ok], hold[ok], rows[ok]
    blocks = sorted(receivers)
    width = {len(v) for v in receivers.values()}
    if len(width) != 1:
        raise ValueError("every LLM block must have the same number of replicas")
    (R,) = width
    table = np.zeros((max(b[0] for b in blocks) + 1, max(b[1] for b in blocks) + 1, R), np.int64)
    for (sh, c), devs in receivers.items():
        table[sh, c] = devs
    to_dev = table[shard_of[dests], cp_of[dests]]                        # [T, R]
    src = np.repeat(hold, R)
    return src, to_dev.reshape(-1), np.repeat(rows, R), np.repeat(local_of[dests].astype(np.int64), R)


def _coupled(segments: list[Segment], grid: DeviceGrid, shard_of: np.ndarray):
    """Each batch shard's segments on its pp=0 devices, replicated over cp and tp, arrival order."""
    D = grid.num_devices
    shard, pp, cp, tp = grid.batch_shard(), grid.axis("pp"), grid.axis("cp"), grid.axis("tp")
    short: list[list[int]] = [[] for _ in range(D)]
    load = np.zeros(D)
    owners = {}
    for i, s in enumerate(segments):
        valid = s.dests[s.dests >= 0]
        sh = int(shard_of[valid[0]]) if valid.size else 0
        for d in np.flatnonzero((shard == sh) & (pp == 0)):
            short[int(d)].append(i)
            load[int(d)] += s.cost
        owners[i] = sh
    replicas = grid.size("cp") * grid.size("tp")
    redundant = sum(s.cost for s in segments) * (replicas - 1)
    lookup = {(int(shard[d]), int(cp[d]), int(tp[d])): int(d) for d in range(D) if pp[d] == 0}

    def source_of(i: int, dst: int) -> int:
        return lookup[(owners[i], int(cp[dst]), int(tp[dst]))]

    return Assignment(short, [[] for _ in range(grid.edp)], load, redundant), source_of


def _stats(segments, assignment, grid, caps, names, reductions, batch, pairs) -> dict[str, float]:
    """Plan figures. Counts (rows, tokens, segments) add up over the plans of one step's microbatches.

    padded_fraction = 1 - (real encoder input rows + real LLM tokens) / (encoder rows the step
    computes + LLM tokens), with computed encoder rows = devices x the capacities actually used."""
    D = grid.num_devices
    cost = assignment.device_cost
    real_rows = sum(s.rows for s in segments)
    computed = sum(D * (caps[f"{n}_short"] + caps[f"{n}_long"]) for n in names)
    seg = np.asarray(batch["segment_ids"])
    llm_real, llm_total = int((seg > 0).sum()), int(seg.size)
    mean = cost.mean() if cost.size else 0.0
    per_encoder = {}
    for n in names:
        per_encoder[f"enc_rows_real_{n}"] = sum(s.rows for s in segments if s.encoder == n)
        per_encoder[f"enc_rows_computed_{n}"] = D * (caps[f"{n}_short"] + caps[f"{n}_long"])
    return {
        "segments": len(segments),
        "long_segments": sum(len(g) for g in assignment.long),
        "short_in_long_segments": sum(len(d) for d in (assignment.long_whole or [])),
        "enc_cost_max_over_mean": float(cost.max() / mean) if mean > 0 else 1.0,
        "enc_rows_real": real_rows,
        "enc_rows_computed": computed,
        **per_encoder,
        "llm_tokens_real": llm_real,
        "llm_tokens_computed": llm_total,
        "redundant_enc_cost": assignment.redundant_cost,
        "padded_fraction": 1.0 - (real_rows + llm_real) / max(computed + llm_total, 1),
        "route_pairs": len(pairs),
        "route_capacity": caps["route"],
    }


# ------------------------------------------------------------------------- LLM-side balancing
def llm_row_costs(batch: dict, coeffs: tuple[float, float]) -> np.ndarray:
    """LLM cost of each packed row: sum over its documents of a·n + b·n² (attention stays inside one)."""
    a, b = coeffs
    seg = np.asarray(batch["segment_ids"])
    out = np.zeros(seg.shape[0])
    for r, row in enumerate(seg):
        n = np.bincount(row[row > 0])
        n = n[n > 0].astype(np.float64)
        out[r] = float((a * n + b * n * n).sum())
    return out


def balance_rows(batch: dict, shards: int, coeffs: tuple[float, float], encoders: tuple[str, ...]) -> dict:
    """Permute the packed rows so every batch shard gets about the same LLM cost (independently of
    where their encoder work runs); each shard keeps B/shards rows. Encoder destinations follow."""
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
    for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions"):
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


def route_traffic(plan: Plan, hosts: int, bytes_per_token: int) -> dict[str, int]:
    """Bytes the resharding all-to-all moves inside a host and between hosts (real tokens only).

    Hosts own contiguous runs of the flattened device order (the outer mesh axes cross hosts, as
    `omnijax.parallel.mesh.make_mesh` lays out multi-host meshes)."""
    recv = plan.arrays["route_recv"]  # [D, D, C], or [D, M, D, C] for one plan per pipeline microbatch
    D = recv.shape[0]
    if D % hosts:
        raise ConfigError(f"{D} devices do not split over {hosts} hosts")
    drop = recv.max()
    counts = (recv != drop).sum(axis=-1)
    if counts.ndim == 3:
        counts = counts.sum(axis=1)              # [dst, src], over the microbatches
    host = np.arange(D) // (D // hosts)
    same = host[:, None] == host[None, :]
    return {"intra_host_bytes": int(counts[same].sum() * bytes_per_token),
            "inter_host_bytes": int(counts[~same].sum() * bytes_per_token),
            "self_bytes": int(np.trace(counts) * bytes_per_token)}


# --------------------------------------------------------------------------- window capacities
def fit_capacities(parts: list[dict], grid: DeviceGrid, reductions: dict[str, int], dims: dict[str, int],
                   cost_fn: Callable[[str, int], float], *, order: Callable[[int, int], np.ndarray],
                   mode: Mode = "balanced", long_short: bool = True, long_factor: float = 1.0,
                   min_rows: int = 16, min_route: int = 8, first_stage_only: bool = False,
                   growth: float = BUCKET_GROWTH) -> dict:
    """Capacities for a window of upcoming plans (`parts`: batches, or their pipeline microbatches)
    that every one of them fits, so the window runs one compiled program.

    "balanced": per encoder the smallest (long, short) pair from the bucket set that holds every part
    (the same search as one plan, over all parts at once: better than the elementwise max of each
    part's own choice); other modes: the elementwise max of each part's capacities. The route
    capacity is the max need of the parts' plans under these buffer capacities."""
    kw = dict(order=order, mode=mode, long_short=long_short, long_factor=long_factor, min_rows=min_rows,
              min_route=min_route, first_stage_only=first_stage_only, growth=growth)
    caps: dict[str, int] = {}
    if mode == "balanced" and parts:
        segs = [segments_of(p, reductions, cost_fn) for p in parts]
        names = sorted({n for p in parts for n in reductions if f"{n}_segment_ids" in p})
        _, caps = _place_balanced(segs, grid, names, long_short, long_factor, {}, min_rows, growth, reductions)
    out = dict(caps)
    for p in parts:
        plan = build_plan(p, grid, reductions, dims, cost_fn, capacities=caps or None, **kw)
        for k, v in plan.capacities:
            out[k] = max(v, out.get(k, 0))
    return out


# ------------------------------------------------------------------- metadata-only entry points
# The plan needs only per-segment metadata (encoder, input rows, cost); these entry points run the
# same placement as `build_plan` without a packed batch, payload buffers or routing tables, so a
# host can plan a step of any size (and `recipes bench scale` can run the planner on abstract grids).
def segments_from_metadata(encoders: list[str], rows: list[int] | np.ndarray, reductions: dict[str, int],
                           cost_fn: Callable[[str, int], float]) -> list[Segment]:
    """Segments of a step from metadata alone: one per (encoder, input rows), in arrival order.

    Starts are the running offsets per encoder (as in a packed `<enc>_inputs`); destinations are
    left empty (the placement does not read them)."""
    if len(encoders) != len(rows):
        raise ConfigError(f"segments_from_metadata: {len(encoders)} encoders for {len(rows)} row counts")
    start: dict[str, int] = {}
    out, empty = [], np.zeros(0, np.int64)
    for name, n in zip(encoders, rows):
        if name not in reductions:
            raise ConfigError(f"segments_from_metadata: unknown encoder {name!r}; "
                              f"known: {', '.join(sorted(reductions))}")
        n, r = int(n), reductions[name]
        if n <= 0 or n % r:
            raise ConfigError(f"segments_from_metadata: {name} segment of {n} rows is not a positive multiple of {r}")
        a = start.get(name, 0)
        out.append(Segment(name, a, n, r, empty, float(cost_fn(name, n))))
        start[name] = a + n
    return out


def place_segments(segments: list[Segment], grid: DeviceGrid, reductions: dict[str, int], *,
                   long_short: bool = True, long_factor: float = 1.0, capacities: dict | None = None,
                   min_rows: int = 16, growth: float = BUCKET_GROWTH) -> tuple[Assignment, dict]:
    """The balanced placement `build_plan(mode="balanced")` makes, from metadata: (assignment, capacities).

    Exactly `_place_balanced` on one part (same capacity search, same tie-breaking), without the
    payload buffers and routing tables that `_materialize` builds."""
    names = sorted({s.encoder for s in segments})
    (assignment,), caps = _place_balanced([segments], grid, names, long_short, long_factor, dict(capacities or {}),
                                          min_rows, growth, reductions)
    return assignment, caps


def lpt_bins(costs: np.ndarray, bins: int, per_bin: int | None = None, sizes: np.ndarray | None = None,
             room: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time first with a heap: (bin of each item, -1 if it fits none; load per bin).

    Items in order (-cost, index), each onto the least-loaded bin with room (ties: lowest bin): at
    most `per_bin` items, and sizes summing to at most `room`, per bin. The greedy of `_lpt`, of
    `balance_rows`' shard assignment and of the data plane's `plan_step` over ranks, in
    O(n log bins) instead of O(n bins), so it runs at tens of thousands of bins."""
    import heapq

    costs = np.asarray(costs, np.float64)
    if bins <= 0:
        raise ConfigError(f"lpt_bins: bins={bins} must be > 0")
    if per_bin is not None and per_bin * bins < costs.size:
        raise ConfigError(f"lpt_bins: {costs.size} items do not fit {bins} bins of {per_bin}")
    size = np.zeros(costs.size) if sizes is None else np.asarray(sizes, np.float64)
    cap = math.inf if room is None else float(room)
    order = np.lexsort((np.arange(costs.size), -costs))
    heap = [(0.0, b) for b in range(bins)]
    count = np.zeros(bins, np.int64)
    used = np.zeros(bins)
    out = np.full(costs.size, -1, np.int64)
    for i in order.tolist():
        held = []
        while heap:
            load, b = heapq.heappop(heap)
            if used[b] + size[i] <= cap:
                out[i] = b
                count[b] += 1
                used[b] += size[i]
                if per_bin is None or count[b] < per_bin:
                    heapq.heappush(heap, (load + float(costs[i]), b))
                break
            held.append((load, b))
        for h in held:
            heapq.heappush(heap, h)
    ok = out >= 0
    loads = np.bincount(out[ok], weights=costs[ok], minlength=bins) if ok.any() else np.zeros(bins)
    return out, loads


def row_costs_from_lengths(lengths: list[list[int]], coeffs: tuple[float, float]) -> np.ndarray:
    """LLM cost of each packed row from its documents' token counts (`llm_row_costs` without a batch)."""
    a, b = coeffs
    out = np.zeros(len(lengths))
    for r, docs in enumerate(lengths):
        n = np.asarray(docs, np.float64)
        out[r] = float((a * n + b * n * n).sum())
    return out


def shard_rows(row_costs: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """`balance_rows`' assignment of packed rows to batch shards from their LLM costs alone:
    (shard of each row, LLM cost per shard); each shard gets B/shards rows."""
    B = len(row_costs)
    if shards <= 0 or B % shards:
        raise ConfigError(f"{B} rows do not split over {shards} batch shards")
    return lpt_bins(row_costs, shards, B // shards)


def lpt_rounds(costs: np.ndarray, bins: int, sizes: np.ndarray | None = None,
               room: float | None = None, head_rounds: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """LPT in rounds, vectorized: (bin of each item, -1 if it fits none; load per bin).

    The `head_rounds * bins` largest items are placed by exact LPT (`lpt_bins`); the rest, sorted by
    (-cost, index), are dealt in rounds to the bins below the final mean load (heavy bins sit out):
    the round's k-th largest item goes to the k-th least-loaded bin (ties: lowest bin). It equals
    `lpt_bins` whenever no bin would take two items of one round, and costs a numpy sort per round
    instead of a Python heap step per item: 10^5 items over 10^4 bins per step on every host.
    With `sizes`/`room`: an item that does not fit its bin goes to the least-loaded bin where it
    fits, if any."""
    costs = np.asarray(costs, np.float64)
    if bins <= 0:
        raise ConfigError(f"lpt_rounds: bins={bins} must be > 0")
    size = np.zeros(costs.size) if sizes is None else np.asarray(sizes, np.float64)
    cap = math.inf if room is None else float(room)
    order = np.lexsort((np.arange(costs.size), -costs))
    load, used = np.zeros(bins), np.zeros(bins)
    out = np.full(costs.size, -1, np.int64)
    head = order[:head_rounds * bins]        # the largest items: exact LPT (a heavy tail needs it)
    if head.size:
        sub, _ = lpt_bins(costs[head], bins, sizes=size[head], room=room)
        out[head] = sub
        ok = sub >= 0
        np.add.at(load, sub[ok], costs[head][ok])
        np.add.at(used, sub[ok], size[head][ok])
    left = float(costs[order[head.size:]].sum())
    lo = head.size
    while lo < order.size:
        # only bins under the final water level take items this round: heavy bins sit rounds out
        level = (load.sum() + left) / bins
        k = max(1, int((load < level).sum()))
        chunk = order[lo:lo + k]
        lo += chunk.size
        left -= float(costs[chunk].sum())
        b = np.argsort(load, kind="stable")[:chunk.size]
        ok = used[b] + size[chunk] <= cap
        out[chunk[ok]] = b[ok]
        load[b[ok]] += costs[chunk[ok]]
        used[b[ok]] += size[chunk[ok]]
        for i in chunk[~ok].tolist():          # its bin is full: the least-loaded bin with room
            fit = np.flatnonzero(used + size[i] <= cap)
            if fit.size:
                j = int(fit[np.argmin(load[fit])])
                out[i] = j
                load[j] += costs[i]
                used[j] += size[i]
    return out, load


def fit_segment_capacities(parts: list[list[Segment]], grid: DeviceGrid, reductions: dict[str, int], *,
                           long_short: bool = True, long_factor: float = 1.0, min_rows: int = 16,
                           growth: float = BUCKET_GROWTH) -> dict:
    """Common encoder capacities for several placements on grids of the same shape (a window's
    batches, or the hosts of one step, each planning its own devices), searched jointly as
    `fit_capacities` does: per encoder the smallest (long, short) pair that every part fits."""
    names = sorted({s.encoder for p in parts for s in p})
    _, caps = _place_balanced(parts, grid, names, long_short, long_factor, {}, min_rows, growth, reductions)
    return caps
