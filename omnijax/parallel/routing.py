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

The baselines (`parallel/baselines.py`) place encoder work as trainers that bolt encoders onto the
first pipeline stage do: each batch shard's segments are encoded on the `pp=0` devices of that shard,
in arrival order, either split over its `tp`/`cp` ranks (`coupled`, as Megatron shards its ViT over the
tensor-parallel group) or replicated on each of them (`coupled_replicated`).

Everything here is numpy on the host: the same inputs give the same plan on every host. The parts:
`device_grid` (the devices and the encoder view), `encoder_placement` (segments, LPT placement,
capacity search), `row_balance` (LLM rows over batch shards); this module turns a placement into
buffers and routing tables (`build_plan`) and holds the metadata-only entry points the scale model uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal

import numpy as np

from omnijax.data.payload import Runs, step_rows
from omnijax.errors import ConfigError
from omnijax.parallel import placement_meta
# the planner's parts, re-exported: callers name them as routing.X
from omnijax.parallel.device_grid import MESH_AXES, DeviceGrid, parse_encoder_layout  # noqa: F401
from omnijax.parallel.encoder_placement import (BUCKET_GROWTH, Assignment, Segment, _bucket,  # noqa: F401
                                                _chunks, _place_balanced, assign, segments_of, spread_over_hosts)
from omnijax.parallel.row_balance import (balance_rows, llm_row_costs, row_costs_from_lengths,  # noqa: F401
                                          shard_cost_max_over_mean)

Mode = Literal["balanced", "arrival", "coupled", "coupled_replicated"]


# -------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    """Per-device arrays (leading axis = device, flattened LLM mesh order) plus statistics.

    `devices`: the devices the arrays' leading axis holds, in order (None: all of them). A host that
    plans with `fill_devices` keeps only its own devices' buffers and routing rows, so its memory grows
    with its own devices, not with the cluster's. `device_payload`: input bytes (float32 rows x width)
    each device of the whole step encodes: what its host decodes for it (`host_payload_shares`)."""

    arrays: dict[str, np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)
    capacities: tuple = ()
    devices: tuple[int, ...] | None = None
    device_payload: np.ndarray | None = None


def host_payload_shares(payload: np.ndarray, host_of: np.ndarray) -> np.ndarray:
    """Each host's share of a step's encoder payload bytes (`Plan.device_payload` summed per host;
    `host_of[d]`: the host of device d). Equal shares when the step has no payload."""
    hosts = int(host_of.max()) + 1
    per = np.bincount(host_of, weights=np.asarray(payload, np.float64), minlength=hosts)
    total = per.sum()
    return per / total if total > 0 else np.full(hosts, 1.0 / hosts)


class FlatIndexMap:
    """A function of global flat LLM indices that reads like the array of its values (`m[f]`), computed
    only for the indices asked: no host builds an array of the step's B x L positions."""

    def __init__(self, fn: Callable[[np.ndarray], np.ndarray]):
        self._fn = fn

    def __getitem__(self, f) -> np.ndarray:
        return self._fn(np.asarray(f, np.int64))


def llm_geometry(batch_rows: int, row_len: int, grid: DeviceGrid,
                 order: Callable[[int, int], np.ndarray]) -> tuple[FlatIndexMap, FlatIndexMap, FlatIndexMap]:
    """For global flat LLM indices: (batch shard, cp rank, local flat index in that block), as maps
    indexed like arrays (`shard[f]`).

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
    return (FlatIndexMap(lambda f: f // row_len // b_loc),
            FlatIndexMap(lambda f: stored_at[f % row_len] // l_loc),
            FlatIndexMap(lambda f: (f // row_len % b_loc) * l_loc + stored_at[f % row_len] % l_loc))


def build_plan(batch: dict, grid: DeviceGrid, reductions: dict[str, int], dims: dict[str, int],
               cost_fn: Callable[[str, int], float], *, order: Callable[[int, int], np.ndarray],
               mode: Mode = "balanced", long_short: bool = True, long_factor: float = 1.0,
               min_rows: int = 16, min_route: int = 8, capacities: dict | None = None,
               first_stage_only: bool = False, growth: float = BUCKET_GROWTH,
               fill_devices: Collection[int] | None = None, host_of: np.ndarray | None = None) -> Plan:
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
    the long buffers, cost balanced per device; with `host_of` (the host of every device), whole esp
    groups then move between hosts so that each decodes about its share of the payload
    (`spread_over_hosts`). "arrival" and "coupled" keep their placement and size the buffers to it.
    """
    B, L = step_rows(batch), int(np.shape(batch["tokens"])[1])  # the host's token rows may be only its own
    shard_of, cp_of, local_of = llm_geometry(B, L, grid, order)
    receivers = grid.receivers(first_stage_only)
    segments = segments_of(batch, reductions, cost_fn)
    names = sorted(n for n in reductions if f"{n}_segment_ids" in batch)
    pinned = dict(capacities or {})
    geometry = (shard_of, cp_of, local_of, receivers)

    if mode != "balanced":
        from omnijax.parallel import baselines  # the baselines' placements (coupled, coupled_replicated)

        if mode in baselines.PLACEMENTS:
            assignment, source_of = baselines.place(mode, segments, grid, shard_of)
        else:
            assignment, source_of = assign(segments, grid, mode, long_short, long_factor), None
        return _materialize(batch, grid, reductions, dims, segments, names, assignment, source_of, pinned,
                            geometry, long_short, min_rows, min_route, growth, fill_devices)
    try:
        assignment, caps = _balanced(segments, grid, names, long_short, long_factor, pinned, min_rows, growth,
                                     reductions)
        if host_of is not None:
            assignment = spread_over_hosts(assignment, segments, grid, host_of, dims)
        return _materialize(batch, grid, reductions, dims, segments, names, assignment, None, caps, geometry,
                            long_short, min_rows, min_route, growth, fill_devices)
    except ConfigError:
        if not pinned:
            raise
    # The pinned capacities are too tight for the placement made inside them (a heuristic), or its
    # routes need more than the pinned route capacity: the unpinned placement still fits if its own
    # capacities lie inside the pins (so capacities that grew to cover it always work).
    enc_pins = {k: v for k, v in pinned.items() if k != "route"}
    assignment, caps = _balanced(segments, grid, names, long_short, long_factor, {}, min_rows, growth, reductions)
    if host_of is not None:
        assignment = spread_over_hosts(assignment, segments, grid, host_of, dims)
    too_small = [k for k, v in caps.items() if v > enc_pins.get(k, v)]
    if too_small:
        raise ConfigError(f"pinned capacities too small for this batch: {', '.join(f'{k} needs {caps[k]} > {pinned[k]}' for k in too_small)}")
    return _materialize(batch, grid, reductions, dims, segments, names, assignment, None, {**caps, **pinned},
                        geometry, long_short, min_rows, min_route, growth, fill_devices)


def _balanced(segments, grid, names, long_short, long_factor, pins, min_rows, growth, reductions):
    """Capacity-aware LPT placement, then local moves inside those capacities that lower the most
    loaded device (`placement_meta.refine_assignment`, the pass the scale model runs too)."""
    (assignment,), caps = _place_balanced([segments], grid, names, long_short, long_factor, pins, min_rows, growth,
                                          reductions)
    return placement_meta.refine_assignment(assignment, segments, grid, caps, splittable=long_short), caps


def _materialize(batch, grid, reductions, dims, segments, names, assignment, source_of, caps, geometry,
                 long_short, min_rows, min_route, growth, fill_devices=None) -> Plan:
    """Buffers and routing tables of an assignment; capacities not in `caps` are bucketed to the need."""
    D = grid.num_devices
    shard_of, cp_of, local_of, receivers = geometry
    B, L = step_rows(batch), int(np.shape(batch["tokens"])[1])
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
        pos = batch[f"{n}_positions"]  # sliced per segment too (a step's geometry computes them on demand)
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
    stats.update(pad_row=pad_row, drop_index=drop)  # the tables' fill values (a host group's plan widens with them)
    payload = np.zeros(D)
    for n in names:
        for d in range(D):
            rows = sum(segments[i].rows for i in seg_rows[n][d]) + sum(hi - lo for _, lo, hi in long_rows[n][d])
            payload[d] += 4.0 * dims[n] * rows
    return Plan(arrays, stats, tuple(sorted(caps.items())), None if fill_devices is None else tuple(kept), payload)


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


def _stats(segments, assignment, grid, caps, names, reductions, batch, pairs) -> dict[str, float]:
    """Plan figures. Counts (rows, tokens, segments) add up over the plans of one step's microbatches.

    padded_fraction = 1 - (real encoder input rows + real LLM tokens) / (encoder rows the step
    computes + LLM tokens), with computed encoder rows = devices x the capacities actually used."""
    D = grid.num_devices
    cost = assignment.device_cost
    real_rows = sum(s.rows for s in segments)
    computed = sum(D * (caps[f"{n}_short"] + caps[f"{n}_long"]) for n in names)
    if "row_docs" in batch:  # the step's rows from metadata (this host may hold only its own)
        llm_real, llm_total = int(batch["row_docs"][:, 1].sum()), step_rows(batch) * int(np.shape(batch["tokens"])[1])
    else:
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
        "enc_cost_max": float(cost.max()) if cost.size else 0.0,  # with enc_cost_total: balance across host groups
        "enc_cost_total": float(cost.sum()),
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
                   growth: float = BUCKET_GROWTH, host_of: np.ndarray | None = None) -> dict:
    """Capacities for a window of upcoming plans (`parts`: batches, or their pipeline microbatches)
    that every one of them fits, so the window runs one compiled program.

    "balanced": per encoder the smallest (long, short) pair from the bucket set that holds every part
    (the same search as one plan, over all parts at once: better than the elementwise max of each
    part's own choice); other modes: the elementwise max of each part's capacities. The route
    capacity is the max need of the parts' plans under these buffer capacities."""
    kw = dict(order=order, mode=mode, long_short=long_short, long_factor=long_factor, min_rows=min_rows,
              min_route=min_route, first_stage_only=first_stage_only, growth=growth, host_of=host_of,
              fill_devices=())  # placement only: a window's sizing decodes no payload (put_batch reads each once)
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
                   min_rows: int = 16, growth: float = BUCKET_GROWTH,
                   refine: bool = False) -> tuple[Assignment, dict]:
    """The balanced placement from metadata: (assignment, capacities). With `refine`, exactly what
    `build_plan(mode="balanced")` places (`_balanced`: the capacity-aware LPT, then the second pass);
    without, the first pass alone (callers that run the second pass themselves). No payload buffers
    or routing tables."""
    names = sorted({s.encoder for s in segments})
    if refine:
        return _balanced(segments, grid, names, long_short, long_factor, dict(capacities or {}), min_rows, growth,
                         reductions)
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


# ---------------------------------------------------------------------------- host groups (issue 47)
# The hosts whose devices hold the same LLM batch shards (pipeline stages, tp/cp replicas on different
# hosts) form a host group. Every receiver of a segment's encoder output (the devices of its LLM block,
# `DeviceGrid.receivers`) lies inside the group holding its row, so a group can place the segments of
# its own rows on its own devices and route them there: a plan per group, on the group's sub-grid, with
# no other host's samples or devices looked at. The global all-to-all tables are the group's with pad
# entries towards every other group's devices.
@dataclass(frozen=True)
class HostGroup:
    """One host group: its hosts, the batch shards it holds (sorted), its devices in the order of its
    sub-grid (`devices[k]`: the global device of sub-grid device k) and its hosts' index per sub-grid
    device (renumbered 0.., None for a group of one host)."""

    index: int
    hosts: tuple[int, ...]
    shards: np.ndarray
    grid: DeviceGrid
    devices: np.ndarray
    host_of: np.ndarray | None

    def rows(self, batch_rows: int, batch_shards: int) -> np.ndarray:
        """The global LLM rows of the group's shards (each shard `batch_rows / batch_shards` rows), in order."""
        per = batch_rows // batch_shards
        return (self.shards[:, None] * per + np.arange(per)[None, :]).reshape(-1)


def host_groups(grid: DeviceGrid, host_of: np.ndarray) -> list[HostGroup]:
    """The host groups of `grid` whose device d sits on host `host_of[d]`: hosts linked by a batch shard
    they both hold, ordered by their first shard. Each group's sub-grid is the LLM grid over its shards
    (pp x shards x cp x tp, the batch shards on the fsdp axis), whose flattened order maps onto the
    global device order; its esp groups must be global esp groups (whole inside the group), else a
    ConfigError says so."""
    host_of = np.asarray(host_of, np.int64)
    D = grid.num_devices
    if host_of.shape != (D,):
        raise ConfigError(f"host_of has {host_of.shape} entries for {D} devices")
    shard = grid.batch_shard()
    S, P_, C, T = grid.batch_shards, grid.size("pp"), grid.size("cp"), grid.size("tp")
    parent = list(range(int(host_of.max()) + 1))

    def find(h: int) -> int:
        while parent[h] != h:
            parent[h] = parent[parent[h]]
            h = parent[h]
        return h

    first: dict[int, int] = {}
    for s, h in {(int(a), int(b)) for a, b in zip(shard.tolist(), host_of.tolist())}:
        if s in first:
            parent[find(h)] = find(first[s])
        else:
            first[s] = h
    members: dict[int, list[int]] = {}
    for h in sorted(set(host_of.tolist())):
        members.setdefault(find(h), []).append(h)
    shards_of = {root: np.unique(shard[np.isin(host_of, hs)]) for root, hs in members.items()}
    out = []
    for k, root in enumerate(sorted(members, key=lambda r: int(shards_of[r][0]))):
        shards = shards_of[root]
        sub = DeviceGrid((P_, 1, len(shards), 1, C, T), grid.esp)
        pp, j, cp, tp = np.unravel_index(np.arange(sub.num_devices), (P_, len(shards), C, T))
        devices = np.ravel_multi_index((pp, shards[j], cp, tp), (P_, S, C, T)).astype(np.int64)
        first_dev = devices[::grid.esp]
        if np.any(first_dev % grid.esp) or np.any(devices.reshape(-1, grid.esp) - first_dev[:, None]
                                                 != np.arange(grid.esp)):
            raise ConfigError(f"parallel.encoder: esp={grid.esp} groups cross host group {k} (hosts "
                              f"{members[root][:4]}...): a host group must hold whole esp groups")
        hosts = tuple(members[root])
        local = None
        if len(hosts) > 1:
            local = np.searchsorted(np.asarray(hosts), host_of[devices])
        out.append(HostGroup(k, hosts, shards, sub, devices, local))
    return out


def group_view(batch: dict, group: HostGroup, reductions: dict[str, int], batch_shards: int) -> dict:
    """The part of a step that host group `group` plans, as a batch `build_plan` reads: the group's rows
    (`row_docs`, or `segment_ids` of a whole batch) and only the encoder segments whose outputs land in
    them, their destinations renumbered into the group's rows. Encoder inputs and positions are the
    step's own buffers (segments keep their global starts), so a plan slices only its group's
    segments' payloads. Each segment's destinations must be consecutive positions (one packed row)."""
    B, L = step_rows(batch), int(np.shape(batch["tokens"])[1])
    if B % batch_shards:
        raise ConfigError(f"{B} LLM rows do not split over {batch_shards} batch shards")
    per = B // batch_shards
    rows = group.rows(B, batch_shards)
    local_shard = np.full(batch_shards, -1, np.int64)
    local_shard[group.shards] = np.arange(len(group.shards))
    view: dict = {"tokens": _Shape((len(rows), L))}
    if "row_docs" in batch:
        view["row_docs"] = np.asarray(batch["row_docs"])[rows]
    else:
        view["segment_ids"] = np.asarray(batch["segment_ids"])[rows]
    for seg_name in sorted(reductions):
        if f"{seg_name}_segment_ids" not in batch:
            continue
        segs = segments_of(batch, {seg_name: reductions[seg_name]}, lambda *_: 0.0)
        r = reductions[seg_name]
        keep = []
        for s in segs:
            d = s.dests
            if d.size == 0 or d[0] < 0 or local_shard[d[0] // L // per] < 0:
                continue
            if np.any(d != d[0] + np.arange(d.size)):
                raise ConfigError(f"a {seg_name} segment's output positions are not consecutive: "
                                  "route_local needs each segment inside one packed row")
            f = int(d[0])
            keep.append((s.start, s.rows, (int(local_shard[f // L // per]) * per + f // L % per) * L + f % L))
        n = int(np.shape(batch[f"{seg_name}_segment_ids"])[0])
        starts = np.array([k[0] for k in keep], np.int64)
        lengths = np.array([k[1] for k in keep], np.int64)
        view[f"{seg_name}_segment_ids"] = Runs(n, starts, lengths, np.arange(1, len(keep) + 1))
        view[f"{seg_name}_dest"] = Runs(n // r, starts // r, lengths // r, [k[2] for k in keep], step=1, fill=-1)
        view[f"{seg_name}_inputs"] = batch[f"{seg_name}_inputs"]
        view[f"{seg_name}_positions"] = batch[f"{seg_name}_positions"]
    return view


class _Shape:
    """Stands in for an array of which only the shape is read (a group's token rows: never built)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(shape)


def widen_plan(plan: Plan, group: HostGroup, num_devices: int) -> Plan:
    """A host group's plan (on its sub-grid) in the global device numbering: the arrays' rows are the
    group's filled devices (global indices in `Plan.devices`), the routing tables [rows, D, C] with pad
    entries (send: the pad output row; receive: the drop index) towards every device outside the group,
    the device payload over all D devices (zero outside)."""
    D, dev = num_devices, group.devices
    rows = dev if plan.devices is None else dev[np.asarray(plan.devices, np.int64)]
    arrays = dict(plan.arrays)
    for key in ("route_send", "route_recv"):
        t = plan.arrays[key]
        pad = _pad_value(plan, key)
        wide = np.full((t.shape[0], D, t.shape[2]), pad, t.dtype)
        wide[:, dev] = t
        arrays[key] = wide
    payload = None
    if plan.device_payload is not None:
        payload = np.zeros(D)
        payload[dev] = plan.device_payload
    return Plan(arrays, dict(plan.stats), plan.capacities, tuple(int(d) for d in rows), payload)


def _pad_value(plan: Plan, key: str) -> int:
    """The send table's pad row (after every output row) / the receive table's drop index (one past the
    local block), as `_materialize` fills them."""
    return int(plan.stats["pad_row" if key == "route_send" else "drop_index"])
