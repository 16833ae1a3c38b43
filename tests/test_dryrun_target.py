"""`recipes dryrun target=...`: the recipe's own step compiled for abstract NVIDIA GPUs on this CPU machine
(jax's deviceless compile, the `gpu` extra's CUDA plugin), and the kernel choice following the target."""
import json
import re

import jax
import jax.numpy as jnp
import pytest

from omnijax import targets
from omnijax.errors import UserError
from omnijax.layers import attention as attn

TINY = ["model.num_layers=2", "model.embed_dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32",
        "model.mlp_dim=128", "model.vocab_size=512", "model.max_seq_len=256", "data.seq_len=256", "data.batch_size=4",
        "trainer.compute_dtype=bfloat16", "parallel.llm=fsdp2"]


def test_targets_are_read_from_the_card_files():
    assert targets.parse_target("h100") == targets.Target("h100", 1, 1)
    assert targets.parse_target("h100x8") == targets.Target("h100", 8, 1)
    t = targets.parse_target("H200x64")
    assert (t.card, t.devices, t.hosts, t.per_host, t.name) == ("h200", 64, 8, 8, "h200x64")
    for bad in ("v100", "h100x12", "h100x", "h100x0"):
        with pytest.raises(UserError):
            targets.parse_target(bad)
    h100, a100 = targets.device_info("h100"), targets.device_info("a100")
    assert h100["device_memory_bytes"] == 84978434048 and h100["sm_count"] == 132 and h100["compute_capability"] == "9.0"
    assert a100["compute_capability"] == "8.0" and a100["sm_count"] == 108
    assert targets.device_info("h200")["device_memory_bytes"] > 140 * 2**30
    devs = targets.devices(targets.parse_target("h100x16"))
    assert len(devs) == 16 and {d.process_index for d in devs} == {0, 1} and devs[0].platform == "gpu"


def test_attention_kernel_follows_the_devices_compiled_for():
    """The same call traced on this CPU host picks blockwise for CPU devices and cuDNN for H100s: the choice
    is the target's, not jax.default_backend()'s."""
    q = jnp.zeros((1, 256, 2, 32), jnp.bfloat16)
    k = jnp.zeros((1, 256, 1, 32), jnp.bfloat16)
    seg = jnp.ones((1, 256), jnp.int32)
    pos = jnp.arange(256, dtype=jnp.int32)[None]

    def choice(devices):
        with attn.compiling_for(devices), attn.recording_kernels() as calls:
            jax.make_jaxpr(lambda q, k: attn.dot_product_attention(
                q, k, k, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos))(q, k)
        return [c["impl"] for c in calls]

    assert choice(jax.devices()) == ["blockwise"]
    assert choice(targets.devices(targets.parse_target("h100"))) == ["cudnn"]
    assert choice(targets.devices(targets.parse_target("a100"))) == ["cudnn"]  # one segment per row on Ampere


def test_tiny_step_compiled_for_two_h100s(capsys):
    """tiny_lm's own step (trainer jit, fsdp2 layout, bf16) for 2 x H100: the report's last line carries
    XLA's memory per device, the largest buffers, cuDNN attention in every layer and the fsdp collectives."""
    from recipes.dryrun import main

    assert main(["tiny_lm", "target=h100x2", *TINY]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out.strip().splitlines()[-1])
    assert (r["target"], r["devices"], r["layout"]) == ("h100x2", 2, "fsdp2")
    assert r["device_memory_bytes"] == targets.device_info("h100")["device_memory_bytes"]
    assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0
    assert r["peak_bytes_per_device"] == (r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"]
                                          + r["temp_bytes"] + r["generated_code_bytes"])
    assert r["fits"] is True and r["peak_bytes_per_device"] < 0.9 * r["device_memory_bytes"]
    # the state is sharded over fsdp2: each device holds about half of it (16 B/param, fp32 masters + Adam)
    assert r["alias_bytes"] > 0  # the donated state is updated in place
    sizes = [b["bytes"] for b in r["largest_buffers_detail"]]
    assert len(sizes) == 5 and sizes == sorted(sizes, reverse=True)
    assert all(re.fullmatch(r"[a-z0-9]+\[[0-9,]*\]", s) for s in r["largest_buffers"]), r["largest_buffers"]
    assert r["attention_kernels"] == {"cudnn": 2}  # two layers, each one cuDNN call
    assert r["cudnn_custom_calls"] == {"forward": 2, "backward": 2}
    assert r["collectives"].get("all-gather", {}).get("count", 0) > 0  # fsdp gathers its weights
    assert r["collective_bytes"] > 0
    assert r["xla_flops"] > 0 and r["model_flops_per_device"] > 0
    assert "analytic" in r and "compiled for 2 x NVIDIA H100" in out.err


def test_advice_names_the_setting_that_shrinks_the_buffer():
    from omnijax.train.dryrun import shrink_advice

    assert "vocabulary-chunked loss" in shrink_advice({"source": "jit(step)/jvp(lm_head)/dot_general",
                                                       "instruction": "fusion.3"})
    assert "remat" in shrink_advice({"source": "jit(step)/transpose(jvp(blockwise_attention))/dot_general",
                                     "instruction": "fusion.7"})
    assert "encoder" in shrink_advice({"source": "jit(step)/encoders/vision/dot_general", "instruction": "f"})


def test_attention_made_fully_manual_inside_a_pipeline_stage():
    """`manual_attention` (how a pipeline stage's attention reaches cuDNN: a nested shard_map manual over every
    other axis, its own backward) equals the plain call, output and gradients, under pp2xfsdp2xtp2."""
    from jax.sharding import PartitionSpec as P

    from omnijax.parallel import rules as rules_lib
    from omnijax.parallel.mesh import make_mesh
    from omnijax.parallel.stage_attention import manual_attention

    mesh, rules = make_mesh("pp2xfsdp2xtp2", jax.devices()[:8]), rules_lib.load_rules("llm_5d")
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 4, 32, 4, 16), jnp.float32)  # [stage, B, L, H, Dh]
    k, v = (jax.random.normal(kk, (2, 4, 32, 2, 16), jnp.float32) for kk in keys[1:])
    seg = jnp.broadcast_to(jnp.repeat(jnp.arange(1, 3), 16), (4, 32))
    pos = jnp.broadcast_to(jnp.tile(jnp.arange(16), 2), (4, 32))

    def plain(q, k, v):
        return attn.dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                          kv_positions=pos, impl="reference")

    def staged(q, k, v):
        def body(q, k, v):
            out = manual_attention(q[0], k[0], v[0], seg, pos, mesh=mesh, rules=rules, impl="reference")
            assert out is not None
            return out[None]
        return jax.shard_map(body, mesh=mesh, in_specs=P("pp"), out_specs=P("pp"), axis_names={"pp"})(q, k, v)

    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    want = jax.value_and_grad(loss(jax.vmap(plain)), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.value_and_grad(loss(staged), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_estimate_counts_the_expert_dispatch_buffers():
    """MoE layers hold dispatch/combine [rows, T, E, C] and the all-to-all's slot buffers [rows, E, C, D] (x4 with
    ep): every MoE layer's without remat, the recomputed one's under remat=full, none for a dense model."""
    from omnijax.config import LLMConfig, MoEConfig
    from omnijax.parallel.mesh import parse_layout
    from omnijax.train.dryrun import moe_dispatch_bytes

    moe = LLMConfig(embed_dim=256, num_layers=4, moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25, every=2))
    lay = parse_layout("fsdp2xep2", 4)
    rows, T, E, C = 8 // 4, 2048, 8, 640  # C = ceil(1.25 x 2048 x 2 / 8)
    one = 2 * rows * T * E * C * 2 + 4 * rows * E * C * 256 * 2
    assert moe_dispatch_bytes(moe, lay, 8, T, "full", 2) == one
    assert moe_dispatch_bytes(moe, lay, 8, T, "none", 2) == 2 * one  # layers 0 and 2
    assert moe_dispatch_bytes(LLMConfig(embed_dim=256, num_layers=4), lay, 8, T, "none", 2) == 0


def test_m_rope_step_is_compiled_with_each_tokens_positions():
    """An M-RoPE LLM (Qwen2.5-VL) trains on batches that carry `rope_positions` [B, L, 3]; the dryrun's abstract
    batch carries them too, laid out like the tokens, so the step compiled is the M-RoPE one (a plain LLM's
    batch has none)."""
    from recipes.dryrun import _llm_batch, _load_multimodal, _multimodal_parts

    tiny = ["model.llm.num_layers=2", "model.llm.embed_dim=64", "model.llm.num_heads=2", "model.llm.num_kv_heads=1",
            "model.llm.head_dim=32", "model.llm.mlp_dim=128", "model.llm.vocab_size=512", "model.llm.max_seq_len=256",
            "model.llm.rope.mrope_section=[4,6,6]", "model.encoders.vision.embed_dim=32",
            "model.encoders.vision.num_layers=2", "model.encoders.vision.num_heads=2",
            "model.encoders.vision.mlp_dim=64", "model.encoders.vision.out_dim=64",
            "model.encoders.vision.fullatt_block_indexes=[1]", "capacity.vision=256", "data.seq_len=256",
            "data.batch_size=4", "parallel.llm=fsdp2", "parallel.encoder=edp2"]
    cfg = _load_multimodal("finetune_qwen2_5_vl_7b", tiny)
    _, _, placement, _ = _multimodal_parts(cfg, targets.devices(targets.parse_target("h100x2")))
    batch = _llm_batch(placement.engine, cfg.model.llm, 4, 256)
    rope, tokens = batch["rope_positions"], batch["tokens"]
    assert rope.shape == (4, 256, 3) and rope.dtype == jnp.int32
    assert rope.sharding.spec[:2] == tokens.sharding.spec[:2] and rope.sharding.mesh == tokens.sharding.mesh
    cfg.model.llm.rope.mrope_section = []
    assert "rope_positions" not in _llm_batch(placement.engine, cfg.model.llm, 4, 256)
