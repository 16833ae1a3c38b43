"""Planning groups: a step's rows planned in independent groups stay layout-free, and a host that plans
only its own groups gets exactly the rows the whole-step plan gives its ranks."""
import numpy as np
import pytest

from omnijax.data.groups import Groups
from omnijax.data.loader import Loader, LoaderConfig
from omnijax.data.mixing import Mixer, Schedule
from omnijax.data.payload import payload_bytes
from omnijax.data.sources import SourceSpec
from omnijax.errors import ConfigError
from omnijax.train.metrics import FlopCounter

BASE = dict(sources=[SourceSpec("world")], samples_per_step=64, microbatches=1, window=4, row_len=128,
            fixed_shapes=True, encoder_rows={"vision": 320, "audio": 256}, seed=0, plan_rows=4)


@pytest.fixture(scope="module")
def world():
    from recipes.tiny_omni import load

    cfg = load([])
    return cfg.model, cfg.world


def _loader(world, dp, **kw):
    return Loader(LoaderConfig(dp=dp, max_rows=16 // dp, **BASE), mm_cfg=world[0], world_cfg=world[1], **kw)


def _steps(loader, windows):
    out = []
    for w in range(windows):
        wp = loader.window_plan(w)
        per = loader.cfg.dp * loader.cfg.microbatches
        for g in range(loader.cfg.window):
            out.append(sorted((e.source, e.record, e.piece) for b in wp.plan.bins[g * per:(g + 1) * per]
                              for e in (wp.entries[k] for k, _ in b)))
    return out


def test_groups_tile_the_step_and_align_with_ranks():
    g = Groups.of(dp=8, rank_rows=2, plan_rows=4)
    assert (g.count, g.rows) == (4, 4) and list(g.ranks(1)) == [2, 3] and g.of_ranks([3, 4]) == [1, 2]
    one = Groups.of(dp=1, rank_rows=16, plan_rows=4)   # one rank holds all four groups, each at its rows
    assert [one.row_offset(j) for j in range(4)] == [0, 4, 8, 12] and one.of_ranks([0]) == [0, 1, 2, 3]
    assert Groups.of(dp=64, rank_rows=2).count == 1    # a step of <= PLAN_ROWS rows: one group, the plan as before
    assert Groups.of(dp=4, rank_rows=3, plan_rows=6).aligned     # a group holds two whole ranks
    cut = Groups.of(dp=3, rank_rows=4, plan_rows=6)                 # groups of 6 rows cut ranks of 4
    assert not cut.aligned and [list(cut.ranks(j)) for j in range(2)] == [[0, 1], [1, 2]]
    with pytest.raises(ConfigError, match="plan_rows"):
        Groups.of(dp=4, rank_rows=3, plan_rows=-1)


def test_mixer_lanes_draw_disjoint_records():
    mixer = Mixer([97, 50], Schedule.uniform(["a", "b"]), seed=3, batch_size=8)
    base = mixer.draw(np.zeros(2, np.int64), 5, 20)
    same = mixer.draw(np.zeros(2, np.int64), 5, 20, 0, 1)
    assert all(np.array_equal(x, y) for x, y in zip(base, same))      # one lane: the draws without lanes
    lanes = [mixer.draw(np.zeros(2, np.int64), 5, 20, j, 3) for j in range(3)]
    for k in range(2):
        recs = [r for src, rec, _ in lanes for s, r in zip(src.tolist(), rec.tolist()) if s == k]
        assert len(recs) == len(set(recs))                            # no record twice within the epoch


def test_grouped_plan_is_layout_free_and_host_local(world):
    loaders = {dp: _loader(world, dp) for dp in (1, 2, 8)}
    assert loaders[8].groups.count == 4
    streams = {dp: _steps(lo, 3) for dp, lo in loaders.items()}
    assert streams[1] == streams[2] == streams[8]
    assert all(len(s) > 16 for s in streams[1])                      # real steps: more samples than rows
    for lo in loaders.values():
        assert lo.metrics(8)["dropped_total"] == 0
        wp = lo.window_plan(1)
        placed = [k for b in wp.plan.bins for k, _ in b]
        assert len(placed) == len(set(placed)) and not set(placed) & set(wp.plan.unplaced)
    # a host of ranks 0-3 plans groups 0 and 1 only, and its ranks' bins are the whole plan's
    host = _loader(world, 8, ranks=range(4), plan_local=True)
    for w in range(3):
        mine, full = host.window_plan(w), loaders[8].window_plan(w)
        assert mine.groups == (0, 1) and len(mine.items) < len(full.items)
        for g in range(4):
            for r in range(4):
                b = g * 8 + r
                assert [mine.entries[k] for k, _ in mine.plan.bins[b]] == [full.entries[k] for k, _ in full.plan.bins[b]]
                assert [r_ for _, r_ in mine.plan.bins[b]] == [r_ for _, r_ in full.plan.bins[b]]
    half = host.host_batch(5)["microbatches"][0]["tokens"]
    assert np.array_equal(half, loaders[8].host_batch(5)["microbatches"][0]["tokens"][:8])
    # resume from a grouped state: the same windows again
    loaders[2].step = 8
    state = loaders[2].state()
    assert len(state["starts"]) == 4
    again = _loader(world, 2)
    again.restore(state)
    assert _steps(again, 3)[8:] == streams[2][8:]


def test_groups_that_cut_ranks_keep_the_steps_samples(world):
    """12 rows in groups of 6: on 3 ranks of 4 rows a rank holds parts of two groups; 1, 3 and 4 ranks
    still train on the same samples, each placed once, none dropped."""
    base = {**BASE, "samples_per_step": 48, "encoder_rows": {"vision": 240, "audio": 192}, "plan_rows": 6}
    loaders = {dp: Loader(LoaderConfig(dp=dp, max_rows=12 // dp, **base), mm_cfg=world[0], world_cfg=world[1])
               for dp in (1, 3, 4)}
    assert not loaders[3].groups.aligned and loaders[4].groups.aligned
    streams = {dp: _steps(lo, 2) for dp, lo in loaders.items()}
    assert streams[1] == streams[3] == streams[4]
    wp = loaders[3].window_plan(1)
    placed = [k for b in wp.plan.bins for k, _ in b]
    assert len(placed) == len(set(placed)) and loaders[3].metrics(4)["dropped_total"] == 0
    assert all(r < 4 for b in wp.plan.bins for _, r in b)


class Rendezvous:
    """An all-gather of bytes between loaders in one process (threads), as `data_plane.kv_exchange` is
    between processes: each host puts its part of a window and waits for every host's."""

    def __init__(self, hosts: int):
        import threading

        self.hosts, self.cv, self.parts = hosts, threading.Condition(), {}

    def of(self, host: int):
        def exchange(window: int, part: bytes) -> list[bytes]:
            with self.cv:
                self.parts.setdefault(window, {})[host] = part
                self.cv.notify_all()
                assert self.cv.wait_for(lambda: len(self.parts[window]) == self.hosts, timeout=120)
                return [self.parts[window][h] for h in sorted(self.parts[window], reverse=True)]  # any order
        return exchange


def _on_hosts(loaders, fn):
    """fn(loader) on every loader at once (each in a thread: their exchanges meet), results in host order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(loaders)) as pool:
        return list(pool.map(fn, loaders))


def _hosts(world, ranks, plan_rows, state=None, layout_local=False):
    """A loader per host (its text ranks `ranks[h]`), exchanging through one Rendezvous."""
    meet = Rendezvous(len(ranks))
    out = []
    for h, own in enumerate(ranks):
        lo = Loader(LoaderConfig(dp=8, max_rows=2, **{**BASE, "plan_rows": plan_rows}), mm_cfg=world[0],
                    world_cfg=world[1], lazy_media=True, text_ranks=list(own), plan_local=True, exchange=meet.of(h),
                    layout_local=layout_local, keep_state=not layout_local or h == 0)
        if state is not None:
            lo.restore(state)
        out.append(lo)
    return out


def _starts(wp):
    """The next window's start of every planning group, as the loader state keeps it."""
    return [s.to_state() for s in wp.next_start]


def _bins(wp):
    """Every bin's samples (source, record, piece) and rows, in order."""
    return [[(wp.entries[k].source, wp.entries[k].record, wp.entries[k].piece, r) for k, r in b] for b in wp.plan.bins]


HOSTS = {"2 hosts": [range(0, 4), range(4, 8)], "4 hosts": [range(2 * h, 2 * h + 2) for h in range(4)],
         "pp across hosts": [range(8), range(8)]}


@pytest.mark.parametrize("hosts,plan_rows", [("2 hosts", 4), ("4 hosts", 8), ("pp across hosts", 4)])
def test_hosts_plan_their_own_groups_and_merge_the_whole_step(world, hosts, plan_rows):
    """Each host plans only its own planning groups and the hosts exchange their parts: every host then
    holds the whole step's plan of a loader that plans every group (samples, rows, layouts, geometry),
    builds only its own token rows, and its state resumes every group exactly. "4 hosts": a group spans
    two hosts, both plan it; "pp across hosts": both hosts hold every rank (pipeline stages on different
    hosts), each rank's rows are taken once."""
    ranks = HOSTS[hosts]
    whole = Loader(LoaderConfig(dp=8, max_rows=2, **{**BASE, "plan_rows": plan_rows}), mm_cfg=world[0],
                   world_cfg=world[1], lazy_media=True, text_ranks=[0, 1])
    loaders = _hosts(world, ranks, plan_rows)
    assert all(len(lo.plan_groups) < whole.groups.count for lo in loaders) or hosts == "pp across hosts"
    plans = _on_hosts(loaders, lambda lo: [lo.window_plan(w) for w in range(3)])
    for w in range(3):
        full = whole.window_plan(w)
        for wp in (p[w] for p in plans):
            assert wp.layouts == full.layouts and _starts(wp) == _starts(full)
            assert _bins(wp) == _bins(full)
    assert sum(len(b) for b in plans[0][1].plan.bins) > 16          # real steps: more samples than rows
    if hosts == "2 hosts":  # a part set that misses a host's ranks is refused in one line, not merged short
        with pytest.raises(ConfigError, match="miss dp ranks"):
            loaders[0].merge(plans[0][1], [loaders[0].own_part(plans[0][1])])
    batches = _on_hosts(loaders, lambda lo: lo.host_batch(5)["microbatches"][0])
    ref = whole.host_batch(5)["microbatches"][0]
    for own, got in zip(ranks, batches):
        assert np.array_equal(got["row_docs"], ref["row_docs"])   # the whole step's geometry on every host
        assert np.array_equal(got["rows"], np.arange(2 * own[0], 2 * own[-1] + 2))  # only its own rows built
        for name in ("vision", "audio"):
            assert np.array_equal(np.asarray(got[f"{name}_segment_ids"]), np.asarray(ref[f"{name}_segment_ids"]))
            assert np.array_equal(np.asarray(got[f"{name}_dest"]), np.asarray(ref[f"{name}_dest"]))
    assert np.array_equal(batches[0]["tokens"][:4], ref["tokens"])                # ranks 0-1: the same rows
    # the state (process 0's, as the checkpoint keeps it) holds every group: hosts resume the same windows
    for lo in loaders:
        lo.step = 8
    state = loaders[0].state()
    whole.step = 8
    assert state == whole.state() and len(state["starts"]) == whole.groups.count
    again = _hosts(world, ranks, plan_rows, state)
    resumed = _on_hosts(again, lambda lo: lo.window_plan(2))
    assert all(r.layouts == plans[0][2].layouts and _starts(r) == _starts(plans[0][2]) for r in resumed)
    assert all(_bins(r) == _bins(plans[0][2]) for r in resumed)


@pytest.mark.parametrize("hosts,plan_rows", [("2 hosts", 4), ("4 hosts", 8), ("pp across hosts", 4)])
def test_hosts_lay_out_only_their_own_rows(world, hosts, plan_rows):
    """`layout_local` (what routing per host group needs): each host lays out only its own rows and their
    encoder segments; the exchanged parts carry no samples, only what every host agrees on (next starts,
    layouts, per-rank totals), so the merge is O(groups + ranks). Its rows, segments, layouts and next
    starts equal the whole plan's on its ranks; `row_docs` sums to the step's (samples, tokens, FLOPs);
    process 0's state resumes every host exactly."""
    ranks = HOSTS[hosts]
    whole = Loader(LoaderConfig(dp=8, max_rows=2, **{**BASE, "plan_rows": plan_rows}), mm_cfg=world[0],
                   world_cfg=world[1], lazy_media=True, text_ranks=list(range(8)))
    loaders = _hosts(world, ranks, plan_rows, layout_local=True)
    plans = _on_hosts(loaders, lambda lo: [lo.window_plan(w) for w in range(3)])
    full_parts = _hosts(world, ranks, plan_rows)
    for w in range(3):
        full = whole.window_plan(w)
        for h, (own, wp) in enumerate(zip(ranks, (p[w] for p in plans))):
            # host 0 keeps the state (every group's next start); the others read only their own groups'
            assert wp.layouts == full.layouts
            assert _starts(wp) == _starts(full) if h == 0 else all(
                _starts(wp)[j] == _starts(full)[j] for j in loaders[h].plan_groups)
            mine, ref = _bins(wp), _bins(full)
            assert all(mine[g * 8 + r] == ref[g * 8 + r] for g in range(4) for r in own)
    old_plans = _on_hosts(full_parts, lambda lo: lo.window_plan(1))
    part, old = loaders[0].own_part(plans[0][1]), full_parts[0].own_part(old_plans[0])
    head = lambda b: 8 + int.from_bytes(b[:8], "little")  # noqa: E731 - the JSON header's end
    groups_end = head(part) + 8 + int.from_bytes(part[head(part):head(part) + 8], "little")  # the groups' section
    cols = 3 + 3 * len(loaders[0].enc_names)  # documents, tokens, squares; per encoder segments, rows, squares
    assert len(part) - groups_end == 8 * cols * 4 * len(ranks[0]) < len(old) - head(old)  # no samples: rank totals
    batches = _on_hosts(loaders, lambda lo: lo.host_batch(5)["microbatches"][0])
    ref = whole.host_batch(5)["microbatches"][0]
    L = ref["tokens"].shape[1]
    for own, got in zip(ranks, batches):
        rows = np.arange(2 * own[0], 2 * own[-1] + 2)
        assert np.array_equal(got["rows"], rows) and np.array_equal(got["tokens"], ref["tokens"][rows])
        assert np.array_equal(got["row_docs"][rows], ref["row_docs"][rows])
        assert np.array_equal(got["row_docs"].sum(axis=0), ref["row_docs"].sum(axis=0))  # the step's totals
        for name in ("vision", "audio"):  # and the step's encoder totals, while its segments are its own
            runs = ref[f"{name}_segment_ids"]
            want = [len(runs.lengths), int(runs.lengths.sum()), int(np.square(runs.lengths).sum())]
            assert got["enc_docs"][name].tolist() == want and want[0] > 0
            assert FlopCounter(1, 1, 1, ((name, 1, 1, 1, 1),), ())(got) == FlopCounter(1, 1, 1, ((name, 1, 1, 1, 1),), ())(ref)
            assert payload_bytes(got)[1] == payload_bytes(ref)[1] > 0
            dest = np.asarray(ref[f"{name}_dest"])
            mine = dest[(dest >= 0) & np.isin(dest // L, rows)]
            got_dest = np.asarray(got[f"{name}_dest"])
            assert np.array_equal(np.sort(got_dest[got_dest >= 0]), np.sort(mine))  # only its own rows' segments
    for lo in loaders:
        lo.step = 8
    lazy = loaders[0].lazy_state()  # what the trainer's prefetcher takes per batch: serialized only when read
    assert not lazy.built
    state = loaders[0].state()
    whole.step = 8
    assert state == whole.state() == lazy and dict(lazy) == state and lazy.built
    again = _hosts(world, ranks, plan_rows, dict(lazy), layout_local=True)
    resumed = _on_hosts(again, lambda lo: lo.window_plan(2))
    assert all(r.layouts == plans[0][2].layouts for r in resumed) and _starts(resumed[0]) == _starts(plans[0][2])
    assert all(_bins(r)[g * 8 + q] == _bins(p[2])[g * 8 + q] for r, p, own in zip(resumed, plans, ranks)
               for g in range(4) for q in own)


def test_host_ranks_even_out_each_host_groups_encoder_work(world):
    """`host_ranks` (set by the data plane when the multiplexer routes per host group): a step's samples go
    first to groups of 4 consecutive ranks by encoder cost, then to the ranks. The steps' samples stay
    those of the plain spread (layout-free), a host's own plan still equals the whole plan on its ranks,
    and each group's encoder cost is closer to the mean than under the plain spread (by cost, not time)."""
    base = {**BASE, "samples_per_step": 128, "encoder_rows": {"vision": 640, "audio": 512}, "plan_rows": 32}
    make = lambda k, **kw: Loader(LoaderConfig(dp=16, max_rows=2, host_ranks=k, **base), mm_cfg=world[0],  # noqa: E731
                                  world_cfg=world[1], **kw)
    plain, grouped = make(0), make(4)
    assert _steps(plain, 3) == _steps(grouped, 3)

    def spread(lo):
        out = []
        for w in range(3):
            wp = lo.window_plan(w)
            for g in range(4):
                enc = np.array([sum(wp.items[k].cost - lo.cost_model.llm(wp.items[k].tokens)
                                    for r in range(4 * h, 4 * h + 4) for k, _ in wp.plan.bins[g * 16 + r])
                                for h in range(4)])
                out.append(enc.max() / enc.mean())
        return float(np.mean(out))
    assert spread(grouped) < spread(plain) - 0.1
    host = make(4, ranks=range(4, 8), plan_local=True)
    for w in range(2):
        mine, full = host.window_plan(w), grouped.window_plan(w)
        for b in (g * 16 + r for g in range(4) for r in range(4, 8)):
            assert [mine.entries[k] for k, _ in mine.plan.bins[b]] == [full.entries[k] for k, _ in full.plan.bins[b]]


def test_kv_exchange_needs_a_multi_process_job():
    from omnijax.train.data_plane import kv_exchange

    with pytest.raises(ConfigError, match="multi-process"):
        kv_exchange("omnijax_plan/test")
