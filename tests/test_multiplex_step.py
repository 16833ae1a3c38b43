"""The joint multimodal step (encoders + resharding + LLM layout) equals the single-device reference,
and decoupled placement really spreads encoder work while the coupled baseline concentrates it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import from_dict
from omnijax.data.world import Tail, World, WorldConfig
from omnijax.models import mllm
from omnijax.mm_config import MMConfig
from omnijax.parallel.engine import LLMParallel, unstack_params
from omnijax.parallel.multiplex import EncoderPart, Multiplexer
from omnijax.train.step import loss_and_grads
from omnijax.data.packing import SamplePacker as Packer
from numerics import assert_grads_close

ENCODERS = {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 32, "embed_dim": 32,
                       "num_layers": 1, "num_heads": 2, "mlp_dim": 64},
            "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 32, "num_layers": 1, "num_heads": 2,
                      "mlp_dim": 64}}
LLM = {"vocab_size": 512, "embed_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
       "mlp_dim": 128, "max_seq_len": 64}
WORLD = WorldConfig(image_side=Tail(16, 32, 1.3), video_side=Tail(16, 24, 1.5), video_frames=Tail(2, 4, 1.2),
                    audio_items=Tail(1, 3, 1.2), text_words=Tail(2, 8, 1.0))


def _setup(moe: bool):
    llm = dict(LLM, moe={"num_experts": 4, "top_k": 2, "mlp_dim": 64, "every": 1, "capacity_factor": 8.0}) if moe else LLM
    cfg = from_dict(MMConfig, {"llm": llm, "encoders": ENCODERS})
    batch, _ = Packer(cfg, 8, 64, {"vision": 512, "audio": 256}).pack(World(WORLD).sample(i) for i in range(80))
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    g, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(g, rest, mllm.mm_loss, p, b))(
        params, {k: jnp.asarray(v) for k, v in batch.items()})
    return cfg, batch, model, float(loss), nnx.to_pure_dict(grads)


@pytest.fixture(scope="module")
def dense():
    return _setup(moe=False)


@pytest.fixture(scope="module")
def moe():
    return _setup(moe=True)


def _check(setup, layout, encoder_layout, mode="balanced", interleave=False, **engine_kw):
    cfg, batch, model, ref_loss, ref_grads = setup
    engine = LLMParallel(layout, cfg.llm, **engine_kw)
    mx = Multiplexer(engine, cfg, encoder_layout=encoder_layout, mode=mode, interleave=interleave)
    g, params, rest = nnx.split(mx.prepare(model), nnx.Param, ...)
    params = mx.put_state(params)
    for enc_leaf in jax.tree.leaves(params["encoders"]):  # encoder rules (encoder_dp): replicated
        assert enc_leaf.sharding.is_fully_replicated
    if "fsdp" in layout:  # LLM rules: the embedding table is split over fsdp
        assert not params["llm"]["embedding"].get_value().sharding.is_fully_replicated
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(g, rest, mx.loss_fn, p, b))(params, mx.put_batch(batch))
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (float(loss), ref_loss)
    got = nnx.to_pure_dict(grads)
    if engine.schedule is not None:
        got["llm"] = unstack_params(grads["llm"], engine.schedule)
    assert_grads_close(got, ref_grads)
    return mx.last_plan


@pytest.mark.slow
def test_pp2_dp2_tp2_with_long_short_encoders(dense):
    """Pipelined LLM: encoders run inside the pipeline loop, one microbatch ahead (interleaved)."""
    plan = _check(dense, "pp2xdp2xtp2", "edp4xesp2", interleave=True, microbatches=2)
    assert plan.stats["long_segments"] > 0  # sequence-parallel path exercised
    assert plan.arrays["route_send"].ndim == 4  # [devices, microbatches, devices, capacity]
    # second-stage devices encode too (their encoder gradients cross the pipeline's shard_map)
    busy = sum((v > 0).any(axis=(1, 2)) for k, v in plan.arrays.items() if k.endswith("segment_ids"))
    assert busy[4:].any() and busy[:4].any(), busy


def test_fsdp4_cp2_with_edp8(dense):
    _check(dense, "fsdp4xcp2", "edp8")


def test_coupled_baseline_is_also_exact(dense):
    """Coupled placement, with the encoders as a phase before the pipeline (interleave off)."""
    plan = _check(dense, "pp2xdp2xtp2", "edp4xesp2", mode="coupled", interleave=False)
    assert plan.stats["redundant_enc_cost"] == 0  # stage 0's tp ranks split the work, none repeats it
    assert plan.arrays["route_send"].ndim == 3


def test_moe_layout_dp2_tp2_ep2(moe):
    _check(moe, "dp2xtp2xep2", "edp4xesp2")


def test_encoder_flops_per_device_spread_vs_coupled(dense):
    """Per-device encoder FLOPs of the compiled program: decoupled ~ total/devices, coupled concentrated."""
    cfg, _, model, _, _ = dense
    many_small = WorldConfig(weights={"image": 0.5, "audio": 0.5}, image_side=Tail(16, 24, 2.0),
                             audio_items=Tail(1, 2, 2.0), text_words=Tail(1, 3, 2.0))
    batch, _ = Packer(cfg, 8, 256, {"vision": 2048, "audio": 1024}).pack(World(many_small).sample(i) for i in range(400))
    flops, stats = {}, {}
    for mode in ("balanced", "coupled"):
        engine = LLMParallel("pp2xdp2xtp2", cfg.llm)
        mx = Multiplexer(engine, cfg, encoder_layout="edp4xesp2", mode=mode, long_short=False, interleave=False)
        dev = mx.put_batch(batch)
        part = EncoderPart(model.encoders, model.projectors)
        x = jax.device_put(jnp.zeros((8, 256, cfg.llm.embed_dim)), engine.activation("batch", "seq", "embed"))
        compiled = jax.jit(lambda x, b: mx.inject(part, x, b)).lower(x, dev).compile()
        flops[mode], stats[mode] = compiled.cost_analysis()["flops"], mx.last_plan.stats
    assert stats["balanced"]["segments"] >= 24
    assert stats["balanced"]["enc_cost_max_over_mean"] < 1.3 < stats["coupled"]["enc_cost_max_over_mean"]
    assert flops["coupled"] > 2.0 * flops["balanced"], flops
