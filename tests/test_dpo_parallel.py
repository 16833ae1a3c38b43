"""DPO on the trainer's joint (multiplexed) step and under gradient accumulation: the step-1 loss, metrics and
gradients equal the single-device reference (1e-5 relative) on a batch of the world's image/video/audio pairs
twice the recipe's default rows, with both references (the model with its adapters off, and the log-probabilities
precomputed and carried as `ref_logps`); a pair's two answers stay in one row on one batch shard; the chunked head
gives the full logits' log-probabilities and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from numerics import assert_grads_close
from omnijax.config import LLMConfig, LoraConfig, from_dict
from omnijax.data.packing import SamplePacker
from omnijax.data.world import Tail, World, WorldConfig
from omnijax.mm_config import MMConfig
from omnijax.models import adapters, mllm, preference
from omnijax.models.objective import loss_and_grads
from omnijax.parallel.engine import LLMParallel
from omnijax.parallel.multiplex import Multiplexer

ENCODERS = {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 32, "embed_dim": 32,
                       "num_layers": 1, "num_heads": 2, "mlp_dim": 64},
            "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 32, "num_layers": 1, "num_heads": 2,
                      "mlp_dim": 64}}
LLM = {"vocab_size": 512, "embed_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
       "mlp_dim": 128, "max_seq_len": 128, "loss_chunk": 32}   # chunked head: 4 chunks a row
WORLD = WorldConfig(image_side=Tail(16, 32, 1.3), video_side=Tail(16, 24, 1.5), video_frames=Tail(2, 4, 1.2),
                    audio_items=Tail(1, 3, 1.2), text_words=Tail(2, 6, 1.0), pairs=True)
ROWS, SEQ, BETA, RPO = 16, 128, 0.3, 0.5   # 16 rows: twice recipes/configs/dpo.yaml's data.batch_size
DPO_KEYS = ("dpo_reward_chosen", "dpo_reward_rejected", "dpo_reward_margin", "dpo_accuracy", "dpo_logps_chosen",
            "dpo_logps_rejected", "dpo_pairs", "dpo_nll_chosen")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def setup():
    """(config, adapted model with random adapters (a policy away from its reference), host batch with the
    reference's `ref_logps`, the single-device (loss, grads, aux) of each reference mode)."""
    cfg = from_dict(MMConfig, {"llm": LLM, "encoders": ENCODERS})
    world = World(WORLD)
    batch, _ = SamplePacker(cfg, ROWS, SEQ, {"vision": 1024, "audio": 512}).pack(world.sample(i) for i in range(200))
    assert int(preference.global_counts({k: jnp.asarray(batch[k]) for k in ("loss_mask", "pref_index")})["count"]) >= 12
    model = adapters.adapt(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0))
    keys = iter(jax.random.split(jax.random.key(1), 256))
    for path, var in nnx.iter_graph(model):  # adapters away from zero: the policy is not its reference
        if isinstance(var, nnx.Param) and adapters.is_adapter(path):
            var.set_value(0.05 * jax.random.normal(next(keys), var.get_value().shape))
    g, params, rest = nnx.split(model, nnx.Param, ...)
    device = {k: jnp.asarray(v) for k, v in batch.items()}
    ref_logps = jax.jit(lambda p, b: preference.reference_logps(nnx.merge(g, p, rest), b))(params, device)
    batch = {**batch, "ref_logps": np.asarray(ref_logps)}
    loss_fn = preference.dpo_loss(BETA, rpo_alpha=RPO)
    step = jax.jit(lambda p, b: loss_and_grads(g, rest, loss_fn, p, b))
    refs = {}
    for mode in ("adapters", "precompute"):
        b = {k: jnp.asarray(v) for k, v in _mode(batch, mode).items()}
        loss, grads, aux = step(params, b)
        refs[mode] = (float(loss), nnx.to_pure_dict(grads), {k: float(v) for k, v in aux.items()})
    return cfg, model, batch, refs


def _mode(batch: dict, mode: str) -> dict:
    return batch if mode == "precompute" else {k: v for k, v in batch.items() if k != "ref_logps"}


def _assert_same(got: tuple, want: tuple) -> None:
    loss, grads, aux = got
    assert _rel(float(loss), want[0]) <= 1e-5, (float(loss), want[0])
    for k in DPO_KEYS:
        assert abs(float(aux[k]) - want[2][k]) <= 1e-5 * max(1.0, abs(want[2][k])), (k, float(aux[k]), want[2][k])
    assert_grads_close(grads, want[1], rel=1e-5)


def test_reference_modes_agree_and_train(setup):
    """Both references give the same loss (the precomputed table is the adapters-off forward), the loss is
    the mean over pairs (not ln 2: the policy has moved), and gradients reach the LLM and the encoders."""
    _, _, _, refs = setup
    assert _rel(refs["precompute"][0], refs["adapters"][0]) <= 1e-5
    assert abs(refs["adapters"][0] - RPO * refs["adapters"][2]["dpo_nll_chosen"] - np.log(2)) > 1e-3
    grads = refs["adapters"][1]
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(grads["encoders"]))


@pytest.fixture(scope="module")
def joint(setup):
    """The joint step on fsdp2 x dp2 x tp2 with encoders on edp4 x esp2 (sequence-parallel long segments)."""
    cfg, model, _, _ = setup
    mx = Multiplexer(LLMParallel("fsdp2xdp2xtp2", cfg.llm), cfg, encoder_layout="edp4xesp2", balance_rows=False)
    g, params, rest = nnx.split(mx.prepare(model), nnx.Param, ...)
    logps_fn = preference.hidden_logps(lambda m, b: (mx.hidden_states(m, b)[0], m.llm))
    loss_fn = preference.dpo_loss(BETA, rpo_alpha=RPO, logps_fn=logps_fn)
    return mx, g, mx.put_state(params), rest, jax.jit(lambda p, b: loss_and_grads(g, rest, loss_fn, p, b))


@pytest.mark.parametrize("mode", ["adapters", "precompute"])
def test_joint_step_equals_single_device(setup, joint, mode):
    cfg, _, batch, refs = setup
    mx, g, params, rest, step = joint
    placed = mx.put_batch(_mode(batch, mode))
    assert ("ref_logps" in placed) == (mode == "precompute")  # carried with the rows like the tokens
    for shard in placed["pref_index"].addressable_shards:  # every pair's two answers in one row of one shard
        for row in np.asarray(shard.data):
            slots = set(row[row > 0].tolist())
            assert all((s + 1 if s % 2 else s - 1) in slots for s in slots)
    assert mx.last_plan.stats["long_segments"] > 0  # the sequence-parallel encoder path ran
    loss, grads, aux = step(params, placed)
    _assert_same((loss, nnx.to_pure_dict(grads), aux), refs[mode])


@pytest.mark.slow
def test_pipelined_joint_step_equals_single_device(setup):
    """pp2 x dp2 x tp2, the encoders interleaved with the pipeline's microbatches: the head reads the last stage's
    hidden states; both references give one device's loss and gradients."""
    from omnijax.parallel.engine import unstack_params

    cfg, model, batch, refs = setup
    engine = LLMParallel("pp2xdp2xtp2", cfg.llm, microbatches=2)
    mx = Multiplexer(engine, cfg, encoder_layout="edp4xesp2", interleave=True, balance_rows=False)
    g, params, rest = nnx.split(mx.prepare(model), nnx.Param, ...)
    logps_fn = preference.hidden_logps(lambda m, b: (mx.hidden_states(m, b)[0], m.llm))
    step = jax.jit(lambda p, b: loss_and_grads(g, rest, preference.dpo_loss(BETA, rpo_alpha=RPO, logps_fn=logps_fn),
                                               p, b))
    params = mx.put_state(params)
    for mode in ("adapters", "precompute"):
        loss, grads, aux = step(params, mx.put_batch(_mode(batch, mode)))
        got = nnx.to_pure_dict(grads)
        got["llm"] = unstack_params(grads["llm"], engine.schedule)
        _assert_same((loss, got, aux), refs[mode])


@pytest.mark.parametrize("accum", [2, 4])
def test_grad_accum_gives_the_whole_batch(setup, accum):
    """trainer.grad_accum: the microbatches' pair sums over the step's pair count (and the RPO term over its
    chosen tokens) give grad_accum=1's loss, metrics and gradients; the encoder buffers reach every
    microbatch and each keeps its own rows' outputs."""
    _, model, batch, refs = setup
    g, params, rest = nnx.split(model, nnx.Param, ...)
    b = {k: jnp.asarray(v) for k, v in _mode(batch, "precompute").items()}
    loss_fn = preference.dpo_loss(BETA, rpo_alpha=RPO)
    got = jax.jit(lambda p, b: loss_and_grads(g, rest, loss_fn, p, b, grad_accum=accum))(params, b)
    _assert_same((got[0], nnx.to_pure_dict(got[1]), got[2]), refs["precompute"])


def test_chunked_head_equals_full_logits():
    """`head_logps` (one chunk of logits at a time, loss positions compacted, chunks without any skipped) gives
    the full logits' per-token log-probabilities and the same gradients w.r.t. the states and the head."""
    from omnijax.models.llm import LLM as TextLLM

    llm = TextLLM(from_dict(LLMConfig, {**LLM, "vocab_size": 97}), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(3, 40, 64)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 97, (3, 40)), jnp.int32)
    mask = np.zeros((3, 40), np.float32)
    mask[0, 5:12], mask[1, 30:], mask[2, ::3] = 1, 1, 1   # row 2 spreads its loss over the whole row
    weights = jnp.asarray(rng.normal(size=(3, 40)), jnp.float32)
    g, p = nnx.split(llm, nnx.Param)

    def f(p, h, chunk):
        return jnp.sum(preference.head_logps(nnx.merge(g, p), h, targets, jnp.asarray(mask), chunk) * weights)
    full, (gp_full, gh_full) = jax.value_and_grad(f, argnums=(0, 1))(p, h, 0)
    for chunk in (8, 16):
        val, (gp, gh) = jax.value_and_grad(f, argnums=(0, 1))(p, h, chunk)
        assert _rel(float(val), float(full)) <= 1e-5
        assert_grads_close(nnx.to_pure_dict(gp), nnx.to_pure_dict(gp_full), rel=1e-5)
        np.testing.assert_allclose(np.asarray(gh), np.asarray(gh_full), atol=1e-5 * float(jnp.abs(gh_full).max()))
    lp = preference.head_logps(llm, h, targets, jnp.asarray(mask), 8)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(preference.token_logps(llm.logits(h), targets, mask)),
                               atol=1e-5)
    assert np.all(np.asarray(lp)[mask == 0] == 0)


def test_grad_accum_of_a_multimodal_sft_batch(setup):
    """The microbatch split itself (any loss): next-token CE of the multimodal model on the same batch, whose
    encoder outputs land in rows of every microbatch, equals grad_accum=1 (the split used to cut the encoder
    buffers by rows and scatter their outputs to the wrong positions)."""
    _, model, batch, _ = setup
    g, params, rest = nnx.split(model, nnx.Param, ...)
    b = {k: jnp.asarray(v) for k, v in batch.items() if k not in ("pref_index", "ref_logps")}
    assert any(int((b[k] >= 0).sum()) for k in b if k.endswith("_dest"))
    one, two = (jax.jit(lambda p, b, n=n: loss_and_grads(g, rest, mllm.mm_loss, p, b, grad_accum=n))(params, b)
                for n in (1, 2))
    assert _rel(float(two[0]), float(one[0])) <= 1e-5
    assert_grads_close(nnx.to_pure_dict(two[1]), nnx.to_pure_dict(one[1]), rel=1e-5)


def test_chunked_head_holds_no_full_logits():
    """The compiled DPO step's temporary memory with the chunked head is a fraction of the full logits' (4 rows
    x 256 tokens x 32k vocabulary: the [B, L, V] float32 logits alone are 128 MiB); `-s` prints both."""
    from omnijax.models.llm import LLM as TextLLM

    b, l, v = 4, 256, 32768
    rng = np.random.default_rng(0)
    seg = np.repeat(np.arange(1, 9), l // 8)[None].repeat(b, 0).astype(np.int32)   # 4 pairs a row (slots 0..3)
    pos = np.tile(np.arange(l // 8), 8)[None].repeat(b, 0).astype(np.int32)
    tokens = rng.integers(0, v, (b, l)).astype(np.int32)
    batch = {k: jnp.asarray(x) for k, x in dict(tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=seg,
                                                  positions=pos, loss_mask=(pos >= 16).astype(np.float32),
                                                  pref_index=seg).items()}
    temp, losses = {}, {}
    for chunk in (0, 32):
        cfg = from_dict(LLMConfig, {**LLM, "vocab_size": v, "max_seq_len": l, "loss_chunk": chunk})
        g, p, r = nnx.split(adapters.adapt(TextLLM(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0)),
                            nnx.Param, ...)
        compiled = jax.jit(lambda p, b: loss_and_grads(g, r, preference.dpo_loss(BETA), p, b)[:2]).lower(
            p, batch).compile()
        temp[chunk] = compiled.memory_analysis().temp_size_in_bytes
        losses[chunk] = float(compiled(p, batch)[0])
    print(f"DPO step temp memory: full logits {temp[0] / 2**20:.0f} MiB, loss_chunk=32 {temp[32] / 2**20:.0f} MiB")
    assert _rel(losses[32], losses[0]) <= 1e-5
    assert temp[32] < 0.5 * temp[0] and temp[0] >= b * l * v * 4  # the full path holds the logits at least once
