"""The multiplexer's window sizing (`Multiplexer.size_window`, the trainer's `reserve`), planning only:
capacities fitted to each window jointly (they shrink when the mix does), every batch of the window
inside them, each host decoding its share of every step's payload, a bounded set of programs, and
a resumed run sized as the run it continues."""
import numpy as np
from hypothesis import given, settings, strategies as st

from omnijax.parallel import routing
from omnijax.parallel.context import balanced_order
from omnijax.parallel.multiplex import Multiplexer
from test_multiplex_plan import DIMS, RED, synthetic_batch


def _planner(hosts=None, max_programs=4, mode="balanced") -> Multiplexer:
    """The planning half of a Multiplexer on dp4 x tp2 (esp groups of 2): no mesh or model needed."""
    mx = Multiplexer.__new__(Multiplexer)
    mx.grid, mx.reductions, mx.dims = routing.DeviceGrid((1, 4, 1, 1, 1, 2), esp=2), RED, DIMS
    mx.cost_fn, mx.mode, mx.long_short, mx.capacities = (lambda n, r: float(r * r)), mode, True, None
    mx.interleave, mx.balance_rows, mx.hosts, mx.max_programs, mx.programs = False, False, hosts, max_programs, []
    return mx


def _window(seed: int, n_segments: int, steps: int = 3) -> list[dict]:
    return [synthetic_batch(np.random.default_rng(seed * 7 + k), 8, 32, n_segments) for k in range(steps)]


def _enc_rows(caps: dict) -> int:
    return sum(v for k, v in caps.items() if k != "route")


def _fits(mx: Multiplexer, caps: dict, batch: dict) -> routing.Plan:
    """The batch's plan inside the window's capacities; none of them grew (one program for the window)."""
    mx.capacities = dict(caps)
    plan = mx.plan(batch, fill=False)
    assert mx.capacities == caps
    return plan


def test_a_lighter_window_gets_smaller_buffers_than_the_heavier_one_before_it():
    """Capacities are fitted per window, not carried over: after a window of many segments, a window of
    few gets buffers sized for its own batches (before, capacities only grew, and the light window
    padded up to the heavy one's buffers)."""
    mx = _planner()
    heavy, light = _window(0, 9), _window(1, 2)
    caps_heavy = mx.size_window(heavy)
    caps_light = mx.size_window(light)
    assert _enc_rows(caps_light) < _enc_rows(caps_heavy)
    for caps, window in ((caps_heavy, heavy), (caps_light, light)):
        for b in window:
            _fits(mx, caps, b)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.integers(4, 9))
def test_every_host_decodes_its_share_of_every_step(seed, n_segments):
    """With two hosts, every step of a fitted window leaves each host 45-55% of the step's payload
    (float32 input bytes of the segments its devices encode) where some placement of its esp groups can:
    else the split is the most even one of its groups (checked against every split), and the sizing
    tried roomier buffers first."""
    import itertools

    mx = _planner(hosts=2)
    window = _window(seed, n_segments)
    caps = mx.size_window(window)
    for b in window:
        plan = _fits(mx, caps, b)
        shares = routing.host_payload_shares(plan.device_payload, np.arange(8) // 4)
        assert abs(shares.sum() - 1.0) < 1e-9
        assert plan.stats["host_payload_share_min"] == min(shares)
        per = plan.device_payload.reshape(4, 2).sum(1)
        best = min(abs(per[list(c)].sum() / max(per.sum(), 1e-9) - 0.5) for c in itertools.combinations(range(4), 2))
        assert abs(shares[0] - 0.5) <= max(0.05, best) + 1e-9, (shares, best)


def test_a_step_no_placement_can_split_evenly_still_gets_buffers_that_hold_it():
    """One segment per encoder: no placement gives two hosts even shares; sizing stops growing the
    buffers (a few buckets at most) and the window still runs in one program."""
    mx = _planner(hosts=2)
    window = _window(3, 1, steps=2)
    caps = mx.size_window(window)
    tight = routing.fit_capacities(window, mx.grid, RED, DIMS, mx.cost_fn, order=balanced_order)
    assert _enc_rows(caps) == _enc_rows(tight)  # growing did not help: the tight fit is kept
    for b in window:
        _fits(mx, caps, b)


def test_programs_stay_bounded_and_past_the_budget_a_program_is_added_only_where_none_holds():
    """Many windows of changing mixes: at most `max_programs` fitted programs; past them a window runs in
    a program it fits (the one with the fewest rows), and a new one (the widest buffers seen, or a
    program grown to hold it) is compiled only for a window that none of the programs so far holds."""
    mx = _planner(max_programs=1)
    windows = [_window(100 + w, 1 + (w * 5) % 9) for w in range(12)]
    added = 0
    for window in windows:
        before = list(mx.programs)
        caps = mx.size_window(window)
        for b in window:
            _fits(mx, caps, b)
        if before and caps not in before:
            added += 1
            parts = [mx.parts(mx.balanced(b)) for b in window]
            assert not any(mx._holds(p, parts) for p in before), (caps, before)
    assert added >= 1 and len(mx.programs) < len(windows) // 2


def test_a_resumed_run_sizes_its_windows_as_the_run_it_continues():
    """The state (the window's capacities and the programs so far) restored mid-window: the rest of the
    window keeps the checkpointed capacities and later windows choose the same programs."""
    windows = [_window(200 + w, 2 + (w * 3) % 8) for w in range(7)]
    ref = _planner(max_programs=2)
    ref_caps = []
    state = None
    for w, window in enumerate(windows):
        ref_caps.append(ref.size_window(window))
        if w == 3:
            state = ref.get_state()
    resumed = _planner(max_programs=2)
    resumed.set_state(state)
    got = [resumed.size_window(windows[3][1:])] + [resumed.size_window(window) for window in windows[4:]]
    assert got == ref_caps[3:]
    assert resumed.programs == ref.programs
