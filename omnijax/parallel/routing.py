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
from typing import Callable, Literal

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
    """Which device encodes what: `short[d]` = segment indices encoded whole on device d, `long[g]` =
    segments sharded over esp group g; `device_cost` = encoder cost per device; `redundant_cost` =
    cost spent on replicas (coupled baseline)."""

    short: list[list[int]]
    long: list[list[int]]
    device_cost: np.ndarray
    redundant_cost: float = 0.0


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


# -------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    """Per-device arrays (leading axis = device, flattened LLM mesh order) plus statistics."""

    arrays: dict[str, np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)
    capacities: tuple = ()


BUCKET_GROWTH = 1.25  # geometric bucket steps: at most ~20% padding from rounding, few distinct shapes


def _bucket(need: int, multiple: int, smallest: int) -> int:
    """Smallest capacity of the geometric set smallest * 1.25^k (rounded up to `multiple`) >= need."""
    c = math.ceil(max(multiple, smallest) / multiple) * multiple
    while c < need:
        c = math.ceil(c * BUCKET_GROWTH / multiple) * multiple
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
               first_stage_only: bool = False) -> Plan:
    """Encoder buffers per device and the routing tables of the encoder -> LLM all-to-all.

    Arrays (leading axis D = devices): `<enc>_short_{inputs,segment_ids,positions}` [D, Ns, ...],
    `<enc>_long_{...}` [D, Nl, ...], `route_send` [D, D, C] (local output row or the pad row),
    `route_recv` [D, D, C] (local flat LLM index or the drop index). Capacities come from
    geometric buckets (`_bucket`), or `capacities` to pin them. `first_stage_only` routes outputs to
    the pp=0 replicas only (the pipeline's input stage), for plans executed inside the pipeline.
    """
    D = grid.num_devices
    tokens = np.asarray(batch["tokens"])
    B, L = tokens.shape
    shard_of, cp_of, local_of = llm_geometry(B, L, grid, order)
    receivers = grid.receivers(first_stage_only)
    segments = segments_of(batch, reductions, cost_fn)
    names = sorted(n for n in reductions if f"{n}_segment_ids" in batch)

    if mode == "coupled":
        assignment, source_of = _coupled(segments, grid, shard_of)
    else:
        assignment = assign(segments, grid, mode, long_short, long_factor)
        source_of = None

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
    caps = dict(capacities or {})
    for n in names:
        r = reductions[n]
        need_s = max(sum(segments[i].rows for i in seg_rows[n][d]) for d in range(D))
        need_l = max(sum(hi - lo for _, lo, hi in long_rows[n][d]) for d in range(D))
        caps.setdefault(f"{n}_short", _bucket(need_s, r, min_rows))
        caps.setdefault(f"{n}_long", _bucket(need_l, r, min_rows) if (long_short and grid.esp > 1) else 0)
        if need_s > caps[f"{n}_short"] or need_l > caps[f"{n}_long"]:
            raise ConfigError(f"pinned capacity for {n} is too small: needs {need_s} short / {need_l} long rows")

    arrays: dict[str, np.ndarray] = {}
    out_row: dict[tuple[int, int, int], int] = {}  # (segment, token j, device) -> local output row there
    holder: dict[tuple[int, int], int] = {}    # (segment, token j) -> device (decoupled)
    offset = 0
    for n in names:
        r = reductions[n]
        x = np.asarray(batch[f"{n}_inputs"])
        pos = np.asarray(batch[f"{n}_positions"])
        for part, rows_of in (("short", seg_rows[n]), ("long", long_rows[n])):
            cap = caps[f"{n}_{part}"]
            inp = np.zeros((D, cap, dims[n]), np.float32)
            sid = np.zeros((D, cap), np.int32)
            ppos = np.zeros((D, cap, 3), np.int32)
            for d in range(D):
                used = 0
                for item in rows_of[d]:
                    i, lo, hi = (item, 0, segments[item].rows) if part == "short" else item
                    s = segments[i]
                    m = hi - lo
                    inp[d, used:used + m] = x[s.start + lo:s.start + hi]
                    ppos[d, used:used + m] = pos[s.start + lo:s.start + hi]
                    sid[d, used:used + m] = i + 1  # unique per segment across devices (esp groups gather)
                    for j in range(lo // r, hi // r):
                        out_row[(i, j, d)] = offset + used // r + (j - lo // r)
                        holder.setdefault((i, j), d)
                    used += m
            arrays[f"{n}_{part}_inputs"], arrays[f"{n}_{part}_segment_ids"] = inp, sid
            arrays[f"{n}_{part}_positions"] = ppos
            offset += cap // r
    pad_row = offset  # the executor appends one zero row after all outputs

    # --- routing: every output token to every replica holding its LLM position
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, s in enumerate(segments):
        for j, f in enumerate(s.dests):
            if f < 0:
                continue
            blk = (int(shard_of[f]), int(cp_of[f]))
            for dst in receivers[blk]:
                src = holder[(i, j)] if source_of is None else source_of(i, int(dst))
                pairs.setdefault((src, int(dst)), []).append((out_row[(i, j, src)], int(local_of[f])))
    need = max((len(v) for v in pairs.values()), default=0)
    C = caps.setdefault("route", _bucket(need, 1, min_route))
    if need > C:
        raise ConfigError(f"pinned route capacity {C} is too small: a device pair exchanges {need} tokens")
    drop = (B // grid.batch_shards) * (L // grid.size("cp"))
    send = np.full((D, D, C), pad_row, np.int32)
    recv = np.full((D, D, C), drop, np.int32)
    for (src, dst), items in sorted(pairs.items()):
        rows = np.array(items, np.int64)
        send[src, dst, :len(items)] = rows[:, 0]
        recv[dst, src, :len(items)] = rows[:, 1]
    arrays["route_send"], arrays["route_recv"] = send, recv

    stats = _stats(segments, assignment, grid, caps, names, reductions, batch, pairs)
    return Plan(arrays, stats, tuple(sorted(caps.items())))


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
    D = grid.num_devices
    cost = assignment.device_cost
    real_rows = sum(s.rows for s in segments)
    computed = sum(D * (caps[f"{n}_short"] + caps[f"{n}_long"]) for n in names)
    seg = np.asarray(batch["segment_ids"])
    llm_real, llm_total = int((seg > 0).sum()), int(seg.size)
    mean = cost.mean() if cost.size else 0.0
    return {
        "segments": len(segments),
        "long_segments": sum(len(g) for g in assignment.long),
        "enc_cost_max_over_mean": float(cost.max() / mean) if mean > 0 else 1.0,
        "enc_rows_real": real_rows,
        "enc_rows_computed": computed,
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
    order = np.array([r for s in range(shards) for r in slots[s]], np.int64)   # new row i <- old row order[i]
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


def shard_cost_max_over_mean(batch: dict, shards: int, coeffs: tuple[float, float]) -> float:
    cost = llm_row_costs(batch, coeffs).reshape(shards, -1).sum(axis=1)
    return float(cost.max() / cost.mean()) if cost.mean() > 0 else 1.0


def route_traffic(plan: Plan, hosts: int, bytes_per_token: int) -> dict[str, int]:
    """Bytes the resharding all-to-all moves inside a host and between hosts (real tokens only).

    Hosts own contiguous runs of the flattened device order (the outer mesh axes cross hosts, as
    `omnijax.parallel.mesh.make_mesh` lays out multi-host meshes)."""
    recv = plan.arrays["route_recv"]
    D = recv.shape[0]
    if D % hosts:
        raise ConfigError(f"{D} devices do not split over {hosts} hosts")
    drop = recv.max()
    counts = (recv != drop).sum(axis=2)          # [dst, src]
    host = np.arange(D) // (D // hosts)
    same = host[:, None] == host[None, :]
    return {"intra_host_bytes": int(counts[same].sum() * bytes_per_token),
            "inter_host_bytes": int(counts[~same].sum() * bytes_per_token),
            "self_bytes": int(np.trace(counts) * bytes_per_token)}
