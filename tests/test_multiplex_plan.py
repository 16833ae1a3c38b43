"""The multiplexing plan (pure numpy): every encoder output token reaches every device holding its
LLM position exactly once, capacities hold, plans are deterministic, and balancing spreads work.

Expectations are derived here, not with the library's geometry: which devices hold an LLM position
follows from the mesh written out by hand (row-major over pp, dp, fsdp, ep, cp, tp; a batch shard is
(dp, fsdp, ep); cp rank i stores chunks i and 2cp-1-i of every row), and a few small cases are literal."""
import itertools
from collections import Counter

import numpy as np
from hypothesis import given, settings, strategies as st

from omnijax.parallel import routing
from omnijax.parallel.context import balanced_order

LAYOUTS = [(1, 8, 1, 1, 1, 1), (2, 2, 1, 1, 1, 2), (1, 1, 4, 1, 2, 1), (1, 2, 1, 2, 1, 2), (2, 1, 2, 1, 2, 1),
           (1, 2, 1, 1, 2, 2), (1, 1, 1, 1, 1, 8)]
RED = {"vision": 4, "audio": 2}
DIMS = {"vision": 3, "audio": 2}


def synthetic_batch(rng, B, L, n_segments):
    """Segments with random sizes; input column 0 holds the global row index (a token's identity)."""
    tokens = np.zeros((B, L), np.int32)
    free = rng.permutation(B * L)
    batch = {"tokens": tokens, "segment_ids": np.ones((B, L), np.int32)}
    taken = 0
    for name, r in RED.items():
        sizes = [int(rng.integers(1, 6)) * r for _ in range(n_segments)]
        n = sum(sizes)
        seg = np.repeat(np.arange(1, n_segments + 1), sizes).astype(np.int32)
        k = n // r
        dest = free[taken:taken + k].astype(np.int32)
        taken += k
        cap = n + 2 * r  # some padding at the end
        batch[f"{name}_inputs"] = np.zeros((cap, DIMS[name]), np.float32)
        batch[f"{name}_inputs"][:, 0] = np.arange(cap)
        batch[f"{name}_segment_ids"] = np.concatenate([seg, np.zeros(cap - n, np.int32)])
        batch[f"{name}_positions"] = np.zeros((cap, 3), np.int32)
        batch[f"{name}_dest"] = np.concatenate([dest, -np.ones((cap - n) // r, np.int32)])
    return batch


def simulate(plan, batch, grid, B, L):
    """Run the plan's send/all-to-all/receive in numpy; return, per device, local index -> (encoder, token)."""
    D = grid.num_devices
    outs = []
    for d in range(D):
        rows = []
        for name in sorted(RED):
            r = RED[name]
            for part in ("short", "long"):
                x = plan.arrays[f"{name}_{part}_inputs"][d]
                seg = plan.arrays[f"{name}_{part}_segment_ids"][d]
                for m in range(x.shape[0] // r):
                    live = seg[m * r] > 0
                    rows.append((name, int(x[m * r, 0]) // r) if live else None)
        rows.append(None)  # the pad row
        outs.append(rows)
    got = [dict() for _ in range(D)]
    send, recv = plan.arrays["route_send"], plan.arrays["route_recv"]
    drop = (B // grid.batch_shards) * (L // grid.size("cp"))
    for src in range(D):
        for dst in range(D):
            for c in range(send.shape[2]):
                item, where = outs[src][send[src, dst, c]], recv[dst, src, c]
                if where == drop:
                    assert item is None
                    continue
                assert item is not None and where not in got[dst], "slot written twice"
                got[dst][int(where)] = item
    return got


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(LAYOUTS),
       st.sampled_from(["balanced", "arrival", "coupled", "coupled_replicated"]),
       st.booleans(), st.integers(1, 9))
def test_every_token_reaches_every_replica_once(seed, sizes, mode, long_short, n_segments):
    rng = np.random.default_rng(seed)
    grid0 = routing.DeviceGrid(sizes)
    B, L = 2 * grid0.batch_shards, 8 * grid0.size("cp")
    batch = synthetic_batch(rng, B, L, n_segments)
    esp = grid0.size("tp") if long_short and grid0.size("tp") > 1 else 1
    grid = routing.DeviceGrid(sizes, esp)
    cost = lambda name, rows: float(rows * rows)  # noqa: E731
    plan = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, mode=mode, long_short=long_short)
    again = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, mode=mode, long_short=long_short)
    for k in plan.arrays:  # deterministic
        np.testing.assert_array_equal(plan.arrays[k], again.arrays[k])
    got = simulate(plan, batch, grid, B, L)
    assert got == _expected(batch, grid, B, L)


def test_balanced_placement_spreads_work_and_coupled_concentrates_it():
    rng = np.random.default_rng(0)
    grid = routing.DeviceGrid((2, 2, 1, 1, 1, 2), esp=2)  # pp2 x dp2 x tp2
    batch = synthetic_batch(rng, 8, 64, 24)
    cost = lambda name, rows: float(rows + 0.05 * rows * rows)  # noqa: E731
    common = dict(order=balanced_order)
    bal = routing.build_plan(batch, grid, RED, DIMS, cost, mode="balanced", **common).stats
    arr = routing.build_plan(batch, grid, RED, DIMS, cost, mode="arrival", long_short=False, **common).stats
    rep = routing.build_plan(batch, grid, RED, DIMS, cost, mode="coupled_replicated", **common).stats
    cpl = routing.build_plan(batch, grid, RED, DIMS, cost, mode="coupled", **common).stats
    assert bal["enc_cost_max_over_mean"] < 1.15 < arr["enc_cost_max_over_mean"]
    # coupled_replicated: only pp=0 devices encode, each twice (tp replicas): max/mean >= 2, work duplicated
    assert rep["enc_cost_max_over_mean"] >= 1.9 and rep["redundant_enc_cost"] > 0
    # coupled: only pp=0 devices encode (half of them here), split over tp: max/mean >= 2, nothing duplicated
    assert cpl["enc_cost_max_over_mean"] >= 1.9 and cpl["redundant_enc_cost"] == 0
    assert bal["redundant_enc_cost"] == 0


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(LAYOUTS), st.integers(1, 9))
def test_coupled_splits_each_shards_segments_over_its_first_stage(seed, sizes, n_segments):
    """Coupled (Megatron-style): every segment on exactly one device, a pp=0 device of the batch shard
    holding its LLM rows; the shard's stage-0 ranks share its work; routes reach every replica."""
    rng = np.random.default_rng(seed)
    grid = routing.DeviceGrid(sizes)
    B, L = 2 * grid.batch_shards, 8 * grid.size("cp")
    batch = synthetic_batch(rng, B, L, n_segments)
    cost = lambda name, rows: float(rows)  # noqa: E731
    plan = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, mode="coupled", long_short=False)
    devices = _devices(sizes)
    dev_shard = np.array([_shard_of(c, sizes) for c in devices])
    pp = np.array([c["pp"] for c in devices])
    owner, busy = [], np.zeros(grid.num_devices, bool)
    for name, r in RED.items():
        seg = plan.arrays[f"{name}_short_segment_ids"]
        assert not (plan.arrays[f"{name}_long_segment_ids"] > 0).any()
        busy |= (seg > 0).any(axis=1)
        holders: dict[int, set] = {}
        first_dest = {}  # plan segment id -> its first routed output token's LLM position (0 if none)
        dest = np.concatenate([batch[f"{name}_dest"], -np.ones(len(batch[f"{name}_inputs"]), np.int64)])
        for d in range(grid.num_devices):
            live = seg[d] > 0
            for i, row in zip(seg[d][live], plan.arrays[f"{name}_short_inputs"][d][live, 0].astype(int)):
                holders.setdefault(int(i), set()).add(d)
                if dest[row // r] >= 0:
                    first_dest.setdefault(int(i), int(dest[row // r]))
        assert len(holders) == n_segments
        for i, devs in holders.items():
            (d,) = devs  # exactly one device
            owner.append(_llm_block(first_dest.get(i, 0), B, L, sizes)[0])
            assert pp[d] == 0 and dev_shard[d] == owner[-1]
    # the shard's work is split: with at least as many segments as ranks, no stage-0 rank idles
    per_shard = np.bincount(owner, minlength=grid.batch_shards)
    for s in range(grid.batch_shards):
        stage0 = np.flatnonzero((dev_shard == s) & (pp == 0))
        assert busy[stage0].sum() == min(len(stage0), per_shard[s])
    assert plan.stats["redundant_enc_cost"] == 0
    got = simulate(plan, batch, grid, B, L)
    assert got == _expected(batch, grid, B, L)


def test_long_segments_are_split_over_an_esp_group():
    rng = np.random.default_rng(1)
    grid = routing.DeviceGrid((1, 4, 1, 1, 1, 2), esp=2)
    batch = synthetic_batch(rng, 8, 16, 3)
    # make one vision segment huge
    cost = lambda name, rows: float(rows) ** 2  # noqa: E731
    plan = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, mode="balanced")
    assert plan.stats["long_segments"] >= 1
    long_rows = (plan.arrays["vision_long_segment_ids"] > 0).sum(axis=1) + (plan.arrays["audio_long_segment_ids"] > 0).sum(axis=1)
    busy = np.flatnonzero(long_rows)
    pairs = {d // 2 for d in busy}
    assert all({2 * g, 2 * g + 1} <= set(busy) for g in pairs)  # both devices of the group hold a chunk


def test_esp_must_match_the_innermost_axes():
    import pytest

    from omnijax.errors import ConfigError

    assert routing.DeviceGrid((1, 2, 1, 1, 1, 2), esp=4).esp_axes() == ("dp", "tp")
    assert routing.DeviceGrid((1, 2, 1, 1, 2, 2), esp=2).esp_axes() == ("tp",)
    with pytest.raises(ConfigError, match="esp=2 must equal the product of the innermost"):
        routing.DeviceGrid((1, 2, 1, 1, 1, 4), esp=2).esp_axes()  # a tp4 group cannot hold esp2 groups
    with pytest.raises(ConfigError, match="edp4 x esp4 = 16 devices, but there are 8"):
        routing.parse_encoder_layout("edp4xesp4", 8)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 4]))
def test_balance_rows_keeps_every_token_and_its_encoder_destination(seed, shards):
    rng = np.random.default_rng(seed)
    B, L = 8, 16
    batch = synthetic_batch(rng, B, L, 4)
    batch["tokens"] = rng.integers(0, 500, (B, L)).astype(np.int32)
    batch["segment_ids"] = np.sort(rng.integers(0, 4, (B, L)), axis=1).astype(np.int32)
    out = routing.balance_rows(batch, shards, (1.0, 0.1), tuple(RED))
    for name in RED:
        old, new = batch[f"{name}_dest"], out[f"{name}_dest"]
        live = old >= 0
        np.testing.assert_array_equal(batch["tokens"].reshape(-1)[old[live]], out["tokens"].reshape(-1)[new[live]])
    assert sorted(map(tuple, out["tokens"])) == sorted(map(tuple, batch["tokens"]))
    rows = np.array([sum(n + 0.1 * n * n for s, n in Counter(row.tolist()).items() if s > 0)
                     for row in out["segment_ids"]])  # a row's cost: a*n + b*n^2 per document
    per_shard = rows.reshape(shards, -1).sum(axis=1)
    assert per_shard.max() <= rows.sum() / shards + rows.max() + 1e-9  # greedy bound: mean + one row


def test_route_traffic_counts_every_delivered_token():
    rng = np.random.default_rng(3)
    grid = routing.DeviceGrid((2, 2, 1, 1, 1, 2), esp=2)  # 2 hosts x 4 devices: pp crosses hosts
    batch = synthetic_batch(rng, 8, 64, 12)
    plan = routing.build_plan(batch, grid, RED, DIMS, lambda n, r: float(r), order=balanced_order)
    t = routing.route_traffic(plan, hosts=2, bytes_per_token=10)
    delivered = sum(int((batch[f"{n}_dest"] >= 0).sum()) for n in RED) * grid.size("pp") * grid.size("tp")
    assert t["intra_host_bytes"] + t["inter_host_bytes"] == 10 * delivered
    assert t["inter_host_bytes"] > 0  # every token goes to both pipeline stages, one per host
    # one plan per pipeline microbatch, stacked on axis 1: the traffic of the step adds up
    other = routing.build_plan(synthetic_batch(rng, 8, 64, 5), grid, RED, DIMS, lambda n, r: float(r),
                               order=balanced_order, capacities=dict(plan.capacities))
    stacked = routing.Plan({"route_recv": np.stack([plan.arrays["route_recv"], other.arrays["route_recv"]], axis=1)})
    both = routing.route_traffic(stacked, hosts=2, bytes_per_token=10)
    t2 = routing.route_traffic(other, hosts=2, bytes_per_token=10)
    assert both == {k: t[k] + t2[k] for k in t}


def test_capacities_only_grow_so_programs_stay_bounded():
    from omnijax.parallel.multiplex import Multiplexer

    mx = Multiplexer.__new__(Multiplexer)  # the planning half only: no mesh or model needed
    mx.grid, mx.reductions, mx.dims = routing.DeviceGrid((1, 4, 1, 1, 1, 2), esp=2), RED, DIMS
    mx.cost_fn, mx.mode, mx.long_short, mx.capacities = (lambda n, r: float(r * r)), "balanced", True, None
    mx.interleave = False  # one plan per step (no pipeline here)
    seen = set()
    for seed in range(12):
        batch = synthetic_batch(np.random.default_rng(seed), 8, 16, 1 + seed % 7)
        plan = mx.plan(batch)
        seen.add(plan.capacities)
        assert all(v >= dict(prev).get(k, 0) for prev in seen for k, v in plan.capacities)
    assert len(seen) <= 6  # a handful of programs for 12 differently shaped steps


def _big_and_small_batch(rng, B=8, L=64):
    """One encoder segment far above a device's share (sharded over an esp group) plus small ones:
    the smallest capacities put small segments into the room its chunks leave in the long buffers."""
    batch = synthetic_batch(rng, B, L, 1)
    name, r = "vision", RED["vision"]
    sizes = [40 * r] + [int(rng.integers(1, 4)) * r for _ in range(10)]
    n = sum(sizes)
    seg = np.repeat(np.arange(1, len(sizes) + 1), sizes).astype(np.int32)
    taken = {int(f) for k in RED if k != name for f in batch[f"{k}_dest"] if f >= 0}
    free = np.array([f for f in rng.permutation(B * L) if f not in taken][:n // r], np.int32)
    batch[f"{name}_inputs"] = np.zeros((n, DIMS[name]), np.float32)
    batch[f"{name}_inputs"][:, 0] = np.arange(n)
    batch[f"{name}_segment_ids"] = seg
    batch[f"{name}_positions"] = np.zeros((n, 3), np.int32)
    batch[f"{name}_dest"] = free
    return batch


def _devices(sizes):
    """Every device's mesh coordinates by name, in flattened (row-major) order over the mesh axes."""
    axes = ("pp", "dp", "fsdp", "ep", "cp", "tp")
    return [dict(zip(axes, c)) for c in itertools.product(*(range(n) for n in sizes))]


def _shard_of(c, sizes):
    """A device's batch shard: its (dp, fsdp, ep) coordinates, row-major."""
    return (c["dp"] * sizes[2] + c["fsdp"]) * sizes[3] + c["ep"]


def _llm_block(f, B, L, sizes):
    """Where global flat LLM position f is stored: (batch shard, cp rank, local flat index).

    Rows split evenly over the batch shards; with cp ranks each row is cut into 2cp chunks and rank i
    stores chunk i then chunk 2cp-1-i (the load-balanced causal layout)."""
    shards, cp = sizes[1] * sizes[2] * sizes[3], sizes[4]
    row, col = divmod(f, L)
    rows_per_shard, per_rank = B // shards, L // cp
    if cp == 1:
        rank, at = 0, col
    else:
        chunk = L // (2 * cp)
        k, within = divmod(col, chunk)
        rank, at = (k, within) if k < cp else (2 * cp - 1 - k, chunk + within)
    return row // rows_per_shard, rank, (row % rows_per_shard) * per_rank + at


def _expected(batch, grid, B, L, first_stage_only=False):
    """Per device: local LLM index -> (encoder, output token) for every routed token, on every device holding
    its block (all pp and tp replicas, or the pp=0 ones only)."""
    sizes = grid.sizes
    devices = _devices(sizes)
    expected = [dict() for _ in devices]
    for name in RED:
        for t, f in enumerate(batch[f"{name}_dest"]):
            if f < 0:
                continue
            shard, rank, local = _llm_block(int(f), B, L, sizes)
            for d, c in enumerate(devices):
                if _shard_of(c, sizes) == shard and c["cp"] == rank and (c["pp"] == 0 or not first_stage_only):
                    expected[d][local] = (name, t)
    return expected


def _one_segment_batch(B, L, dest):
    """One vision segment of one output token per entry of `dest` (its LLM positions); no audio."""
    r = RED["vision"]
    n = r * len(dest)
    batch = {"tokens": np.zeros((B, L), np.int32), "segment_ids": np.ones((B, L), np.int32)}
    batch["vision_inputs"] = np.zeros((n, DIMS["vision"]), np.float32)
    batch["vision_inputs"][:, 0] = np.arange(n)
    batch["vision_segment_ids"] = np.ones(n, np.int32)
    batch["vision_positions"] = np.zeros((n, 3), np.int32)
    batch["vision_dest"] = np.asarray(dest, np.int32)
    for name in RED:
        if name != "vision":
            batch[f"{name}_inputs"] = np.zeros((RED[name], DIMS[name]), np.float32)
            batch[f"{name}_segment_ids"] = np.zeros(RED[name], np.int32)
            batch[f"{name}_positions"] = np.zeros((RED[name], 3), np.int32)
            batch[f"{name}_dest"] = -np.ones(1, np.int32)
    return batch


def test_small_layouts_deliver_to_the_devices_written_out_by_hand():
    """Literal cases: cp2 over a row of 8 (rank 0 stores 0,1,6,7; rank 1 stores 2,3,4,5); pp2 x dp2 (both
    stages of the row's shard receive; with first_stage_only only stage 0); tp2 (both replicas)."""
    cost = lambda name, rows: float(rows)  # noqa: E731
    cases = [  # sizes, B, L, LLM positions of the 3 output tokens, first_stage_only, {device: {local: token}}
        ((1, 1, 1, 1, 2, 1), 1, 8, [6, 3, 0], False, {0: {2: 0, 0: 2}, 1: {1: 1}}),
        ((1, 1, 1, 1, 2, 1), 2, 8, [9, 12, 15], False, {0: {5: 0, 7: 2}, 1: {6: 1}}),
        ((2, 2, 1, 1, 1, 1), 4, 4, [1, 9, 14], False, {0: {1: 0}, 1: {1: 1, 6: 2}, 2: {1: 0}, 3: {1: 1, 6: 2}}),
        ((2, 2, 1, 1, 1, 1), 4, 4, [1, 9, 14], True, {0: {1: 0}, 1: {1: 1, 6: 2}}),
        ((1, 2, 1, 1, 1, 2), 2, 4, [7, 0, 2], False, {0: {0: 1, 2: 2}, 1: {0: 1, 2: 2}, 2: {3: 0}, 3: {3: 0}}),
    ]
    for sizes, B, L, dest, first, want in cases:
        grid = routing.DeviceGrid(sizes)
        batch = _one_segment_batch(B, L, dest)
        plan = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, mode="balanced",
                                  long_short=False, first_stage_only=first)
        got = simulate(plan, batch, grid, B, L)
        assert got == [{k: ("vision", t) for k, t in want.get(d, {}).items()} for d in range(grid.num_devices)], sizes
        assert got == _expected(batch, grid, B, L, first)  # the hand-derived layout agrees with the literals


def test_short_segments_fill_the_room_of_long_buffers_and_still_arrive_once():
    grid = routing.DeviceGrid((1, 4, 1, 1, 1, 2), esp=2)
    cost = lambda name, rows: float(rows) + 0.01 * rows * rows  # noqa: E731
    hits = 0
    for seed in range(6):
        batch = _big_and_small_batch(np.random.default_rng(seed))
        plan = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, mode="balanced")
        caps = dict(plan.capacities)
        hits += plan.stats["short_in_long_segments"] > 0
        assert plan.stats["long_segments"] >= 1
        # capacities hold: every device's rows fit, and no buffer is larger than the largest device needs
        for part in ("short", "long"):
            used = (plan.arrays[f"vision_{part}_segment_ids"] > 0).sum(axis=1)
            assert used.max() <= caps[f"vision_{part}"]
        assert plan.stats["enc_rows_computed_vision"] == 8 * (caps["vision_long"] + caps["vision_short"])
        assert simulate(plan, batch, grid, 8, 64) == _expected(batch, grid, 8, 64)
        # a segment sits in one buffer of one device, or in chunks over exactly one esp group
        ids = set(np.unique(np.concatenate([plan.arrays[f"vision_{p}_segment_ids"].ravel() for p in ("short", "long")])))
        assert len(ids - {0}) == 11
        for i in ids - {0}:
            where = {(d, part) for part in ("short", "long") for d in range(8)
                     if (plan.arrays[f"vision_{part}_segment_ids"][d] == i).any()}
            parts = {p for _, p in where}
            assert len(parts) == 1 and (len(where) == 1 or {d // 2 for d, _ in where} == {min(where)[0] // 2})
    assert hits >= 3  # the placement really uses the long buffers' room for short segments


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(1, 4, 1, 1, 1, 2), (2, 2, 1, 1, 1, 2), (1, 2, 1, 1, 2, 2)]),
       st.booleans(), st.integers(1, 3))
def test_window_capacities_hold_every_plan_of_the_window(seed, sizes, first_stage_only, n):
    rng = np.random.default_rng(seed)
    grid = routing.DeviceGrid(sizes, esp=2)
    B, L = 2 * grid.batch_shards, 8 * grid.size("cp")
    window = [synthetic_batch(rng, B, L, int(rng.integers(1, 9))) for _ in range(n)]
    cost = lambda name, rows: float(rows * rows)  # noqa: E731
    kw = dict(order=balanced_order, mode="balanced", first_stage_only=first_stage_only, growth=1.0625)
    caps = routing.fit_capacities(window, grid, RED, DIMS, cost, **kw)
    own = [dict(routing.build_plan(b, grid, RED, DIMS, cost, **kw).capacities) for b in window]
    for b in window:
        plan = routing.build_plan(b, grid, RED, DIMS, cost, capacities=caps, **kw)
        assert dict(plan.capacities) == caps  # fits without growing: one program for the window
        assert simulate(plan, b, grid, B, L) == _expected(b, grid, B, L, first_stage_only)
    for name in RED:  # the window's buffers are those of its most demanding plan, not more
        total = caps[f"{name}_long"] + caps[f"{name}_short"]
        assert total >= max(c[f"{name}_long"] + c[f"{name}_short"] for c in own)
        assert total <= max(max(c[f"{name}_long"] for c in own) + max(c[f"{name}_short"] for c in own), 1)


def test_pinned_capacities_too_small_raise_and_grown_ones_always_fit():
    import pytest

    from omnijax.errors import ConfigError

    grid = routing.DeviceGrid((1, 4, 1, 1, 1, 2), esp=2)
    cost = lambda name, rows: float(rows)  # noqa: E731
    batch = _big_and_small_batch(np.random.default_rng(7))
    free = dict(routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order).capacities)
    assert free["vision_long"] >= 80  # the 160-row segment is long: 80-row chunks on both devices of a group
    tight = {**free, "vision_long": 76, "vision_short": free["vision_short"] + 400}
    with pytest.raises(ConfigError, match="too small"):
        routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, capacities=tight)
    for extra in (0, 4, 40):  # any capacities at or above the batch's own fit hold it, exactly as pinned
        pinned = {k: v + extra for k, v in free.items()}
        plan = routing.build_plan(batch, grid, RED, DIMS, cost, order=balanced_order, capacities=pinned)
        assert dict(plan.capacities) == pinned
        assert simulate(plan, batch, grid, 8, 64) == _expected(batch, grid, 8, 64)


def test_balance_rows_spreads_encoder_rows_over_pipeline_microbatches():
    """Microbatch j of a pipelined step is rows j, j+M, ...: balance_rows orders each shard's rows so
    that every power-of-two M gets about the same encoder rows per microbatch (to within one row's)."""
    B, L, shards = 16, 64, 2
    for seed in range(5):
        rng = np.random.default_rng(seed)
        batch = {"tokens": np.zeros((B, L), np.int32), "segment_ids": np.ones((B, L), np.int32)}
        per_row = rng.integers(0, 12, B) * (rng.random(B) < 0.7)           # vision tokens per LLM row
        dest = np.concatenate([r * L + np.arange(n) for r, n in enumerate(per_row)]).astype(np.int32)
        batch["vision_dest"] = dest
        out = routing.balance_rows(batch, shards, (1.0, 0.0), ("vision",))
        rows_of = np.bincount(out["vision_dest"] // L, minlength=B)
        np.testing.assert_array_equal(np.sort(rows_of), np.sort(per_row))
        for M in (2, 4):
            mb = np.array([rows_of[m::M].sum() for m in range(M)])
            naive = np.array([per_row[m::M].sum() for m in range(M)])
            assert mb.max() - mb.min() <= per_row.max() * shards, (M, mb, naive)
