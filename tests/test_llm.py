"""LLM backbone: packing isolation, GQA, rotary, MoE routing, jit/grad, mixed precision."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import omnijax  # noqa: F401  (flax settings)
from omnijax.config import LLMConfig, MoEConfig, RopeConfig
from omnijax.layers import rope
from omnijax.layers.attention import dot_product_attention
from omnijax.layers.moe import MoE, expert_capacity, route
from omnijax.models.llm import LLM, is_moe_layer

CFG = LLMConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                qkv_bias=True, tie_embeddings=False)
MOE_CFG = LLMConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    moe=MoEConfig(num_experts=4, top_k=2, mlp_dim=32, capacity_factor=1.0, every=2, first=1))
L = 16


@jax.jit
def _forward(model, tokens, segment_ids, positions):
    return model.forward_embeddings(model.embed(tokens), segment_ids, positions)


@pytest.fixture(scope="module")
def dense():
    model = LLM(CFG, rngs=nnx.Rngs(0))
    # qkv biases start at zero; make them non-zero so the test exercises them
    for blk in model.blocks:
        blk.attn.q_bias[...] = 0.1 * jax.random.normal(jax.random.key(1), blk.attn.q_bias.shape)
    return model


@pytest.fixture(scope="module")
def moe_model():
    return LLM(MOE_CFG, rngs=nnx.Rngs(1))


def _packed_batch():
    """Row 0: doc A (6 tokens) + doc B (7) + 3 padding; row 1: a single document."""
    seg = np.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * L], np.int32)
    pos = np.array([list(range(6)) + list(range(7)) + [0] * 3, list(range(L))], np.int32)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, L)).astype(np.int32)
    return tokens, seg, pos


def test_packed_documents_never_attend_to_each_other(dense):
    tokens, seg, pos = _packed_batch()
    logits, _ = _forward(dense, tokens, seg, pos)
    changed = tokens.copy()
    changed[0, 6:13] = (changed[0, 6:13] + 7) % CFG.vocab_size  # rewrite doc B only
    logits2, _ = _forward(dense, changed, seg, pos)
    np.testing.assert_array_equal(np.asarray(logits[0, :6]), np.asarray(logits2[0, :6]))
    assert np.abs(np.asarray(logits[0, 6:13] - logits2[0, 6:13])).max() > 1e-3  # doc B did change
    # doc B inside the packed row == doc B alone at the start of a row (same positions 0..6)
    alone = np.zeros_like(tokens)
    alone[0, :7] = tokens[0, 6:13]
    seg_alone = np.zeros_like(seg)
    seg_alone[0, :7] = 1
    pos_alone = np.zeros_like(pos)
    pos_alone[0, :7] = np.arange(7)
    logits3, _ = _forward(dense, alone, seg_alone, pos_alone)
    np.testing.assert_allclose(np.asarray(logits[0, 6:13]), np.asarray(logits3[0, :7]), atol=2e-5)
    assert np.isfinite(np.asarray(logits)).all()  # padding rows see no key: finite, not NaN


def test_defaults_and_call_match_forward(dense):
    tokens, _, _ = _packed_batch()
    full, aux = _forward(dense, tokens, None, None)
    assert full.shape == (2, L, CFG.vocab_size) and full.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, t: m(t))(dense, tokens)), np.asarray(full), atol=1e-6)
    assert float(aux["moe_aux_loss"]) == 0.0 and float(aux["moe_dropped_tokens"]) == 0.0
    # blocks / final_norm / logits composed by hand (what pipeline stages do)
    @jax.jit
    def by_hand(model, tokens):
        x = model.embed(tokens)
        seg, pos = jnp.ones((2, L), jnp.int32), jnp.broadcast_to(jnp.arange(L), (2, L))
        for blk in model.blocks:
            x, _ = blk(x, seg, pos)
        return model.logits(model.final_norm(x))
    np.testing.assert_allclose(np.asarray(by_hand(dense, tokens)), np.asarray(full), atol=1e-5)
    # head=False: the final-normed hidden states the chunked loss applies the head to
    hidden, _ = jax.jit(lambda m, t: m.forward_embeddings(m.embed(t), head=False))(dense, tokens)
    assert hidden.shape == (2, L, CFG.embed_dim)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, h: m.logits(h))(dense, hidden)), np.asarray(full), atol=1e-6)
    # dense blocks are homogeneous (stackable for pipeline stages)
    s0, s1 = (jax.tree.structure(nnx.state(b, nnx.Param)) for b in dense.blocks)
    assert s0 == s1


def _reference_attention(q, k, v, seg, pos):
    """Naive MHA with explicit loops over heads; kv already expanded to all heads."""
    b, l, h, dh = q.shape
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(dh)
            m = (seg[bi][:, None] == seg[bi][None, :]) & (seg[bi][:, None] != 0) & (pos[bi][None, :] <= pos[bi][:, None])
            s = np.where(m, s, -np.inf)
            for qi in range(l):
                if m[qi].any():
                    p = np.exp(s[qi] - s[qi].max())
                    out[bi, qi, hi] = (p / p.sum()) @ v[bi, :, hi]
    return out


def test_gqa_equals_mha_with_repeated_kv_and_reference():
    rng = np.random.default_rng(0)
    b, h, kvh, dh = 2, 4, 2, 8
    q = rng.normal(size=(b, L, h, dh)).astype(np.float32)
    k = rng.normal(size=(b, L, kvh, dh)).astype(np.float32)
    v = rng.normal(size=(b, L, kvh, dh)).astype(np.float32)
    _, seg, pos = _packed_batch()
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    gqa = np.asarray(dot_product_attention(q, k, v, **kw))
    k_rep, v_rep = np.repeat(k, h // kvh, axis=2), np.repeat(v, h // kvh, axis=2)
    mha = np.asarray(dot_product_attention(q, k_rep, v_rep, **kw))
    np.testing.assert_allclose(gqa, mha, atol=1e-6)
    np.testing.assert_allclose(gqa, _reference_attention(q, k_rep, v_rep, seg, pos), atol=1e-5)
    assert np.all(gqa[0, 13:] == 0)  # padding queries: no valid key -> exactly 0


@jax.jit
def _attend(q, k, v, seg, pos):
    return dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_attention_is_layout_free(seed):
    """Permuting the token buffer (as load-balanced context parallelism does) permutes the output:
    visibility depends on segment ids and positions only, never on buffer index."""
    rng = np.random.default_rng(seed)
    lengths = rng.multinomial(L, np.ones(3) / 3)  # three documents (one may be empty), random sizes
    seg = np.repeat(np.arange(3, dtype=np.int32), lengths)[None]  # segment 0 plays padding
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)[None]
    q = rng.normal(size=(1, L, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(1, L, 2, 8)).astype(np.float32) for _ in range(2))
    perm = rng.permutation(L)
    out = np.asarray(_attend(q, k, v, seg, pos))
    out_p = np.asarray(_attend(q[:, perm], k[:, perm], v[:, perm], seg[:, perm], pos[:, perm]))
    np.testing.assert_allclose(out_p, out[:, perm], atol=1e-5)
    assert np.all(out[0, seg[0] == 0] == 0)


def test_lse_merges_partial_attention_and_grads_are_finite():
    """Split keys in two halves (as context parallelism does), merge with lse == full attention."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, L, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, L, 2, 8)).astype(np.float32)
    v = rng.normal(size=(2, L, 2, 8)).astype(np.float32)
    _, seg, pos = _packed_batch()
    attend = jax.jit(functools.partial(dot_product_attention, return_lse=True))
    full, lse = attend(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    parts = [attend(q, k[:, s], v[:, s], q_segment_ids=seg, kv_segment_ids=seg[:, s], q_positions=pos,
                    kv_positions=pos[:, s]) for s in (slice(0, 5), slice(5, L))]
    merged_lse = jnp.logaddexp(parts[0][1], parts[1][1])
    w = [jnp.where(jnp.isfinite(p[1]), jnp.exp(p[1] - jnp.where(jnp.isfinite(merged_lse), merged_lse, 0)), 0.0)
         for p in parts]
    merged = sum(wi[..., None] * p[0] for wi, p in zip(w, parts))
    np.testing.assert_allclose(np.asarray(merged), np.asarray(full), atol=1e-5)
    np.testing.assert_allclose(np.asarray(merged_lse), np.asarray(lse), atol=1e-5)
    assert np.isneginf(np.asarray(lse[0, 13:])).all()

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                             kv_positions=pos) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[0, 13:] == 0)


def test_rope_is_relative_and_scaling_changes_low_frequencies():
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 4, 2, 16)).astype(np.float32)
    k = rng.normal(size=(1, 4, 2, 16)).astype(np.float32)
    inv, scale = rope.inv_frequencies(16, RopeConfig(theta=500.0))
    pos = jnp.arange(4)[None]
    scores = [jnp.einsum("bqhd,bkhd->bhqk", rope.apply_rope(q, pos + s, inv), rope.apply_rope(k, pos + s, inv))
              for s in (0, 37)]
    np.testing.assert_allclose(np.asarray(scores[0]), np.asarray(scores[1]), atol=1e-4)
    base, _ = rope.inv_frequencies(64, RopeConfig(theta=500000.0))
    l3, s3 = rope.inv_frequencies(64, RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=64))
    assert s3 == 1.0 and l3[0] == base[0] and np.isclose(l3[-1], base[-1] / 8)  # high kept, low / factor
    lin, _ = rope.inv_frequencies(64, RopeConfig(scaling="linear", factor=4.0))
    np.testing.assert_allclose(lin, rope.inv_frequencies(64, RopeConfig())[0] / 4, rtol=1e-6)
    yarn, ys = rope.inv_frequencies(64, RopeConfig(scaling="yarn", factor=4.0, original_max_position=256))
    assert np.isclose(ys, 0.1 * np.log(4.0) + 1) and yarn[0] == rope.inv_frequencies(64, RopeConfig())[0][0]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _route(logits, top_k, capacity, mask):
    return route(logits, top_k, capacity, mask)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), top_k=st.sampled_from([1, 2]), capacity=st.sampled_from([2, 12]),
       n_pad=st.integers(0, 4))
def test_route_invariants(seed, top_k, capacity, n_pad):
    t, e = 12, 4
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(t, e)).astype(np.float32) * rng.uniform(0.1, 5)
    mask = np.arange(t) < t - n_pad
    r = jax.tree.map(np.asarray, _route(logits, top_k, capacity, mask))
    assert r.dispatch.shape == (t, e, capacity)
    assert (r.dispatch.sum(0) <= 1).all()                      # a slot holds at most one token
    assert (r.dispatch.sum((1, 2)) <= top_k).all()             # a token sits in at most k slots
    kept = int(r.dispatch.sum())
    assert kept + int(r.dropped) == int(mask.sum()) * top_k    # every valid assignment: kept or counted
    assert r.dispatch[~mask].sum() == 0 and r.weight[~mask].sum() == 0
    if capacity >= t:
        assert int(r.dropped) == 0
    np.testing.assert_allclose(r.combine.sum((1, 2)), r.weight.sum(1), atol=1e-6)
    if top_k > 1:  # renormalised weights of fully kept tokens sum to 1
        full = mask & (r.dispatch.sum((1, 2)) == top_k)
        np.testing.assert_allclose(r.weight.sum(1)[full], 1.0, atol=1e-5)
    # first choices are placed before any second choice: a dropped first choice means that expert is full
    first_dropped = mask & (r.slot[:, 0] == capacity)
    for ti in np.nonzero(first_dropped)[0]:
        assert r.dispatch[:, r.expert_index[ti, 0]].sum() == capacity
    assert 0 < float(r.lb_loss) <= e + 1e-4


def test_load_balancing_loss_values():
    t, e = 12, 4
    mask = np.ones(t, bool)
    uniform = _route(jnp.zeros((t, e)), 1, 12, mask)
    assert np.isclose(float(uniform.lb_loss), 1.0, atol=1e-6)
    one_expert = jnp.tile(jnp.array([[10.0, 0, 0, 0]]), (t, 1))
    collapsed = _route(one_expert, 1, 12, mask)
    assert float(collapsed.lb_loss) > 3.5  # -> E when all tokens go to one expert
    assert int(_route(one_expert, 1, 2, mask).dropped) == t - 2
    assert expert_capacity(16, 4, 2, 1.25) == 10 and expert_capacity(4, 8, 1, 1.0) == 1


def test_moe_layer_matches_per_token_reference():
    cfg = MOE_CFG
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    layer.capacity_factor = 100.0  # no drops: must equal the direct per-token mixture
    x = jax.random.normal(jax.random.key(0), (2, 8, cfg.embed_dim))
    seg = jnp.ones((2, 8), jnp.int32)
    y, aux = jax.jit(lambda m, x, s: m(x, s))(layer, x, seg)
    assert float(aux["moe_dropped_tokens"]) == 0
    probs = jax.nn.softmax(x @ layer.router[...], -1)
    w, idx = jax.lax.top_k(probs, cfg.moe.top_k)
    w = w / w.sum(-1, keepdims=True)

    w, idx = np.asarray(w), np.asarray(idx)
    gate, up, down = (np.asarray(p[...]) for p in (layer.gate, layer.up, layer.down))
    xs = np.asarray(x)
    ref = np.zeros(y.shape, np.float32)
    for j in range(cfg.moe.top_k):  # mixture of the chosen experts, token by token (vectorised over tokens)
        e = idx[..., j]
        g = np.einsum("btd,btdf->btf", xs, gate[e])
        h = g / (1 + np.exp(-g)) * np.einsum("btd,btdf->btf", xs, up[e])
        ref += w[..., j, None] * np.einsum("btf,btfd->btd", h, down[e])
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-4)


def test_moe_model_jit_grads_and_aux(moe_model):
    assert [is_moe_layer(MOE_CFG, i) for i in range(2)] == [False, True]
    assert moe_model.blocks[1].mlp.gate.get_metadata()["out_sharding"] == ("expert", "embed", "mlp")
    tokens, seg, pos = _packed_batch()
    logits, aux = _forward(moe_model, tokens, seg, pos)
    assert 0.5 < float(aux["moe_lb_loss"]) <= MOE_CFG.moe.num_experts
    np.testing.assert_allclose(float(aux["moe_aux_loss"]), MOE_CFG.moe.aux_loss_weight * float(aux["moe_lb_loss"]), rtol=1e-6)
    valid_assignments = int((seg != 0).sum()) * MOE_CFG.moe.top_k
    assert 0 <= float(aux["moe_dropped_tokens"]) < valid_assignments

    def loss(model):
        lg, a = _forward(model, tokens, seg, pos)
        return jnp.mean(jax.nn.log_softmax(lg)[..., 0] * (seg != 0)) + a["moe_aux_loss"]
    grads = jax.jit(jax.grad(loss))(moe_model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert float(jnp.abs(grads.blocks[1].mlp.router[...]).sum()) > 0  # router learns


def test_bf16_compute_and_logical_axes(dense):
    bf = jax.tree.map(lambda p: p.astype(jnp.bfloat16), dense)
    tokens, seg, pos = _packed_batch()
    lg_bf, _ = _forward(bf, tokens, seg, pos)
    lg, _ = _forward(dense, tokens, seg, pos)
    assert lg_bf.dtype == jnp.float32
    assert float(jnp.abs(lg_bf - lg).max()) < 0.2 * float(jnp.abs(lg).max())
    names = {p.get_metadata()["out_sharding"] for p in jax.tree.leaves(nnx.state(dense, nnx.Param),
                                                                       is_leaf=lambda v: isinstance(v, nnx.Variable))}
    assert ("vocab", "embed") in names and ("embed", "vocab") in names and ("embed", "heads", "head_dim") in names
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(dense, nnx.Param)))


def test_one_device_forward_follows_parallel_remat():
    """`parallel.remat` reaches the LLM's layers on one device and plain DP too: the trainer enters
    `use_remat(mode)` and `forward_embeddings` (remat not given) takes that mode; an explicit argument wins."""
    import re

    from omnijax.layers.remat import use_remat
    model = LLM(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 8), jnp.int32)

    def checkpoints(mode=None, explicit=None):
        def loss(m):
            kw = {} if explicit is None else {"remat": explicit}
            return jnp.sum(m.forward_embeddings(m.embed(tokens), **kw)[0])
        if mode is None:
            jaxpr = jax.make_jaxpr(lambda m: nnx.grad(loss)(m))(model)
        else:
            with use_remat(mode):
                jaxpr = jax.make_jaxpr(lambda m: nnx.grad(loss)(m))(model)
        return len(re.findall(r"\b(?:remat2?|checkpoint)\[", str(jaxpr)))

    assert checkpoints() == 0
    assert checkpoints("full") == CFG.num_layers
    assert checkpoints("full", explicit="none") == 0
