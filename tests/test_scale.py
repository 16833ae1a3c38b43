"""Scale evidence: the metadata-only planner equals the packed-batch planner, the step model takes the
slowest device, and each baseline keeps its defining assumption."""
import numpy as np
import pytest

from omnijax.errors import ConfigError
from omnijax.parallel import context, placement_meta, routing
from omnijax.perfmodel import scale


def _layout(name: str) -> scale.Layout:
    """A recipe's layout as bench scale reads it (no dry run)."""
    from recipes.bench.scale import recipe_layout

    return recipe_layout(name, check=False)[0]


RED = {"vision": 4, "audio": 4}
COSTS = scale.Costs((45.0, 0.0008), {"vision": (3.3, 0.0004), "audio": (0.7, 0.0001)}, RED)


def _packed_batch(encs: list[str], rows: list[int], B: int = 8, L: int = 512) -> dict:
    """A packed global batch holding these encoder segments (in this order, per encoder) with
    destinations in the LLM rows, as the packer lays them out."""
    batch = {"tokens": np.ones((B, L), np.int32), "segment_ids": np.ones((B, L), np.int32)}
    flat = 0
    for name in ("audio", "vision"):
        mine = [n for e, n in zip(encs, rows) if e == name]
        if not mine:
            continue
        total = sum(mine)
        seg = np.zeros(total, np.int32)
        dest = np.full(total // RED[name], -1, np.int32)
        a = 0
        for k, n in enumerate(mine):
            seg[a:a + n] = k % 2 + 1          # alternating ids: adjacent segments stay apart
            t = n // RED[name]
            dest[a // RED[name]:a // RED[name] + t] = np.arange(flat, flat + t) % (B * L)
            flat += t
            a += n
        batch[f"{name}_segment_ids"], batch[f"{name}_dest"] = seg, dest
        batch[f"{name}_inputs"] = np.zeros((total, 3), np.float32)
        batch[f"{name}_positions"] = np.zeros((total, 3), np.int32)
    return batch


def _device_segments(plan: routing.Plan, encs: list[str], grid: routing.DeviceGrid) -> list[set]:
    """Per device, the (encoder, k-th segment of that encoder) pairs in its short / long buffers."""
    order = {}
    for name in ("audio", "vision"):
        ids = [i for i, e in enumerate(encs) if e == name]
        order[name] = ids
    all_sorted = order["audio"] + order["vision"]  # segments_of's order: encoders by name, then buffer order
    out = [set() for _ in range(grid.num_devices)]
    for key, arr in plan.arrays.items():
        if key.endswith("_segment_ids"):
            for d in range(grid.num_devices):
                for sid in np.unique(arr[d][arr[d] > 0]):
                    out[d].add(all_sorted[int(sid) - 1])
    return out


@pytest.mark.parametrize("sizes,esp", [((2, 2, 1, 1, 1, 2), 2), ((1, 1, 1, 8, 1, 1), 1)])
def test_metadata_placement_equals_packed_batch_planner(sizes, esp):
    rng = np.random.default_rng(3)
    encs = list(rng.choice(["vision", "audio"], 40, p=[0.7, 0.3]))
    rows = [int(rng.integers(4, 400)) * 4 for _ in encs]
    grid = routing.DeviceGrid(sizes, esp)
    batch = _packed_batch(encs, rows)
    plan = routing.build_plan(batch, grid, RED, {"vision": 3, "audio": 3}, COSTS.encoder_fn,
                              order=context.balanced_order, mode="balanced", long_short=esp > 1)
    # the metadata path: segments in segments_of's order (encoders by name, arrival within each)
    order = [i for i, e in enumerate(encs) if e == "audio"] + [i for i, e in enumerate(encs) if e == "vision"]
    segs = routing.segments_from_metadata([encs[i] for i in order], [rows[i] for i in order], RED, COSTS.encoder_fn)
    assignment, caps = routing.place_segments(segs, grid, RED, long_short=esp > 1, refine=True)
    plan_caps = {k: v for k, v in plan.capacities if k != "route"}
    assert caps == plan_caps
    meta_dev = [set() for _ in range(grid.num_devices)]
    for d in range(grid.num_devices):
        for i in assignment.short[d] + (assignment.long_whole or [[]] * grid.num_devices)[d]:
            meta_dev[d].add(order[i])
    for g, ids in enumerate(assignment.long):
        for i in ids:
            for k in range(esp):
                meta_dev[g * esp + k].add(order[i])
    assert meta_dev == _device_segments(plan, encs, grid)
    # and the scale driver on one host of this shape reproduces the same device costs
    meta = scale.StepMeta(np.array(encs, object), np.array(rows), np.array([r // 4 + 10 for r in rows]))
    layout = scale.Layout("t", pp=1, tp=sizes[5], ep=sizes[3], esp=esp, rows_per_device=1, row_len=4096)
    hp = scale.plan_step_hosts(meta, layout, 8, COSTS, [0], refine=True)
    np.testing.assert_allclose(np.sort(hp.device_enc[0]), np.sort(assignment.device_cost))
    assert hp.caps[0] == caps


def test_shard_rows_is_balance_rows():
    rng = np.random.default_rng(0)
    B, L, shards = 32, 64, 4
    seg = np.zeros((B, L), np.int32)
    for r in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), rng.integers(0, 4), replace=False))
        for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, L])):
            seg[r, a:b] = k + 1
        seg[r, L - rng.integers(0, 20):] = 0
    tokens = np.arange(B * L).reshape(B, L)        # unique rows, to follow them
    batch = {"tokens": tokens, "segment_ids": seg}
    coeffs = (1.0, 0.05)
    out = routing.balance_rows(batch, shards, coeffs, ())
    shard_of, loads = routing.shard_rows(routing.llm_row_costs(batch, coeffs), shards)
    per = B // shards
    for s in range(shards):
        moved = {int(r[0]) // L for r in out["tokens"][s * per:(s + 1) * per]}
        assert moved == set(np.flatnonzero(shard_of == s).tolist())
    np.testing.assert_allclose(loads, routing.llm_row_costs(out, coeffs).reshape(shards, -1).sum(1))


def test_lpt_rounds_respects_room_and_balances():
    rng = np.random.default_rng(1)
    costs = rng.lognormal(0, 1, 5000)
    sizes = rng.integers(1, 100, 5000)
    room = sizes.sum() / 64 * 1.05
    where, load = routing.lpt_rounds(costs, 64, sizes=sizes, room=room)
    used = np.bincount(where[where >= 0], weights=sizes[where >= 0], minlength=64)
    assert used.max() <= room
    assert (where >= 0).mean() > 0.99
    assert load.max() / load.mean() < 1.02
    exact, exact_load = routing.lpt_bins(costs, 64)
    assert exact_load.max() / exact_load.mean() < 1.02
    with pytest.raises(ConfigError):
        routing.lpt_rounds(costs, 0)


def test_step_is_the_slowest_device_and_cpu_mode_sums():
    enc, route, llm = np.array([1.0, 1.0, 3.0, 1.0]), np.array([0.1, 0.2]), np.array([2.0, 5.0])
    ph = scale.Phases(enc, route, llm, fixed=0.5)
    assert ph.step_s() == pytest.approx(3.0 + 0.2 + 5.0 + 0.5)
    enc2 = enc.copy()
    enc2[0] = 4.0          # one straggler moves the step by exactly its excess over the old max
    assert scale.Phases(enc2, route, llm, 0.5).step_s() == pytest.approx(ph.step_s() + 1.0)
    assert ph.step_s(cpu_mode=True) == pytest.approx(enc.sum() + route.sum() + llm.sum() + 0.5)
    assert scale.Phases(enc, route, llm, 0.5, overlapped=True).step_s() == pytest.approx(5.0 + 0.2 + 0.5)


def test_shared_cores_runs_between_the_sum_and_the_slowest_device():
    """8 fake devices on 2 cores: waiting devices that sleep give the sum over the cores when at least
    2 work, spinning ones give the slowest device times 8/2; the wait cost moves it monotonically."""
    balanced, half, one = [1.0] * 8, [2.0] * 4 + [0.0] * 4, [8.0] + [0.0] * 7
    for w in (balanced, half):
        assert scale.shared_cores_s(w, 2, 0.0) == pytest.approx(sum(w) / 2)
    assert scale.shared_cores_s(one, 2, 0.0) == pytest.approx(8.0)            # one device: one core
    for w in (balanced, half, one):
        assert scale.shared_cores_s(w, 2, 1.0) == pytest.approx(max(w) * 8 / 2)
    walls = [scale.shared_cores_s(half, 2, c) for c in (0.0, 0.25, 0.5, 1.0)]
    assert walls == sorted(walls) and walls[0] < walls[-1]
    assert scale.shared_cores_s(balanced, 2, 0.7) == pytest.approx(4.0)       # nobody waits: no wait cost
    assert scale.shared_cores_s([], 2) == 0.0
    ph = scale.Phases(np.array(half), np.zeros(8), np.array(balanced), fixed=0.5)
    assert ph.step_s(cpu_mode=True, cores=2, wait_cost=0.0) == pytest.approx(4.0 + 4.0 + 0.5)
    assert ph.step_s(cpu_mode=True) == pytest.approx(8.0 + 8.0 + 0.5)      # the plain sum stays as it was


def test_cpu_phases_real_rows_ignore_capacity_and_empty_buffers_cost_what_they_are_told():
    """`real_rows`: a buffer's encoder work is its segments' a·n + b·n² whatever its capacity; by default it
    grows with the capacity. An empty buffer costs nothing unless `CpuConstants.empty` prices it."""
    def plan(cap: int) -> routing.Plan:
        seg = np.zeros((4, cap), np.int32)
        seg[0, :96], seg[0, 96:160] = 1, 2            # device 0: segments of 96 and 64 rows; others empty
        return routing.Plan({"vision_short_segment_ids": seg, "route_send": np.zeros((4, 4, 8), np.int32)})
    batch = {"segment_ids": np.ones((4, 16), np.int32)}
    cpu = scale.CpuConstants({"vision": (1e-3, 1e-6, 0.5)}, (0.0, 0.0, 0.0), 1e9)
    small, big = (scale.plan_phases_cpu(plan(c), batch, 1, 8, cpu, real_rows=True) for c in (256, 1024))
    assert small.enc[0] == pytest.approx(0.5 + 1e-3 * 160 + 1e-6 * (96 ** 2 + 64 ** 2)) == big.enc[0]
    assert np.all(small.enc[1:] == 0)
    by_cap = [scale.plan_phases_cpu(plan(c), batch, 1, 8, cpu).enc[0] for c in (256, 1024)]
    assert by_cap[1] > by_cap[0]
    priced = scale.CpuConstants(cpu.encoders, cpu.llm, cpu.copy_Bps, {"vision": (1e-4, 0.0, 0.01)})
    assert scale.plan_phases_cpu(plan(256), batch, 1, 8, priced, real_rows=True).enc[1] == pytest.approx(0.01 + 256e-4)


def _meta(devices: int, mix: str = "video", seed: int = 0) -> scale.StepMeta:
    return scale.sample_step(scale.MIXES[mix], 0, 2 * devices * 4096 * 9 // 10, np.random.default_rng(seed))


def test_coupled_puts_all_encoder_time_on_stage0_split_over_tp():
    layout, devices = _layout("omni_8b"), 64
    model = scale.StepModel(scale.HARDWARE["h100"], layout)
    meta = _meta(devices)
    grid = layout.grid(devices)
    stage0 = grid.axis("pp") == 0
    total = model.compute_s(COSTS.encoder_cost(meta.encoder, meta.enc_rows)).sum()
    coupled = scale.coupled_phases(meta, layout, devices, COSTS, model, 0.0)
    assert np.all(coupled.enc[~stage0] == 0) and coupled.enc[stage0].sum() == pytest.approx(total)
    replicated = scale.coupled_phases(meta, layout, devices, COSTS, model, 0.0, replicate=True)
    assert replicated.enc[stage0].sum() == pytest.approx(total * layout.tp * layout.cp)
    assert replicated.step_s() > coupled.step_s()


def test_disaggregated_and_global_lpt_assumptions():
    layout, devices = _layout("omni_8b"), 128
    model = scale.StepModel(scale.HARDWARE["h100"], layout)
    meta = _meta(devices, seed=2)
    ph, n_enc = scale.disaggregated_phases(meta, layout, devices, COSTS, model, 0.25)
    assert n_enc == 32 and len(ph.enc) == n_enc and len(ph.llm) == devices - n_enc and ph.overlapped
    assert ph.step_s() == pytest.approx(max(ph.enc.max(), ph.llm.max()) + ph.route.max() + ph.fixed)
    g, gather_s, greedy_s = scale.global_lpt_phases(meta, layout, devices, COSTS, model, 0.0)
    assert gather_s > 0 and g.fixed == pytest.approx(gather_s + greedy_s)
    biggest = model.compute_s(COSTS.encoder_cost(meta.encoder, meta.enc_rows)).max()
    assert g.enc.max() >= biggest - 1e-12     # a segment is indivisible without sequence parallelism


def test_scaling_row_keys_and_weak_scaling():
    layout = _layout("omni_moe")
    model = scale.StepModel(scale.HARDWARE["h100"], layout)
    row = scale.scaling_row(layout, 64, scale.MIXES["image"], COSTS, model, steps=1)
    for key in ("variant", "devices", "mix", "plan_s_per_host", "enc_cost_max_over_mean", "llm_cost_max_over_mean",
                "padded_fraction", "inter_host_bytes_fraction", "modeled_step_s", "speedup_vs_coupled",
                "speedup_vs_replicated", "speedup_vs_disaggregated", "speedup_vs_global_lpt"):
        assert key in row
    assert row["llm_tokens_per_device"] == pytest.approx(2 * 4096 * 0.95, rel=0.02)
    assert 0 <= row["padded_fraction"] < 1 and row["enc_cost_max_over_mean"] >= row["enc_cost_bound"] >= 1
    # the ideal step (encoders spread evenly, no padding or all-to-all, balanced rows) bounds omnijax's gain
    assert row["speedup_vs_coupled_bound"] >= row["speedup_vs_coupled"] - 1e-3
    assert 0 < row["coupled_encoder_share"] < 1


def test_bad_input_is_one_line_config_error():
    with pytest.raises(ConfigError):
        routing.segments_from_metadata(["vision"], [6], RED, COSTS.encoder_fn)   # not a multiple of 4
    with pytest.raises(ConfigError):
        routing.segments_from_metadata(["pixels"], [8], RED, COSTS.encoder_fn)
    with pytest.raises(ConfigError):
        _layout("omni_8b").grid(100)
    with pytest.raises(ConfigError):
        scale.sample_step(scale.Mix("bad", ({"smell": 1.0},)), 0, 1000, np.random.default_rng(0))


def test_visited_blocks_follows_blockwise_skipping():
    assert scale.visited_blocks(np.ones(256, np.int32)) == 4            # one segment over 2 blocks: 2 x 2
    two = np.concatenate([np.full(128, 1), np.full(128, 2)])
    assert scale.visited_blocks(two) == 2                               # two segments, one block each
    # flash.visible_blocks is conservative about padding (id 0): padding blocks visit each other
    assert scale.visited_blocks(np.zeros(512, np.int32)) == 16
    tail = np.concatenate([np.full(128, 1), np.zeros(128, np.int32)])
    assert scale.visited_blocks(tail) == 2                              # the padding tail: only itself


def _placed_once_within(a: routing.Assignment, segs: list, grid: routing.DeviceGrid, caps: dict) -> None:
    ids = sorted(i for lst in (*a.short, *a.long, *a.long_whole) for i in lst)
    assert ids == list(range(len(segs)))
    names = sorted({s.encoder for s in segs})
    short, long = placement_meta._rows_used(a, segs, grid, names)
    for n in names:
        assert short[n].max() <= caps.get(f"{n}_short", 0) and long[n].max() <= caps.get(f"{n}_long", 0)


def test_refine_splits_segments_that_block_each_other():
    # one host, esp8 (the whole host one SP group): nine audio segments split over it and two short
    # ones whole on devices 0 and 1 (what the greedy leaves when short buffers are 0 rows): splitting
    # either alone lifts the other device above the max, so only the two splits together balance it
    grid = routing.DeviceGrid((1, 1, 1, 8, 1, 1), 8)
    rows = [3000, 1144, 1040, 856, 628, 1352, 600, 772, 1764, 364, 320]
    segs = routing.segments_from_metadata(["audio"] * len(rows), rows, RED, COSTS.encoder_fn)
    caps = {"audio_long": 1816, "audio_short": 0}
    a = routing.Assignment([[] for _ in range(8)], [list(range(9))], np.zeros(8),
                           long_whole=[[9], [10], [], [], [], [], [], []])
    _placed_once_within(a, segs, grid, caps)
    cost = np.array([s.cost for s in segs])
    before = np.full(8, cost[:9].sum() / 8)
    before[:2] += cost[9:]
    assert before.max() / before.mean() > 1.05
    b = placement_meta.refine_assignment(a, segs, grid, caps)
    _placed_once_within(b, segs, grid, caps)
    assert b.device_cost.max() / b.device_cost.mean() == pytest.approx(1.0)
    np.testing.assert_allclose(b.device_cost.sum(), cost.sum())


def test_refine_splits_two_whole_segments_together():
    # each whole segment alone does not fit split: its chunks overflow the other one's device (long
    # buffers of 1,816 rows: 1,448 of chunks + 348 / + 328 whole); split together they free that room
    grid = routing.DeviceGrid((1, 1, 1, 8, 1, 1), 8)
    rows = [2984, 1768, 1408, 1196, 1072, 884, 880, 632, 632, 348, 328]
    segs = routing.segments_from_metadata(["audio"] * len(rows), rows, RED, COSTS.encoder_fn)
    caps = {"audio_long": 1816, "audio_short": 0}
    a = routing.Assignment([[] for _ in range(8)], [list(range(9))], np.zeros(8),
                           long_whole=[[9], [10], [], [], [], [], [], []])
    _placed_once_within(a, segs, grid, caps)
    b = placement_meta.refine_assignment(a, segs, grid, caps)
    _placed_once_within(b, segs, grid, caps)
    assert sorted(b.long[0]) == list(range(11))
    assert b.device_cost.max() / b.device_cost.mean() == pytest.approx(1.0)


def _tight_host(seed: int = 21):
    """One omni_8b host (fsdp2 x tp4, esp4): two long clips and 40 small images, whose smallest
    capacities leave the greedy 26% above the mean and no room to move cost."""
    rng = np.random.default_rng(seed)
    rows = [int(x) * 4 for x in np.concatenate([rng.integers(2500, 4000, 2), rng.integers(100, 700, 40)])]
    grid = routing.DeviceGrid((1, 1, 2, 1, 1, 4), 4)
    return grid, routing.segments_from_metadata(["vision"] * len(rows), rows, RED, COSTS.encoder_fn)


def test_refine_never_raises_the_max_and_keeps_capacities():
    grid, segs = _tight_host()
    caps = routing.fit_segment_capacities([segs], grid, RED, long_factor=0.25)
    a, c = routing.place_segments(segs, grid, RED, capacities=caps, long_factor=0.25)
    b = placement_meta.refine_assignment(a, segs, grid, c)
    _placed_once_within(b, segs, grid, c)
    assert b.device_cost.max() <= a.device_cost.max()
    np.testing.assert_allclose(b.device_cost.sum(), a.device_cost.sum())


def test_balanced_capacities_grow_a_bucket_when_balance_needs_room():
    grid, segs = _tight_host()
    g = 1.25  # coarse buckets: the tight host's smallest capacities leave balance no room
    mean = sum(s.cost for s in segs) / grid.num_devices
    base = routing.fit_segment_capacities([segs], grid, RED, long_factor=0.25, growth=g)
    a, c = routing.place_segments(segs, grid, RED, capacities=base, long_factor=0.25, growth=g)
    tight = placement_meta.refine_assignment(a, segs, grid, c).device_cost.max() / mean
    assert tight > 1.2
    caps, (score,) = scale.fit_balanced_capacities([segs], grid, RED, mean, long_factor=0.25,
                                                            pad_cost=COSTS.padding_cost, growth=g)
    assert all(caps[k] >= v for k, v in base.items()) and caps != base
    assert score < 1.05
    a2, _ = routing.place_segments(segs, grid, RED, capacities=caps, long_factor=0.25, growth=g)
    refined = placement_meta.refine_assignment(a2, segs, grid, caps)
    _placed_once_within(refined, segs, grid, caps)
    assert refined.device_cost.max() / mean == pytest.approx(score)
    # padding priced above the gain: the smallest capacities stay
    same, _ = scale.fit_balanced_capacities([segs], grid, RED, mean, long_factor=0.25,
                                                     pad_cost=lambda n, r: 1e3 * mean * r, growth=g)
    assert same == base


def test_bench_rows_take_their_layout_from_the_recipe():
    from recipes.bench.scale import recipe_layout

    moe, _ = recipe_layout("omni_moe", check=False)   # fsdp16xep4, encoders edp16xesp4 (recipes/configs/omni_moe.yaml)
    assert (moe.pp, moe.tp, moe.ep, moe.cp, moe.esp) == (1, 1, 4, 1, 4) and moe.moe_layers == 24
    assert moe.host_grid().esp_axes() == ("ep",)  # the SP groups sit inside a host
    ablation, _ = recipe_layout("omni_moe_edp64", check=False)
    assert ablation.esp == 1 and (ablation.ep, ablation.rows_per_device) == (4, moe.rows_per_device)
    dense, _ = recipe_layout("omni_8b", check=False)  # pp2 x fsdp8 x tp4, encoders edp16 x esp4, 128 rows of 4096
    assert [getattr(dense, k) for k in ("pp", "tp", "ep", "cp", "esp", "microbatches", "rows_per_device", "row_len")] \
        == [2, 4, 1, 1, 4, 8, 2.0, 4096]


def test_bounded_fit_recovers_terms_and_resists_a_slow_long_span():
    from recipes.bench.scale import fit_bounded

    ns = np.array([64, 128, 256, 512, 1024, 2048], np.float64)
    a, b, c = 2e-6, 3e-10, 1e-3
    t = c + a * ns + b * ns ** 2
    got = fit_bounded(ns, t)
    assert np.allclose(got, (a, b, c), rtol=1e-3)
    noisy = t.copy()
    noisy[-1] *= 3.0            # one burst of load on the longest span
    fa, fb, fc = fit_bounded(ns, noisy)
    assert fa > 0.5 * a and fc > 0.5 * c and min(fa, fb, fc) >= 0   # the linear and constant terms survive


def test_interleaved_timings_time_every_point_each_round_in_shuffled_order():
    from recipes.bench.scale import interleaved_timings

    calls = []

    def fn(c):
        return lambda n: calls.append((c, n)) or float(n)

    out = interleaved_timings({"x": fn("x"), "y": fn("y")}, {"x": [1, 2, 3], "y": [4, 5]}, rounds=4)
    assert out["x"].shape == (4, 3) and np.all(out["x"] == [1, 2, 3]) and np.all(out["y"] == [4, 5])
    assert calls[:5] == [("x", 1), ("x", 2), ("x", 3), ("y", 4), ("y", 5)]      # one warm-up call each
    rounds = [calls[5 + 5 * r:10 + 5 * r] for r in range(4)]
    assert all(sorted(r) == sorted(calls[:5]) for r in rounds) and len({tuple(r) for r in rounds}) > 1
