"""Mixing, grouped reordering (property tests simulating hosts), packing layout, loader resume and bad data."""
import logging

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnijax.data import balance as B
from omnijax.data import packing, records, tokenizer
from omnijax.data.loader import Loader, LoaderConfig
from omnijax.data.mixing import Mixer, Schedule
from omnijax.data.sample import Sample, Segment, text
from omnijax.data.sources import SourceSpec
from omnijax.errors import ConfigError, UserError


# ---------------------------------------------------------------------------------- mixing
def test_mixing_is_pure_and_follows_the_schedule():
    sched = Schedule(["a", "b"], [{"step": 0, "weights": {"a": 1.0}}, {"step": 100, "weights": {"a": 1, "b": 3}}])
    m1, m2 = Mixer([5, 1000], sched, 7, 16), Mixer([5, 1000], sched, 7, 16)
    # computing step 150 directly or after walking through earlier steps gives the same batch
    for s in range(0, 151, 3):
        m1.batch(s)
    assert all(np.array_equal(x, y) for x, y in zip(m1.batch(150), m2.batch(150)))
    assert m2.index(150 * 16 + 3) == (int(m1.batch(150)[0][3]), int(m1.batch(150)[1][3]))
    counts = m1.counts(np.arange(0, 400))
    assert counts.sum(1).tolist() == [16] * 400 and counts[:1, 1].sum() == 0
    assert abs(counts[200:, 1].mean() / 16 - 0.75) < 0.02
    # source a (5 records) runs out: each epoch uses every record once, in a new order
    draws = np.concatenate([m1.batch(s)[1][m1.batch(s)[0] == 0] for s in range(3)])
    epochs = [draws[i: i + 5] for i in range(0, 30, 5)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    assert not np.array_equal(Mixer([5, 1000], sched, 8, 16).batch(150)[1], m1.batch(150)[1])


def test_schedule_errors():
    with pytest.raises(ConfigError, match="unknown source"):
        Schedule(["a"], {"b": 1.0})
    with pytest.raises(ConfigError, match="increasing"):
        Schedule(["a"], [{"step": 5, "weights": {"a": 1}}, {"step": 2, "weights": {"a": 1}}])
    with pytest.raises(ConfigError, match="positive sum"):
        Schedule(["a"], {"a": 0.0})


# ------------------------------------------------------------------------- balance (hosts)
item_st = st.builds(lambda c, t, e1, e2: (c, t, e1, e2), st.floats(0.0, 1e4, allow_nan=False),
                    st.integers(1, 64), st.integers(0, 300), st.integers(0, 300))


@settings(max_examples=60, deadline=None)
@given(st.lists(item_st, min_size=0, max_size=120), st.integers(1, 4), st.integers(1, 4), st.integers(1, 2),
       st.integers(1, 4), st.integers(0, 2 ** 16))
def test_plans_identical_on_every_host_and_exact(raw, steps, ranks, micro, rows, shuffle_seed):
    cap = B.Capacity(rows, 64, (600, 400))
    items = [B.Item(k, c, t, (e1, e2)) for k, (c, t, e1, e2) in enumerate(raw)]
    # every simulated host sees the window's metadata in its own order (e.g. read by different threads)
    hosts = [np.random.default_rng([shuffle_seed, h]).permutation(len(items)) for h in range(3)]
    plans = [B.plan_window([items[i] for i in order], steps, ranks, micro, cap) for order in hosts]
    assert plans[0] == plans[1] == plans[2]
    plan = plans[0]
    placed = [k for b in plan.bins for k, _ in b]
    assert sorted(placed + list(plan.unplaced)) == list(range(len(items)))  # each exactly once
    assert len(plan.bins) == steps * ranks * micro
    for b in plan.bins:  # nothing over capacity
        assert all(r < rows for _, r in b)
        for r in range(rows):
            assert sum(items[k].tokens for k, rr in b if rr == r) <= cap.row_len
        for e in range(2):
            assert sum(items[k].enc[e] for k, _ in b) <= cap.enc[e]
    # generous capacity: nothing is left out
    roomy = B.Capacity(len(items) + 1, 64, (10 ** 6, 10 ** 6))
    assert B.plan_window(items, steps, ranks, micro, roomy).unplaced == ()


def test_reordering_beats_arrival_order():
    rng = np.random.default_rng(0)
    costs = (rng.pareto(1.5, 16 * 64) + 1) * 10
    items = [B.Item(k, float(c), 8) for k, c in enumerate(costs)]
    cap = B.Capacity(64, 64)

    def arrival_order(step_costs):   # no reordering: a step's samples in arrival order, equal chunks per rank
        loads = np.array([c.sum() for c in np.array_split(step_costs, 8)])
        return loads.max() / loads.mean()

    arrival = np.mean([arrival_order(costs[s * 64:(s + 1) * 64]) for s in range(16)])
    g16 = B.max_over_mean(B.plan_window(items, 16, 8, 1, cap), 16, 8, 1)
    assert g16 < arrival and g16 < 1.2
    assert B.lower_bound(items, 8) >= 1.0


# --------------------------------------------------------------------------------- packing
def test_pack_layout_places_encoder_outputs_on_placeholders():
    from omnijax.data.tokens import default_mm_config
    mm = default_mm_config()
    specs = packing.encoder_specs(mm)
    img = Sample((text("a"), Segment("image", np.random.rand(16, 24, 3).astype(np.float32)), text("ok", loss=True)))
    aud = Sample((Segment("audio", np.random.rand(3000).astype(np.float32) - 0.5), text("7", loss=True)))
    flats = [packing.flatten(s.validate(), mm, specs) for s in (img, aud)]
    layout = packing.Layout(2, 64, (("audio", 64), ("vision", 64)))
    out = packing.pack_bin([(flats[0], 0), (flats[1], 0)], layout, specs)
    tok = out["tokens"].reshape(-1)
    for name, ph in (("vision", tokenizer.IMAGE), ("audio", tokenizer.AUDIO)):
        d = out[f"{name}_dest"]
        assert (tok[d[d >= 0]] == ph).all() and (tok == ph).sum() == (d >= 0).sum()
        seg = out[f"{name}_segment_ids"]
        assert (seg > 0).sum() == (d >= 0).sum() * specs[name].group
    row = out["segment_ids"][0]
    assert set(row[row > 0]) == {1, 2} and out["segment_ids"][1].max() == 0
    # the loss covers exactly the answer tokens ("ok" and "7")
    assert out["loss_mask"].sum() == 3 and (out["targets"][out["loss_mask"] > 0] != tokenizer.PAD).all()
    both = packing.concat([out, out], layout)
    assert both["tokens"].shape == (4, 64) and both["vision_dest"].max() >= 2 * 64
    assert both["vision_segment_ids"].max() == 2 * out["vision_segment_ids"].max()


# ---------------------------------------------------------------------------------- loader
CFG = dict(samples_per_step=16, dp=4, microbatches=2, window=2, row_len=128, max_rows=3)


def _rank_slice(batch, layout, i, name=None):
    rows = layout.rows
    if name is None:
        return {k: batch[k][i * rows:(i + 1) * rows] for k in ("tokens", "targets", "loss_mask", "segment_ids")}
    n = dict(layout.enc)[name]
    return batch[f"{name}_inputs"][i * n:(i + 1) * n]


def test_resume_identical_with_other_host_counts():
    one = Loader(LoaderConfig(**CFG))
    it = iter(one)
    full = [next(it) for _ in range(3)]
    state = one.state()
    after = next(it)
    hosts = [Loader(LoaderConfig(**CFG), ranks=r) for r in ([0, 1], [2, 3])]
    for h in hosts:
        h.restore({**state, "step": 1})
    for step, ref in zip(range(1, 4), full[1:] + [after]):
        parts = [next(iter(h)) for h in hosts]
        for h, part in zip(hosts, parts):
            assert part["step"] == step and part["layout"] == ref["layout"]
            for m in range(CFG["microbatches"]):
                for i, r in enumerate(h.ranks):
                    a, b = _rank_slice(part["microbatches"][m], ref["layout"], i), _rank_slice(ref["microbatches"][m], ref["layout"], r)
                    assert all(np.array_equal(a[k], b[k]) for k in a)
                    assert np.array_equal(_rank_slice(part["microbatches"][m], ref["layout"], i, "vision"),
                                          _rank_slice(ref["microbatches"][m], ref["layout"], r, "vision"))
    assert {k: state[k] for k in ("step", "seed", "schedule", "window")} == {
        "step": 3, "seed": 0, "schedule": one.schedule.fingerprint(), "window": 1}
    with pytest.raises(UserError, match="same data config"):
        Loader(LoaderConfig(**{**CFG, "seed": 1})).restore(state)


def _shard(tmp_path, name, samples):
    path = tmp_path / f"{name}.arrayrecord"
    records.write_shard(path, samples)
    return str(path)


def test_bad_records_skipped_counted_logged_and_overlong(tmp_path, caplog):
    good = [Sample((text("x" * 20), text("ok", loss=True))) for _ in range(6)]
    long_text = Sample((text("y" * 300, loss=True),))  # 300 tokens > row_len 128: split
    big_video = Sample((Segment("video", np.zeros((40, 64, 64, 3), np.float32)), text("a", loss=True)))  # > a row
    wide = Sample((Segment("video", np.zeros((2, 32, 32, 3), np.float32)), text("b", loss=True)))  # 128 vision rows
    path = _shard(tmp_path, "mixed", good + [long_text, big_video, wide])
    # corrupt record 0's payload but keep its sidecar: decoding fails at load time
    raw = records.encode(good[0])
    bad_path = _shard(tmp_path, "bad", good[:3])
    from array_record.python.array_record_module import ArrayRecordWriter
    w = ArrayRecordWriter(bad_path, "group_size:1")
    w.write(raw[:-30])  # truncated
    for s in good[1:3]:
        w.write(records.encode(s))
    w.close()
    cfg = LoaderConfig(sources=[SourceSpec("mixed", path=path), SourceSpec("bad", path=bad_path)],
                       samples_per_step=8, dp=2, window=1, row_len=128, max_rows=4, max_encoder_rows={"vision": 32})
    loader = Loader(cfg)
    caplog.set_level(logging.INFO, logger="omnijax.data")
    for s in range(6):
        loader.host_batch(s)
    m = loader.metrics()
    assert loader.skipped["bad"] > 0 and "skipped bad record bad[0]" in caplog.text
    plans = [loader.window_plan(s) for s in range(6)]
    # media longer than a row: skipped (counted, warned once with the fix); more encoder rows than the
    # step holds (64 = 2 ranks x 32): never dropped, its window plans at a larger bucket
    assert {(name, why.split(" (")[0]) for p in plans for name, _, why in p.dropped} == {("mixed", "longer than a row")}
    assert caplog.text.count("cannot place on any layout") == 1 and "raise data.seq_len to 2561" in caplog.text
    def holds(p, where):
        return any(p.entries[k].record == 8 and loader.names[p.entries[k].source] == "mixed" for k in where(p))
    placed = [p for p in plans if holds(p, lambda p: [k for b in p.plan.bins for k, _ in b])]
    vision = [dict(zip(loader.enc_names, p.encoder_rows))["vision"] for p in plans]
    assert placed and vision == [128 if holds(p, lambda p: range(len(p.entries))) else 64 for p in plans]
    assert sum(p.split for p in plans) > 0 and m["distinct_shapes"] >= 1
    assert loader.metrics()["dropped_total"] == sum(len(p.dropped) for p in plans) > 0
    assert loader.metrics()["split_total"] == sum(p.split for p in plans)
    with pytest.raises(UserError, match="missing ArrayRecord shard: .*nope.arrayrecord"):
        Loader(LoaderConfig(sources=[SourceSpec("x", path=str(tmp_path / "nope.arrayrecord"))]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(1, 9), st.integers(0, 1000),
       st.lists(st.floats(0.1, 5.0), min_size=4, max_size=4))
def test_mixer_epochs_cover_every_record_once(sizes, batch, seed, w):
    names = [f"s{k}" for k in range(len(sizes))]
    mixer = Mixer(sizes, Schedule(names, {n: w[k] for k, n in enumerate(names)}), seed, batch)
    seq: dict[int, list[int]] = {k: [] for k in range(len(sizes))}
    for step in range(40):
        src, rec = mixer.batch(step)
        order = np.argsort(src, kind="stable")  # within a step, a source's draws are in slot order
        for slot in order:
            seq[int(src[slot])].append(int(rec[slot]))
    for k, n in enumerate(sizes):
        full = len(seq[k]) // n * n
        for e in range(0, full, n):
            assert sorted(seq[k][e: e + n]) == list(range(n))


def test_tp_peers_share_one_dp_rank_load():
    # 4 local devices laid out dp2 x tp2 hold dp ranks [2, 2, 3, 3]: each rank is read once for both tp devices
    ranks = [2, 3]
    loader = Loader(LoaderConfig(**CFG), ranks=ranks)
    calls = []
    original = loader._load
    loader._load = lambda e: calls.append(e) or original(e)
    batch = loader.host_batch(0)
    planned = [k for m in range(CFG["microbatches"]) for r in ranks
               for k, _ in loader.window_plan(0).plan.bins[(0 * CFG["dp"] + r) * CFG["microbatches"] + m]]
    assert len(calls) == len(planned) == len(set(planned))  # each planned sample of these ranks read once
    assert batch["microbatches"][0]["tokens"].shape[0] == 2 * batch["layout"].rows
    for bad in ([], [2, 2, 3, 3], [-1], [CFG["dp"]]):  # one entry per rank, each in [0, dp)
        with pytest.raises(ConfigError, match="must be distinct dp ranks"):
            Loader(LoaderConfig(**CFG), ranks=bad)


# --------------------------------------------------------------------- deferred, never dropped
TIGHT = dict(samples_per_step=24, dp=2, microbatches=1, window=2, row_len=128, max_rows=2)


def _placed(wp):
    return [(wp.entries[k].source, wp.entries[k].record, wp.entries[k].piece) for b in wp.plan.bins for k, _ in b]


def test_samples_with_no_room_are_deferred_not_dropped():
    """Drawing more than fits: every drawn sample is packed exactly once (later if need be), none lost."""
    loader = Loader(LoaderConfig(**TIGHT))
    windows = [loader.window_plan(w) for w in range(8)]
    assert all(why.startswith("longer than a row") for wp in windows for _, _, why in wp.dropped)  # only unusable ones
    assert sum(len(wp.deferred) for wp in windows) > 0           # the pool really overflowed
    placed = [e for wp in windows for e in _placed(wp)]
    fresh = [(e.source, e.record, e.piece) for wp in windows
             for e in wp.entries[len(wp.start.deferred):]]       # first drawn in this window
    left = [(e.source, e.record, e.piece) for e in windows[-1].deferred]
    assert sorted(placed + left) == sorted(fresh)                # each drawn entry: placed once or still waiting
    for prev, nxt in zip(windows, windows[1:]):                  # deferred entries go first into the next window
        assert nxt.entries[:len(prev.deferred)] == tuple(e.__class__(e.source, e.record, e.piece, 0) for e in prev.deferred)
    # the pool stays bounded: fresh draws fill it only up to samples_per_step * window
    assert all(len(wp.entries) <= TIGHT["samples_per_step"] * TIGHT["window"] + 8 for wp in windows)


def test_resume_with_deferred_samples_reproduces_the_batches():
    one = Loader(LoaderConfig(**TIGHT))
    it = iter(one)
    first = [next(it) for _ in range(5)]           # mid-window (window = 2 steps)
    state = one.state()
    rest = [next(it) for _ in range(5)]
    assert any(one.window_plan(w).deferred for w in range(5))
    again = Loader(LoaderConfig(**TIGHT))
    again.restore(state)
    assert state["start"]["deferred"] or state["start"]["prefix"] != [0]
    it2 = iter(again)
    resumed = [next(it2) for _ in range(5)]
    for a, b in zip(rest, resumed):
        assert a["step"] == b["step"]
        assert all(np.array_equal(a["microbatches"][0][k], b["microbatches"][0][k]) for k in a["microbatches"][0])
    assert first[0]["step"] == 0


def test_mix_weights_follow_the_training_step_with_deferral():
    cfg = LoaderConfig(sources=[SourceSpec("a", kind="world", split="train"), SourceSpec("b", kind="world", split="eval")],
                       mix=[{"step": 0, "weights": {"a": 1}}, {"step": 3, "weights": {"a": 1}},
                            {"step": 4, "weights": {"b": 1}}], **TIGHT)
    loader = Loader(cfg)
    for w in range(4):
        wp = loader.window_plan(w)
        fresh = {loader.names[e.source] for e in wp.entries[len(wp.start.deferred):]}
        assert fresh == ({"a"} if w * TIGHT["window"] < 4 else {"b"})


# ------------------------------------------------------------------ the stream is layout-free
def _step_samples(loader, steps):
    """Per step: the sorted (source, record, piece) it trains on, from the plan's bins of every rank."""
    out = []
    for step in range(steps):
        wp, g = loader.window_plan(step // loader.cfg.window), step % loader.cfg.window
        per = loader.cfg.dp * loader.cfg.microbatches
        out.append(sorted((e.source, e.record, e.piece) for b in wp.plan.bins[g * per:(g + 1) * per]
                          for e in (wp.entries[k] for k, _ in b)))
    return out


def test_a_steps_samples_do_not_depend_on_the_layout():
    """tiny_omni's plane with a doubled batch (16 rows, capacity vision 320 / audio 256 per step): 1, 2 and
    8 dp ranks train on the same samples at every step, drop none (the bug: on 8 ranks, samples with more
    than a rank's share of encoder rows were dropped), and the hosts of a 2 x 4 job split the same plan."""
    from recipes.tiny_omni import load

    cfg = load([])
    base = dict(sources=[SourceSpec("world")], samples_per_step=64, microbatches=1, window=4, row_len=128,
                fixed_shapes=True, encoder_rows={"vision": 320, "audio": 256}, seed=0)
    loaders = {dp: Loader(LoaderConfig(dp=dp, max_rows=16 // dp, **base), mm_cfg=cfg.model, world_cfg=cfg.world)
               for dp in (1, 2, 8)}
    streams = {dp: _step_samples(lo, 12) for dp, lo in loaders.items()}
    assert streams[1] == streams[2] == streams[8]
    assert all(len(s) > 16 for s in streams[1])                  # real steps: more samples than rows
    assert all(lo.metrics()["dropped_total"] == 0 for lo in loaders.values())
    # a rank's share of the encoder rows (320 / 8 = 40) is below the largest samples': placed all the same
    big = [k for wp in (loaders[8].window_plan(w) for w in range(3)) for b in wp.plan.bins for k, _ in b
           if wp.items[k].enc[list(loaders[8].enc_names).index("vision")] > 40]
    assert big
    # two hosts of four ranks each read disjoint halves of the same step
    hosts = [Loader(LoaderConfig(dp=8, max_rows=2, **base), mm_cfg=cfg.model, world_cfg=cfg.world, ranks=r)
             for r in (range(4), range(4, 8))]
    full = loaders[8].host_batch(5)["microbatches"][0]
    parts = [h.host_batch(5)["microbatches"][0] for h in hosts]
    assert np.array_equal(np.concatenate([p["tokens"] for p in parts]), full["tokens"])


def test_capacities_sized_from_metadata_and_explicit_ones_checked(tmp_path):
    """Every record of a shard is read from its sidecar (no decoding); an unset capacity holds the largest
    sample and the vision rows of a step drawn at random from the data (filled to its token budget) in at
    least 97.5% of 4000 such steps, and is no larger than the most rows any step of this data can hold; an
    explicit value below the largest sample is one clear line naming the key and the value that fits."""
    from omnijax.train.data_plane import data_bounds, step_capacities
    from omnijax.data.sources import open_sources
    from omnijax.data.tokens import default_mm_config, segment_tokens

    mm = default_mm_config()
    vid = lambda t, side: Sample((Segment("video", np.zeros((t, side, side, 3), np.float32)), text("v", loss=True)))  # noqa: E731
    samples = [Sample((text("x" * 30), text("ok", loss=True)))] * 5 + [vid(2, 32), vid(2, 64)]  # 128, 512 vision rows
    srcs = open_sources([SourceSpec("s", path=_shard(tmp_path, "s", samples))])
    srcs[0].get = None  # reading a payload would fail: sizing reads metadata only
    b = data_bounds(srcs, mm)
    assert b.complete and b.scanned == 7 and b.largest["vision"] == (512, "s", 6)
    assert b.mean_rows["vision"] == pytest.approx(640 / 7) and "audio" not in b.largest
    caps = step_capacities(b, 4, 256, mm)
    cap = caps["vision"]
    assert cap >= 512 and cap % 4 == 0 and caps["audio"] > 0
    sizes = [(sum(segment_tokens(g, mm)[1] for g in srcs[0].meta(i).segments),
              sum(segment_tokens(g, mm)[0] for g in srcs[0].meta(i).segments if g.modality == "video"))
             for i in range(7)]                                   # (LLM tokens, vision rows) of each record
    budget, rng, steps = 4 * 256, np.random.default_rng(0), []
    for _ in range(4000):                                          # steps of records drawn at random
        tokens = rows = 0
        while True:
            t, r = sizes[rng.integers(len(sizes))]
            if tokens + t > budget:
                break
            tokens, rows = tokens + t, rows + r
        steps.append(rows)
    assert np.mean(np.array(steps) > cap) <= 0.025
    most = [0] * (budget + 1)                                      # the most rows within t tokens (knapsack)
    for t in range(1, budget + 1):
        most[t] = max([most[t - 1]] + [most[t - n] + r for n, r in sizes if n <= t])
    assert cap <= most[budget]
    assert step_capacities(b, 4, 256, mm, explicit={"vision": 1024})["vision"] == 1024
    with pytest.raises(ConfigError, match=r"capacity.vision=256 is below the 512 vision input rows of sample s\[6\]: "
                                          r"set capacity.vision=512 or more"):
        step_capacities(b, 4, 256, mm, explicit={"vision": 256})
    with pytest.raises(ConfigError, match="unknown encoder"):
        step_capacities(b, 4, 256, mm, explicit={"lidar": 64})
