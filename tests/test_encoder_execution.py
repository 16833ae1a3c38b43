"""Execution settings reach the encoders: trainer.compute_dtype (bf16 matmuls in encoders, projectors,
routed outputs and the LLM, fp32 masters) and parallel.remat (encoder blocks recomputed, same numbers);
and the MoE load-balancing loss's gradient under expert parallelism equals one device's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import LLMConfig, MoEConfig, from_dict
from omnijax.data.world import Tail, World, WorldConfig
from omnijax.errors import ConfigError
from omnijax.layers import remat
from omnijax.mm_config import MMConfig
from omnijax.models import mllm
from omnijax.models.llm import LLM
from omnijax.models.losses import lm_loss
from omnijax.models.objective import cast_floating
from omnijax.parallel.engine import LLMParallel
from omnijax.parallel.multiplex import Multiplexer
from omnijax.train.step import loss_and_grads
from omnijax.data.packing import SamplePacker as Packer

MM = {"llm": {"vocab_size": 512, "embed_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16,
              "mlp_dim": 64, "max_seq_len": 64},
      "encoders": {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 32,
                              "abs_position": True, "embed_dim": 32, "num_layers": 2, "num_heads": 2, "mlp_dim": 64},
                   "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 32, "num_layers": 2,
                             "num_heads": 2, "mlp_dim": 64}}}
WORLD = WorldConfig(image_side=Tail(16, 32, 1.3), video_side=Tail(16, 24, 1.5), video_frames=Tail(2, 4, 1.2),
                    audio_items=Tail(1, 3, 1.2), text_words=Tail(2, 8, 1.0))


@pytest.fixture(scope="module")
def setup():
    cfg = from_dict(MMConfig, MM)
    batch, _ = Packer(cfg, 8, 64, {"vision": 256, "audio": 256}).pack(World(WORLD).sample(i) for i in range(60))
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    return cfg, {k: jnp.asarray(v) for k, v in batch.items()}, model


def _eqns(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs (shard_map, cond, checkpoint, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _dots(closed) -> list[tuple[str, str, tuple]]:
    """(lhs dtype, rhs dtype, lhs shape) of every dot_general."""
    return [(str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype), tuple(e.invars[0].aval.shape))
            for e in _eqns(closed.jaxpr) if e.primitive.name == "dot_general"]


def _weight_dots(closed, widths: set[int]) -> list[tuple[str, str]]:
    """dtypes of the dot_generals that contract a model width (the layers' matmuls; rotary angle
    tables contract the 1-3 position axes and stay float32 by design)."""
    out = []
    for e in _eqns(closed.jaxpr):
        if e.primitive.name != "dot_general":
            continue
        (lc, _), _ = e.params["dimension_numbers"]
        if any(e.invars[0].aval.shape[d] in widths for d in lc):
            out.append((str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype)))
    return out


WIDTHS = {32, 64, 16 * 4 * 2 * 3}  # embed / mlp widths of the model, the vision patch row width


@pytest.mark.parametrize("placement", ["single", "multiplexed"])
def test_bf16_compute_reaches_encoders_projectors_and_llm(setup, placement):
    """With compute_dtype=bfloat16 every forward layer matmul (encoders, projectors, LLM) takes bf16
    operands, as the objective casts the params; with float32 none does (so the check is not vacuous);
    the gradients stay float32 (the masters')."""
    cfg, batch, model = setup
    if placement == "single":
        loss_fn, m, b = mllm.mm_loss, model, batch
    else:
        mx = Multiplexer(LLMParallel("dp4xtp2", cfg.llm), cfg, encoder_layout="edp4xesp2")
        loss_fn, m = mx.loss_fn, mx.prepare(model)
        b = mx.put_batch({k: np.asarray(v) for k, v in batch.items()})
    g, params, rest = nnx.split(m, nnx.Param, ...)
    for dtype in (jnp.bfloat16, jnp.float32):
        forward = lambda p, bb: loss_fn(nnx.merge(g, cast_floating(p, dtype), rest), bb)[0]  # noqa: E731
        dots = _weight_dots(jax.make_jaxpr(forward)(params, b), WIDTHS)
        assert len(dots) >= 20, dots  # vision, audio, projectors and the LLM
        want = "bfloat16" if dtype == jnp.bfloat16 else "float32"
        assert all(lhs == rhs == want for lhs, rhs in dots), [d for d in dots if d != (want, want)]
        grads = jax.tree.leaves(jax.eval_shape(lambda p, bb: loss_and_grads(g, rest, loss_fn, p, bb,
                                                                              compute_dtype=dtype)[1], params, b))
        assert {str(x.dtype) for x in grads} == {"float32"}


def test_encoder_blocks_bf16_forward_close_to_fp32(setup):
    """bf16 encoders compute the fp32 features to bf16 accuracy (not garbage, not silently fp32)."""
    cfg, batch, model = setup
    g, params, rest = nnx.split(model, nnx.Param, ...)
    enc = lambda p: nnx.merge(g, p, rest).encode("vision", batch)  # noqa: E731
    f32 = np.asarray(jax.jit(enc)(params))
    bf = jax.jit(lambda p: enc(cast_floating(p, jnp.bfloat16)))(params)
    assert bf.dtype == jnp.bfloat16
    err = np.abs(np.asarray(bf, np.float32) - f32).max() / np.abs(f32).max()
    assert 1e-5 < err < 5e-2, err


def test_remat_modes_parse_like_parallel_remat():
    assert [remat.parse_remat(v) for v in (False, True, "none", "FULL", "save_dots")] == \
        ["none", "full", "none", "full", "save_dots"]
    with pytest.raises(ConfigError, match="parallel.remat"):
        remat.parse_remat("some")


def _remat_count(jaxpr) -> int:
    return sum(e.primitive.name in ("checkpoint", "remat", "remat2") for e in _eqns(jaxpr))


def test_remat_full_recomputes_encoder_blocks_with_equal_numbers(setup):
    """parallel.remat reaches the encoder blocks (one checkpoint per block, in the multiplexed step and
    under use_remat on one device) and leaves loss and gradients as they were."""
    cfg, batch, model = setup
    g, params, rest = nnx.split(model, nnx.Param, ...)
    blocks = sum(c["num_layers"] for c in MM["encoders"].values())
    layers = blocks + MM["llm"]["num_layers"]   # on one device use_remat reaches the LLM's layers too
    counts, results = {}, {}
    for mode in ("none", "full", "save_dots"):
        # a fresh function per mode: jax caches traces by function, and the mode is read while tracing
        fn = lambda p, b: loss_and_grads(g, rest, mllm.mm_loss, p, b)  # noqa: E731
        with remat.use_remat(mode):
            counts[mode] = _remat_count(jax.make_jaxpr(fn)(params, batch).jaxpr)
            if mode != "save_dots":
                results[mode] = jax.jit(fn)(params, batch)
    assert counts == {"none": 0, "full": layers, "save_dots": layers}, counts
    (l0, g0, _), (l1, g1, _) = results["none"], results["full"]
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    # the multiplexer takes the setting from the engine's parallel.remat
    for value, want in ((True, blocks), ("none", 0)):
        mx = Multiplexer(LLMParallel("dp8", cfg.llm, remat=value), cfg)
        gm, pm, rm = nnx.split(mx.prepare(model), nnx.Param, ...)
        b = mx.put_batch({k: np.asarray(v) for k, v in batch.items()})
        closed = jax.make_jaxpr(lambda p, bb: loss_and_grads(gm, rm, mx.loss_fn, p, bb))(pm, b)
        enc = sum(_remat_count(e.params["jaxpr"]) for e in _eqns(closed.jaxpr) if e.primitive.name == "shard_map")
        assert enc == want, (value, enc)


# --------------------------------------------------------------- MoE load balancing under expert parallelism
MOE = LLMConfig(vocab_size=128, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                moe=MoEConfig(num_experts=4, top_k=2, mlp_dim=64, capacity_factor=1.0, every=1))


def _lb_only(loss_fn):
    """The objective reduced to the load-balancing loss (the cross entropy weighted 0)."""
    def fn(model, batch):
        loss_sum, count, aux = loss_fn(model, batch)
        return 0.0 * loss_sum, count, aux
    return fn


def test_moe_load_balancing_gradient_under_expert_parallelism():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (8, 32)).astype(np.int32)
    seg = np.ones((8, 32), np.int32)
    seg[:, 20:] = 2
    seg[0, -5:] = 0
    pos = np.concatenate([np.arange(20), np.arange(12)])[None].repeat(8, 0).astype(np.int32)
    batch = dict(tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=seg, positions=pos,
                 loss_mask=(seg > 0).astype(np.float32))
    model = LLM(MOE, rngs=nnx.Rngs(0))
    g, params, rest = nnx.split(model, nnx.Param, ...)
    weights = {"moe_lb_loss": 1.0}
    ref, ref_lb = jax.jit(lambda p, b: loss_and_grads(g, rest, _lb_only(lm_loss), p, b, aux_weights=weights)[1:])(
        params, {k: jnp.asarray(v) for k, v in batch.items()})
    ref = nnx.to_pure_dict(ref)
    router = [np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(ref)[0] if "router" in jax.tree_util.keystr(p)]
    assert router and max(np.abs(r).max() for r in router) > 1e-6  # the lb loss does move the router
    par = LLMParallel("ep4xdp2", MOE)
    gp, pp, rp = nnx.split(par.prepare(model), nnx.Param, ...)
    pp = jax.device_put(pp, par.state_shardings(pp))
    got, got_lb = jax.jit(lambda p, b: loss_and_grads(gp, rp, _lb_only(par.loss_fn), p, b, aux_weights=weights)[1:])(
        pp, par.put_batch(batch))
    np.testing.assert_allclose(float(got_lb["moe_lb_loss"]), float(ref_lb["moe_lb_loss"]), rtol=1e-5)
    got = nnx.to_pure_dict(jax.device_get(got))
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    assert flat_ref.keys() == flat_got.keys()
    for path, r in flat_ref.items():
        np.testing.assert_allclose(np.asarray(flat_got[path]), np.asarray(r), rtol=0,
                                   atol=1e-5 * max(1.0, float(np.abs(r).max())), err_msg=jax.tree_util.keystr(path))
