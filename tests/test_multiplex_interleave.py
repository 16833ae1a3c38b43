"""Per-microbatch views for the interleaved joint pipeline (pure numpy): every encoder segment lands in
exactly one microbatch — the one holding its LLM row — with its destinations renumbered consistently."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnijax.errors import ConfigError
from omnijax.parallel.multiplex import microbatch_views

R = 4  # encoder rows per LLM token


def batch_with_segments(rng, B, L, n_segments):
    """Segments whose tokens sit in one packed row each (as packing guarantees); input column 0 holds
    the input row index, so a row's identity survives the views."""
    fill = np.zeros(B, np.int64)
    seg_ids, dests = [], []
    for i in range(n_segments):
        k = int(rng.integers(1, 5))
        rows = [r for r in range(B) if fill[r] + k <= L]
        if not rows:
            break
        r = int(rng.choice(rows))
        dests.append(r * L + fill[r] + np.arange(k))
        fill[r] += k
        seg_ids.append(np.full(k * R, i + 1, np.int32))
    seg = np.concatenate(seg_ids + [np.zeros(2 * R, np.int32)])
    dest = np.concatenate(dests + [-np.ones(2, np.int64)]).astype(np.int32)
    tokens = np.arange(B * L, dtype=np.int32).reshape(B, L)
    return {"tokens": tokens, "targets": tokens, "segment_ids": np.ones((B, L), np.int32),
            "positions": np.zeros((B, L), np.int32), "loss_mask": np.ones((B, L), np.float32),
            "vision_inputs": np.arange(len(seg), dtype=np.float32)[:, None].repeat(3, 1),
            "vision_positions": np.zeros((len(seg), 3), np.int32), "vision_segment_ids": seg, "vision_dest": dest}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.sampled_from([1, 2, 4]), n=st.integers(0, 12))
def test_every_segment_in_exactly_the_microbatch_of_its_row(seed, M, n):
    B, L = 8, 16
    batch = batch_with_segments(np.random.default_rng(seed), B, L, n)
    views = microbatch_views(batch, M, ("vision",))
    assert len(views) == M
    seg, dest = batch["vision_segment_ids"], batch["vision_dest"]
    kept = np.zeros(len(seg), np.int64)
    got = np.full(len(dest), -1, np.int64)
    for m, v in enumerate(views):
        np.testing.assert_array_equal(v["tokens"], batch["tokens"][m::M])  # pipeline.split_microbatches rows
        on = v["vision_segment_ids"] > 0
        kept += on
        np.testing.assert_array_equal(v["vision_segment_ids"][on], seg[on])
        d = v["vision_dest"].astype(np.int64)
        live = d >= 0
        # renumbered destination -> the same token of the global batch
        got[live] = (d[live] // L * M + m) * L + d[live] % L
        assert (v["tokens"].reshape(-1)[d[live]] == batch["tokens"].reshape(-1)[got[live]]).all()
    np.testing.assert_array_equal(kept, (seg > 0).astype(np.int64))       # each segment row exactly once
    np.testing.assert_array_equal(got, np.where(dest >= 0, dest, -1))      # every token, none twice


def test_segment_across_microbatches_is_refused():
    batch = batch_with_segments(np.random.default_rng(0), 4, 8, 0)
    batch["vision_segment_ids"] = np.array([1] * 8 + [0] * 8, np.int32)
    batch["vision_dest"] = np.array([0, 8 + 0, -1, -1], np.int32)   # rows 0 and 1: microbatches 0 and 1
    with pytest.raises(ConfigError, match="different microbatches"):
        microbatch_views(batch, 2, ("vision",))


def _multiplexer(layout, **kw):
    from omnijax.config import from_dict
    from omnijax.mm_config import MMConfig
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer
    from test_multiplex_step import ENCODERS, LLM

    cfg = from_dict(MMConfig, {"llm": LLM, "encoders": ENCODERS})
    return cfg, Multiplexer(LLMParallel(layout, cfg.llm), cfg, encoder_layout="edp4xesp2", **kw)


def test_interleave_without_a_pipeline_is_a_config_error():
    with pytest.raises(ConfigError, match="no pipeline"):
        _multiplexer("dp4xtp2", interleave=True)


def test_window_capacities_hold_every_microbatch_plan():
    """`size_window` (the trainer's and every bench's window sizing) over upcoming batches: planning each
    of them afterwards never grows a capacity (one compiled program for the window), every microbatch's
    plan is stacked; a resumed run keeps the checkpointed capacities for the rest of its window, and the
    next window gets its own fit again."""
    from omnijax.data.world import World
    from omnijax.data.packing import SamplePacker as Packer
    from test_multiplex_step import WORLD

    cfg, mx = _multiplexer("pp2xdp2xtp2", interleave=True)
    packer = Packer(cfg, 8, 64, {"vision": 512, "audio": 256})
    batches = [packer.pack(World(WORLD).sample(i) for i in range(k, k + 80))[0] for k in (0, 80, 160)]
    caps = mx.size_window(batches)
    assert caps == mx.capacities and mx.reserve == mx.size_window
    for b in batches:
        _, plan = mx.host_plan(b)
        assert mx.capacities == caps
        assert plan.arrays["route_send"].shape[:2] == (8, mx.engine.schedule.microbatches)
        assert 0.0 <= plan.stats["padded_fraction"] < 1.0
    roomy = {k: v + 16 for k, v in caps.items()}
    mx.set_state({"capacities": roomy, "programs": [caps]})  # resumed mid-window: the checkpointed ones hold it
    assert mx.size_window(batches) == roomy
    assert mx.size_window(batches) == caps  # the next window: its own fit, a program compiled already
    assert mx.programs == [caps, roomy]
