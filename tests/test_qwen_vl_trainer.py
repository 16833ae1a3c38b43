"""Qwen2.5-VL on the trainer's path: M-RoPE positions carried per token by the packer (segment-local, never from
the row index), a packed row equal to its samples alone, and the multiplexed step (window-attention `qwen_vit`
tower on every device, a long video split over esp, M-RoPE LLM under dp/fsdp/tp/cp/pp) equal to one device.

One batch serves every check: row 0 packs three samples, rows 1-3 hold the same samples alone, rows 4-7
others (a long video among them). The single-device reference compiles once (loss, gradients and logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from numerics import assert_grads_close
from omnijax.config import from_dict
from omnijax.data import packing, qwen_processor
from omnijax.data.sample import Sample, Segment
from omnijax.mm_config import MMConfig, encoder_config
from omnijax.models import mllm
from omnijax.parallel.engine import LLMParallel, unstack_params
from omnijax.parallel.multiplex import Multiplexer
from omnijax.train.step import loss_and_grads

VISION = {"kind": "qwen_vit", "patch": 2, "temporal_patch": 2, "merge": 2, "embed_dim": 32, "num_layers": 2,
          "num_heads": 2, "mlp_dim": 64, "out_dim": 64, "window_size": 8, "fullatt_block_indexes": [1],
          "min_pixels": 16, "max_pixels": 400, "tokens_per_second": 2.0}
LLM = {"vocab_size": 128, "embed_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
       "mlp_dim": 128, "max_seq_len": 64, "rope": {"mrope_section": [2, 3, 3], "theta": 10000.0}}
ROWS, L, CAP = 8, 64, 768


def _text(rng, n, loss=False):
    return Segment("text", rng.randint(0, 120, n).astype(np.int32), loss)


def _sample(seed, media=(), fps=0.0):
    """text, each media item, text (the answer, a loss segment)."""
    rng = np.random.RandomState(seed)
    segs = [_text(rng, 2 + seed % 3)]
    for shape in media:
        segs.append(Segment("video" if len(shape) == 4 else "image", rng.rand(*shape).astype(np.float32),
                            fps=fps if len(shape) == 4 else 0.0))
        segs.append(_text(rng, 1))
    segs.append(_text(rng, 3 + seed % 4, loss=True))
    return Sample(tuple(segs), "test", seed)


@pytest.fixture(scope="module")
def setup():
    cfg = from_dict(MMConfig, {"llm": LLM, "encoders": {"vision": VISION},
                               "modalities": {"image": "vision", "video": "vision"}})
    specs = packing.encoder_specs(cfg)
    trio = [_sample(0, [(12, 20, 3)]), _sample(1), _sample(2, [(4, 8, 16, 3)], fps=1.0)]   # 60 + 64 patch rows
    # a long video: 3 x 6 x 10 patches, 180 rows; over an esp pair it splits after 92 rows, inside its second
    # frame, a merged row and a window
    others = [_sample(3, [(16, 12, 3)]), _sample(4, [(6, 12, 20, 3)], fps=2.0),
              _sample(5, [(8, 8, 3), (12, 8, 3)]), _sample(6, [(20, 12, 3)])]
    flats = [packing.flatten(s, cfg, specs) for s in trio + others]
    entries = [(f, 0) for f in flats[:3]] + [(f, r + 1) for r, f in enumerate(flats)]
    layout = packing.Layout(ROWS, L, (("vision", CAP),))
    batch = packing.pack([entries], layout, specs)
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    g, params, rest = nnx.split(model, nnx.Param, ...)

    def reference(p, b):
        loss, grads, _ = loss_and_grads(g, rest, mllm.mm_loss, p, b)
        return loss, grads, nnx.merge(g, p, rest)(b)[0]
    loss, grads, logits = jax.jit(reference)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    return cfg, trio + others, flats, batch, model, float(loss), nnx.to_pure_dict(grads), np.asarray(logits)


def test_packer_carries_segment_local_rope_positions_and_a_packed_row_equals_its_samples_alone(setup):
    cfg, samples, flats, batch, _, _, _, logits = setup
    vcfg = encoder_config("vision", cfg.encoders["vision"])
    rope, seg = batch["rope_positions"], batch["segment_ids"]
    start = 0
    for k in range(3):
        n = flats[k].size
        own = qwen_processor.sample_rope_positions([s.meta() for s in samples[k].segments], vcfg)
        assert own.shape == (n, 3) and own[0].tolist() == [0, 0, 0]   # segment-local: each sample from 0
        assert np.array_equal(rope[0, start:start + n], own) and np.array_equal(rope[k + 1, :n], own)
        assert (seg[0, start:start + n] == k + 1).all()
        err = np.abs(logits[0, start:start + n] - logits[k + 1, :n]).max() / np.abs(logits[k + 1, :n]).max()
        assert err < 1e-5, (k, err)
        start += n
    # the video's time steps follow its recorded rate: 2 s per temporal patch at 1 fps -> 4 positions
    video = rope[3, 4:4 + 16]  # sample 2: 4 text tokens, then its 2 x 2 x 4 merged video tokens
    assert sorted(set(video[:, 0].tolist())) == [4, 8]
    # not the row index: the packed row's second and third samples restart at 0
    assert rope[0, flats[0].size].tolist() == [0, 0, 0] and rope[0, flats[0].size, 0] != flats[0].size


def test_a_long_text_sample_split_over_rows_restarts_its_rope_positions_per_piece(setup):
    """An over-long text-only sample becomes row-sized documents (`packing.text_piece`): each piece's M-RoPE
    positions are its own 0..n-1 on all three axes, as its `positions` are."""
    cfg = setup[0]
    flat = packing.flatten(Sample((_text(np.random.RandomState(9), 150),), "test", 9), cfg, packing.encoder_specs(cfg))
    pieces = [packing.text_piece(flat, k, L) for k in range(3)]
    batch = packing.pack([[(p, k) for k, p in enumerate(pieces)]], packing.Layout(3, L, (("vision", 8),)),
                         packing.encoder_specs(cfg))
    assert [p.size for p in pieces] == [64, 64, 22]
    assert np.array_equal(batch["rope_positions"], np.repeat(batch["positions"][..., None], 3, axis=-1))


def _check(setup, layout, encoder_layout, **kw):
    cfg, _, _, batch, model, ref_loss, ref_grads, _ = setup
    interleave = kw.pop("interleave", False)
    engine = LLMParallel(layout, cfg.llm, **kw)
    mx = Multiplexer(engine, cfg, encoder_layout=encoder_layout, interleave=interleave)
    g, params, rest = nnx.split(mx.prepare(model), nnx.Param, ...)
    params = mx.put_state(params)
    placed = mx.put_batch(batch)
    assert placed["rope_positions"].shape == (ROWS, L, 3)
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(g, rest, mx.loss_fn, p, b))(params, placed)
    err = abs(float(loss) - ref_loss) / abs(ref_loss)
    print(f"{layout} + {encoder_layout}: loss {float(loss):.7f} vs {ref_loss:.7f} (rel {err:.1e})")
    assert err <= 1e-5, (float(loss), ref_loss)
    got = nnx.to_pure_dict(grads)
    if engine.schedule is not None:
        got["llm"] = unstack_params(grads["llm"], engine.schedule)
    assert_grads_close(got, ref_grads)
    return mx.last_plan


def test_dp_tp_cp_with_a_video_split_over_esp(setup):
    plan = _check(setup, "dp2xtp2xcp2", "edp4xesp2")
    assert plan.stats["long_segments"] > 0  # the long video ran split over an esp pair
    long = plan.arrays["vision_long_segment_ids"]  # [devices, rows]: each device's chunk keeps whole 2x2 groups
    chunks = [np.bincount(ids[ids > 0]) for ids in long]
    assert max(int(c.max(initial=0)) for c in chunks) > 0 and all((c % 4 == 0).all() for c in chunks)


def test_fsdp_cp_explicit_step(setup):
    """fsdp x cp runs the explicit per-device step (engine._manual_loss_and_grads): its own M-RoPE path."""
    _check(setup, "fsdp4xcp2", "edp8")


@pytest.mark.slow
def test_pipeline_with_encoders_interleaved(setup):
    _check(setup, "pp2xdp2xtp2", "edp4xesp2", interleave=True, microbatches=2)


def test_video_fps_travels_from_the_file_to_the_shard_metadata_and_the_rope_positions(tmp_path):
    """A clip's kept-frame rate (min(media.video_fps, the stream's rate), or frames spread over the clip when
    capped) is measured from the container's headers, kept in the record header and the shard's sidecar, and
    times the video's M-RoPE temporal positions; a clip slower than video_fps keeps its own rate."""
    import json

    from omnijax.config import MediaConfig
    from omnijax.data import media, records
    from omnijax.data.sources import JsonlSource

    frames = np.random.RandomState(0).rand(12, 16, 16, 3).astype(np.float32)
    media.write_video(tmp_path / "slow.mp4", frames, fps=1.0)   # 12 s at 1 fps: every frame kept, 1 fps
    media.write_video(tmp_path / "fast.mp4", frames, fps=8.0)   # 1.5 s at 8 fps: kept at video_fps=4
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"segments": [{"text": "a"}, {"video": name}]})
                                                for name in ("slow.mp4", "fast.mp4")) + "\n")
    src = JsonlSource("d", str(tmp_path / "d.jsonl"), media_cfg=MediaConfig(video_fps=4.0))
    metas = [src.meta(i) for i in range(2)]
    assert [m.segments[1].fps for m in metas] == [1.0, 4.0]
    assert [m.segments[1].shape[0] for m in metas] == [12, 6]
    samples = [src.get(i) for i in range(2)]
    assert [s.segments[1].fps for s in samples] == [1.0, 4.0] and samples[1].segments[1].data.shape[0] == 6
    records.write_shard(tmp_path / "s.arrayrecord", samples)
    table = records.MetaTable.load(str(tmp_path / "s.arrayrecord") + records.META_SUFFIX)
    assert [table.meta(i).segments[1].fps for i in range(2)] == [1.0, 4.0]
    assert records.read_meta(records.encode(samples[0])).segments[1].fps == 1.0
    cfg = encoder_config("vision", VISION)
    slow, fast = (qwen_processor.sample_rope_positions(m.segments, cfg) for m in metas)
    # 2 frames per temporal patch: 2 s at 1 fps, 0.5 s at 4 fps; x tokens_per_second (2) positions per second
    assert np.diff(np.unique(slow[1:, 0])).tolist() == [4] * 5 and np.diff(np.unique(fast[1:, 0])).tolist() == [1] * 2
