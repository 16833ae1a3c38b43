"""Attention implementations against the dense reference: blockwise (flash) forward, lse and gradients
(including an lse cotangent, as ring attention's merge produces), block skipping, the cuDNN layout
analysis and dispatch, and the model-level call sites (LLM, encoders, ring/all-gather CP, Ulysses SP,
pipeline) with blockwise chosen explicitly."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax  # noqa: F401  (imported by the engine's users; keeps import order as in the trainer)
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import omnijax  # noqa: F401
from omnijax.config import LLMConfig
from omnijax.errors import ConfigError
from omnijax.layers import attention as attn
from omnijax.layers.flash import blockwise_attention, executed_blocks, visible_blocks
from numerics import assert_grads_close

BQ, BK = 16, 32  # small blocks so short test buffers span many blocks (and lengths are not multiples)


def _packed(b: int, n: int, rng: np.random.Generator, pad: int = 7):
    """Rows of random documents (crossing block edges), padding (segment 0) at the end, in the middle
    of row 1 too, and a last row of padding only; positions restart at 0 in every document."""
    seg = np.zeros((b, n), np.int32)
    pos = np.zeros((b, n), np.int32)
    for r in range(b - 1):
        i, s = 0, 1
        while i < n - pad:
            m = int(min(rng.integers(5, 40), n - pad - i))
            seg[r, i:i + m], pos[r, i:i + m] = s, np.arange(m)
            i += m
            s += 1
            if r == 1 and s == 3:  # a padding gap inside the row
                i += 3
    return seg, pos


def _qkv(b, lq, lk, h, kvh, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, lq, h, d)).astype(dtype), jax.random.normal(ks[1], (b, lk, kvh, d)).astype(dtype),
            jax.random.normal(ks[2], (b, lk, kvh, d)).astype(dtype))


def _loss(fn, r1, r2):
    """sum(out*r1) + sum(lse*r2) over finite lse: a random cotangent on both outputs."""
    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * r1) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * r2, 0.0))
    return loss


def _compare(q, k, v, kw, *, atol, rtol=0.0, seed=1):
    ref = functools.partial(attn.reference_attention, return_lse=True, **kw)
    blk = functools.partial(blockwise_attention, block_q=BQ, block_k=BK, **kw)
    r1 = jax.random.normal(jax.random.key(seed), q.shape)
    r2 = jax.random.normal(jax.random.key(seed + 1), q.shape[:3])
    both = lambda fn: jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(_loss(fn, r1, r2), argnums=(0, 1, 2))(q, k, v)))  # noqa: E731
    ((o1, l1), g1), ((o2, l2), g2) = both(ref)(q, k, v), both(blk)(q, k, v)
    o1, o2 = np.asarray(o1, np.float32), np.asarray(o2, np.float32)
    np.testing.assert_allclose(o2, o1, atol=atol, rtol=rtol)
    l1, l2 = np.asarray(l1), np.asarray(l2)
    np.testing.assert_array_equal(np.isneginf(l2), np.isneginf(l1))  # rows with no key: -inf in both
    fin = np.isfinite(l1)
    np.testing.assert_allclose(l2[fin], l1[fin], atol=atol, rtol=rtol)
    assert np.all(o2[np.isneginf(l2)] == 0)
    for a, b in zip(g1, g2):
        b = np.asarray(b, np.float32)
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, np.asarray(a, np.float32), atol=atol, rtol=rtol)
    return l1


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_matches_reference_fp32(causal):
    """GQA, documents crossing block edges, padding (end, middle, a whole row), 100 rows (not a block
    multiple)."""
    rng = np.random.default_rng(0)
    seg, pos = _packed(3, 100, rng)
    q, k, v = _qkv(3, 100, 100, 4, 2, 8, jnp.float32)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=causal)
    lse = _compare(q, k, v, kw, atol=1e-5)
    assert np.isneginf(lse[2]).all() and np.isneginf(lse[1]).any() and np.isfinite(lse).any()


def test_blockwise_matches_reference_bf16():
    rng = np.random.default_rng(3)
    seg, pos = _packed(3, 100, rng)
    q, k, v = _qkv(3, 100, 100, 4, 2, 16, jnp.bfloat16)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True)
    _compare(q, k, v, kw, atol=3e-2, rtol=3e-2)


def test_queries_and_keys_of_different_lengths():
    """Ring-CP shape: 48 queries against 80 keys from another chunk; some queries see no key at all
    (their document is not among the keys), some keys are later than every query."""
    rng = np.random.default_rng(4)
    q_seg = np.repeat(np.array([[1, 2, 3, 0]], np.int32), 12, axis=1)
    q_pos = np.tile(np.arange(48, dtype=np.int32) + 10, (1, 1))
    kv_seg = np.concatenate([np.full(40, 1), np.full(30, 2), np.zeros(10)]).astype(np.int32)[None]
    kv_pos = rng.integers(0, 70, (1, 80)).astype(np.int32)
    q, k, v = _qkv(1, 48, 80, 6, 3, 8, jnp.float32, seed=2)
    kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos, kv_positions=kv_pos, causal=True)
    lse = _compare(q, k, v, kw, atol=1e-5)
    assert np.isneginf(lse[0, 24:36]).all()  # segment 3 has no keys


def test_empty_blocks_are_skipped():
    """16 segments x 256 rows, non-causal (an encoder buffer): with 128-row blocks only the 2x2 blocks
    inside each segment run (64 of 1024), forward and backward; a causal single segment runs the lower
    triangle. The counters tick inside the taken branch of the skip, so they fail if skipping goes."""
    n = 16 * 256
    seg = np.repeat(np.arange(1, 17, dtype=np.int32), 256)[None]
    pos = np.zeros((1, n), np.int32)
    q, k, v = _qkv(1, n, n, 2, 1, 8, jnp.float32)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=False)
    assert executed_blocks(q, k, v, **kw) == (64, 64, 1024)
    one = np.ones((1, 1024), np.int32)
    ar = np.arange(1024, dtype=np.int32)[None]
    q, k, v = _qkv(1, 1024, 1024, 2, 1, 8, jnp.float32)
    fwd, bwd, total = executed_blocks(q, k, v, q_segment_ids=one, kv_segment_ids=one, q_positions=ar,
                                      kv_positions=ar, causal=True)
    assert fwd == bwd == 8 * 9 // 2 and total == 64
    # the table is conservative: interval overlap, never a visible pair dropped
    vis = np.asarray(visible_blocks(seg, seg, pos, pos, causal=False, block_q=128, block_k=128))
    assert vis.sum() == 64 and vis[0, 1] and not vis[0, 2]


def test_blockwise_memory_is_linear_in_length():
    """Compiled temporaries of value_and_grad: 4x the length costs far less than 16x (dense would)."""
    def temp(n):
        seg = jnp.ones((1, n), jnp.int32)
        pos = jnp.arange(n, dtype=jnp.int32)[None]

        def loss(q, k, v):
            return jnp.sum(blockwise_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                               kv_positions=pos)[0])
        shapes = [jax.ShapeDtypeStruct((1, n, h, 16), jnp.float32) for h in (4, 2, 2)]
        return jax.jit(jax.grad(loss, (0, 1, 2))).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    ratio = temp(2048) / temp(512)
    assert ratio <= 2 * 4, ratio


# ------------------------------------------------------------------------------- dispatch, cuDNN
def test_dispatch_and_errors():
    seg = np.ones((1, 200), np.int32)
    pos = np.arange(200, dtype=np.int32)[None]
    q, k, v = _qkv(1, 200, 200, 2, 1, 8, jnp.float32)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    with pytest.raises(ConfigError, match="impl='cudnn'.*needs an NVIDIA GPU.*use attention=auto or attention=blockwise"):
        attn.dot_product_attention(q, k, v, impl="cudnn", **kw)
    with pytest.raises(ConfigError, match="must be one of auto, reference, blockwise, cudnn"):
        attn.dot_product_attention(q, k, v, impl="flash", **kw)
    jaxpr = lambda impl, n=200: str(jax.make_jaxpr(functools.partial(  # noqa: E731
        attn.dot_product_attention, impl=impl, q_segment_ids=seg[:, :n], kv_segment_ids=seg[:, :n],
        q_positions=pos[:, :n], kv_positions=pos[:, :n]))(q[:, :n], k[:, :n], v[:, :n]))
    assert "custom_vjp" in jaxpr("auto") and "custom_vjp" in jaxpr("blockwise")  # CPU, 200x200: blockwise
    assert "custom_vjp" not in jaxpr("reference") and "custom_vjp" not in jaxpr("auto", 100)  # tiny: dense
    both = jax.jit(lambda q, k, v: [attn.dot_product_attention(q, k, v, impl=i, **kw) for i in ("blockwise", "reference")])
    out, ref = both(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_cudnn_layout_analysis():
    """The run-time check that decides cuDNN vs blockwise (pure JAX, so it runs here)."""
    layout = jax.jit(attn.cudnn_layout, static_argnames=("causal", "max_segments"))
    seg = np.array([[1, 1, 1, 2, 2, 0, 3, 3]], np.int32)
    pos = np.array([[0, 1, 2, 0, 1, 0, 5, 6]], np.int32)
    fits, seqlens, offsets = layout(seg, seg, pos, pos, causal=True, max_segments=4)
    assert bool(fits)
    assert seqlens.tolist() == [[3, 2, 2, -1]] and offsets.tolist() == [[0, 3, 6, -1, -1]]

    def check(s, p, causal=True, m=4, kv=None):
        s, p = np.array([s + [0] * (8 - len(s))], np.int32), np.array([p + [0] * (8 - len(p))], np.int32)
        kv = s if kv is None else np.array([kv], np.int32)
        return bool(layout(s, kv, p, p, causal=causal, max_segments=m)[0])
    assert check([1, 1, 1, 2, 2, 0, 3, 3], [0, 1, 2, 0, 1, 0, 5, 6])
    assert not check([1, 1, 2, 2, 1, 1], [0, 1, 0, 1, 2, 3])           # segment 1 comes back
    assert not check([1, 1, 1, 0], [0, 2, 3, 0])                       # causal by position != by index
    assert check([1, 1, 1, 0], [0, 0, 0, 0], causal=False)             # non-causal: positions unused
    assert not check([1, 2, 3, 4, 5], [0] * 5)                         # more runs than the static bound
    assert not check([1, 1, 2, 2], [0] * 4, causal=False, kv=[1, 1, 2, 3, 0, 0, 0, 0])  # keys differ


# -------------------------------------------------------------------------------- call sites
def _llm_cfg(impl: str) -> LLMConfig:
    return LLMConfig(vocab_size=64, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     mlp_dim=64, attention=impl)


def _lm_batch(b=2, n=256):
    rng = np.random.default_rng(0)
    seg = np.ones((b, n), np.int32)
    seg[:, 150:] = 2
    seg[0, -20:] = 0
    pos = np.concatenate([np.arange(150), np.arange(n - 150)])[None].repeat(b, 0).astype(np.int32)
    tokens = rng.integers(0, 64, (b, n)).astype(np.int32)
    return dict(tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=seg, positions=pos,
                loss_mask=(seg > 0).astype(np.float32))


_LM: dict = {}


def _lm_run(impl: str, layout: str | None = None, **kw):
    """(loss, flat grads) of the tiny LLM on one device, or under an LLMParallel layout."""
    from omnijax.models.llm import LLM
    from omnijax.parallel.engine import LLMParallel, unstack_params
    from omnijax.models.losses import lm_loss
    from omnijax.train.step import loss_and_grads

    key = (impl, layout)
    if key in _LM:
        return _LM[key]
    cfg = _llm_cfg(impl)
    model = LLM(cfg, rngs=nnx.Rngs(0))
    batch = _lm_batch()
    if layout is None:
        gd, params, rest = nnx.split(model, nnx.Param, ...)
        fn = lambda p, b: loss_and_grads(gd, rest, lm_loss, p, b)  # noqa: E731
        loss, grads, _ = jax.jit(fn)(params, batch)
        grads = nnx.to_pure_dict(jax.device_get(grads))
    else:
        n = math.prod(int(t.lstrip("abcdefghijklmnopqrstuvwxyz")) for t in layout.split("x"))
        par = LLMParallel(layout, cfg, devices=jax.devices()[:n], **kw)
        gd, params, rest = nnx.split(par.prepare(model), nnx.Param, ...)
        params = jax.device_put(params, par.state_shardings(params))
        batch = par.put_batch(batch)
        fn = lambda p, b: loss_and_grads(gd, rest, par.loss_fn, p, b)  # noqa: E731
        loss, grads, _ = jax.jit(fn)(params, batch)
        grads = jax.device_get(grads)
        grads = unstack_params(grads, par.schedule) if par.schedule else nnx.to_pure_dict(grads)
    flash = "blockwise_attention" in jax.jit(fn).lower(params, batch).as_text(debug_info=True)  # kernel traced
    _LM[key] = (float(loss), grads, flash)
    return _LM[key]


@pytest.mark.parametrize("layout, kw", [(None, {}), ("dp2xtp2", {}), ("cp2", {}), ("pp2", {"microbatches": 2})])
def test_llm_blockwise_matches_reference(layout, kw):
    """model.attention=blockwise through the LLM's own Attention, GSPMD batch/head sharding, ring CP and
    the pipeline: same loss and gradients as the dense reference on one device."""
    ref_loss, ref_grads, ref_flash = _lm_run("reference")
    loss, grads, flash = _lm_run("blockwise", layout, **kw)
    assert flash and not ref_flash  # the config's choice reached the attention call
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_close(grads, ref_grads)


def test_vision_encoder_blockwise_matches_reference():
    from omnijax.mm_config import VisionConfig
    from omnijax.models.vision import VisionEncoder

    n = 320
    rng = np.random.default_rng(0)
    lengths = [64, 100, 36, 80]  # 280 rows of four images, 40 rows padding
    seg = np.zeros(n, np.int32)
    pos = np.zeros((n, 3), np.int32)
    i = 0
    for s, m in enumerate(lengths, 1):
        seg[i:i + m] = s
        pos[i:i + m, 1], pos[i:i + m, 2] = np.arange(m) // 8, np.arange(m) % 8
        i += m
    cfg = VisionConfig(embed_dim=32, num_layers=1, num_heads=2, mlp_dim=64, merge=1, head=True)
    x = rng.normal(size=(n, 4 * 4 * 3)).astype(np.float32)
    outs = {}
    for impl in ("reference", "blockwise"):
        enc = VisionEncoder(VisionConfig(**{**cfg.__dict__, "attention": impl}), rngs=nnx.Rngs(0))
        gd, params, rest = nnx.split(enc, nnx.Param, ...)

        def loss(p):
            e = nnx.merge(gd, p, rest)
            h = e.hidden(x, seg, pos)
            return jnp.sum(jnp.where(seg[:, None] > 0, h, 0) ** 2) + jnp.sum(e.pool(h, seg, 4) ** 2)
        outs[impl] = jax.jit(jax.value_and_grad(loss))(params)
        lowered = jax.jit(jax.value_and_grad(loss)).lower(params).as_text(debug_info=True)
        assert ("blockwise_attention" in lowered) == (impl == "blockwise")
    (l1, g1), (l2, g2) = outs["reference"], outs["blockwise"]
    assert abs(float(l1) - float(l2)) <= 1e-5 * abs(float(l1))
    errs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), g1, g2)
    assert max(jax.tree.leaves(errs)) <= 1e-3 * max(1.0, float(np.max([np.abs(a).max() for a in jax.tree.leaves(g1)])))


def test_ulysses_sequence_parallel_passes_impl(monkeypatch):
    """The encoders' sequence-parallel attention forwards `impl` to the local attention."""
    from omnijax.parallel.multiplex import ulysses_attention

    mesh = jax.make_mesh((2,), ("esp",), devices=jax.devices()[:2])
    n = 320
    seg = np.repeat(np.array([1, 2, 3, 0], np.int32), [100, 120, 60, 40])[None]
    zero = np.zeros((1, n), np.int32)
    q, k, v = _qkv(1, n, n, 4, 4, 8, jnp.float32)
    calls = []
    real = attn.dot_product_attention

    def spy(*a, **kw):
        calls.append(kw.get("impl"))
        return real(*a, **kw)

    def sp(q, k, v, seg):
        attend = ulysses_attention(("esp",))
        return attend(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=jnp.zeros_like(seg),
                      kv_positions=jnp.zeros_like(seg), causal=False, impl="blockwise")

    run = jax.jit(jax.shard_map(sp, mesh=mesh, in_specs=(P(None, "esp"),) * 4, out_specs=P(None, "esp"),
                                check_vma=False))
    monkeypatch.setattr(attn, "dot_product_attention", spy)
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, P(None, "esp")))  # noqa: E731
    out = run(put(q), put(k), put(v), put(seg))
    assert calls == ["blockwise"]
    ref = attn.reference_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=zero,
                                   kv_positions=zero, causal=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("cc", [(9, 0), (8, 0)])
def test_cudnn_path_traces_where_it_applies(monkeypatch, cc):
    """No GPU here: pretend one (abstract tracing only) so the cuDNN branch is at least traced, forward and
    backward, on Hopper (packed segments) and earlier (one segment per row); fp32 or wanting the lse
    stays on blockwise."""
    from omnijax.jax_private import fused_attention_stablehlo as fused

    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda c: cc >= tuple(int(x) for x in c.split(".")))
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda c: False)
    monkeypatch.setattr(attn, "cudnn_available", lambda: True)
    monkeypatch.setattr(attn, "_compute_capability", lambda: cc)
    seg = np.repeat(np.array([1, 2, 0], np.int32), [200, 250, 62])[None].repeat(2, 0)
    pos = np.concatenate([np.arange(200), np.arange(250), np.zeros(62)]).astype(np.int32)[None].repeat(2, 0)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)

    def traced(dtype, **extra):
        q, k = jnp.ones((2, 512, 4, 64), dtype), jnp.ones((2, 512, 2, 64), dtype)

        def loss(q, k, v):
            out = attn.dot_product_attention(q, k, v, **kw, **extra)
            return jnp.sum((out[0] if isinstance(out, tuple) else out).astype(jnp.float32))
        return str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k))

    jp = traced(jnp.bfloat16)
    assert "dot_product_attention_fwd_wrapper" in jp and "dot_product_attention_bwd" in jp and "cond" in jp
    assert "dot_product_attention_fwd_wrapper" not in traced(jnp.float32)
    assert "dot_product_attention_fwd_wrapper" not in traced(jnp.bfloat16, return_lse=True, impl="cudnn")
