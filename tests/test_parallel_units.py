"""omnijax.parallel pieces on small functions: layouts, meshes, rules, CP attention, pipeline schedules."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import omnijax  # noqa: F401
from omnijax.config import LLMConfig, MoEConfig
from omnijax.errors import ConfigError
from omnijax.parallel import context, pipeline
from omnijax.parallel.engine import count_collectives
from omnijax.parallel.mesh import MESH_AXES, Layout, check_layout, hybrid_split, make_mesh, parse_layout
from omnijax.parallel.rules import load_rules

pytestmark = pytest.mark.xdist_group("parallel_units")


# ------------------------------------------------------------------------------------ layouts
def test_parse_layout_canonical_and_defaults():
    lay = parse_layout("pp2xdp2xtp2")
    assert (lay.pp, lay.dp, lay.tp, lay.fsdp, lay.cp, lay.ep) == (2, 2, 2, 1, 1, 1)
    assert str(parse_layout("tp2xfsdp4")) == "fsdp4xtp2"
    assert parse_layout("", 8) == Layout(dp=8)
    assert parse_layout("dp8xcp1").num_devices == 8


@pytest.mark.parametrize("text, msg", [
    ("pp2xzz2", "unknown axis 'zz'"),
    ("pp2x", "cannot read ''"),
    ("tp", "cannot read 'tp'"),
    ("dp2xdp2", "named twice"),
    ("dp0", "size 0"),
])
def test_parse_layout_errors(text, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_layout(text)


@pytest.mark.parametrize("layout, model, msg", [
    ("dp4", None, "uses 4 devices .* but 8 are present"),
    ("tp8", LLMConfig(num_heads=4, num_kv_heads=4), "tp=8 does not divide model.num_heads=4"),
    ("tp4xdp2", LLMConfig(num_heads=8, num_kv_heads=2), "tp=4 does not divide model.num_kv_heads=2"),
    ("pp4xdp2", LLMConfig(num_layers=2), "pp=4 does not divide model.num_layers=2"),
    ("ep8", LLMConfig(moe=MoEConfig(num_experts=4, every=1)), "ep=8 does not divide model.moe.num_experts=4"),
    ("ep8", LLMConfig(), "needs a MoE model"),
])
def test_check_layout_names_the_mismatch(layout, model, msg):
    with pytest.raises(ConfigError, match=msg):
        check_layout(parse_layout(layout), 8, model)


def test_circular_repeats_must_divide_layers():
    with pytest.raises(ConfigError, match="pp x circular repeats = 4 does not divide model.num_layers=2"):
        check_layout(parse_layout("pp2xdp4"), 8, LLMConfig(num_layers=2), circular_repeats=2)


def test_make_mesh_axes_and_order():
    mesh = make_mesh("pp2xdp2xtp2")
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"pp": 2, "dp": 2, "fsdp": 1, "ep": 1, "cp": 1, "tp": 2}
    # tp is innermost: neighbouring devices form a tp group
    grid = mesh.devices.reshape(2, 2, 2)
    assert [d.id for d in grid[0, 0]] == [0, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=6, max_size=6), st.sampled_from([1, 2, 4, 8]))
def test_hybrid_split_gives_hosts_to_the_outer_axes(sizes, hosts):
    # power-of-two sizes: a split exists exactly when the hosts divide the device count
    if math.prod(sizes) % hosts:
        with pytest.raises(ConfigError, match="cannot be split"):
            hybrid_split(sizes, hosts)
        return
    ici, dcn = hybrid_split(sizes, hosts)
    assert [i * d for i, d in zip(ici, dcn)] == sizes
    assert math.prod(dcn) == hosts
    # slowest axes first: an axis crosses hosts only once every slower (earlier) axis lies wholly across hosts
    for j in range(len(sizes)):
        if dcn[j] > 1:
            assert all(ici[i] == 1 for i in range(j)), (sizes, hosts, ici, dcn)


def test_multi_host_mesh_keeps_tp_inside_a_host():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class FakeDevice:  # what the mesh builder reads of a device
        id: int
        process_index: int
        platform: str = "cpu"
        device_kind: str = "cpu"

    devices = [FakeDevice(i, i % 2) for i in range(8)]  # hosts interleaved in the device list
    mesh = make_mesh("dp2xtp4", devices)
    grid = mesh.devices.reshape(2, 4)  # (dp, tp)
    for tp_group in grid:
        assert len({d.process_index for d in tp_group}) == 1
    assert {d.process_index for d in grid[:, 0]} == {0, 1}
    assert hybrid_split([1, 2, 1, 1, 1, 4], 2) == ([1, 1, 1, 1, 1, 4], [1, 2, 1, 1, 1, 1])


# -------------------------------------------------------------------------------------- rules
def test_rules_map_logical_axes_to_mesh_axes():
    rules = load_rules("llm_5d")
    mesh = make_mesh("fsdp4xtp2")
    assert rules.spec(("embed", "mlp"), (64, 128), mesh) == jax.sharding.PartitionSpec("fsdp", "tp")
    assert rules.spec(("vocab", "embed"), (128, 64), mesh) == jax.sharding.PartitionSpec("tp", "fsdp")
    # size-1 axes disappear, a mesh axis is used once per array, non-dividing dims stay whole
    assert rules.spec(("expert", "embed", "mlp"), (4, 64, 128), mesh) == jax.sharding.PartitionSpec(None, "fsdp", "tp")
    assert rules.spec(("heads", "mlp"), (4, 128), mesh) == jax.sharding.PartitionSpec("tp")
    assert rules.spec(("embed",), (6,), mesh) == jax.sharding.PartitionSpec()
    assert rules.spec(("batch", "seq"), (8, 32), make_mesh("dp2xep2xcp2"), "activations") == \
        jax.sharding.PartitionSpec(("dp", "ep"), "cp")


def test_rules_errors(tmp_path):
    with pytest.raises(ConfigError, match="no file .* known rule sets: .*llm_5d"):
        load_rules("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("params:\n  embed: [zz]\n")
    with pytest.raises(ConfigError, match="unknown mesh axis 'zz'"):
        load_rules(str(bad))
    bad.write_text("parms: {}\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_rules(str(bad))


# ------------------------------------------------------------------------------ CP attention
@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 4))
def test_balanced_order_is_a_permutation_with_equal_causal_work(cp, chunk):
    seq = 2 * cp * chunk
    order = context.balanced_order(seq, cp)
    assert sorted(order.tolist()) == list(range(seq))
    work = context.causal_work(order, cp)
    assert work.min() == work.max()
    tiles = context.ring_tiles(order, cp)
    assert tiles.tolist() == [2 * cp + 1] * cp  # every rank skips the same number of ring tiles
    if cp > 1:  # a contiguous split would give the last rank the most work
        naive = context.causal_work(np.arange(seq), cp)
        assert naive.max() > naive.min()
        assert context.ring_tiles(np.arange(seq), cp).max() > context.ring_tiles(np.arange(seq), cp).min()


def test_balanced_order_needs_2cp_chunks():
    with pytest.raises(ConfigError, match="multiple of 2\\*cp=8"):
        context.balanced_order(12, 4)


@pytest.fixture(scope="module")
def attn_inputs():
    b, s, h, kv, d = 2, 16, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(ks[0], (b, s, h, d)), jax.random.normal(ks[1], (b, s, kv, d)),
               jax.random.normal(ks[2], (b, s, kv, d)))
    seg = np.array([[1] * 10 + [2] * 4 + [0] * 2, [1] * 16], np.int32)
    pos = np.stack([np.concatenate([np.arange(10), np.arange(4), [0, 0]]), np.arange(16)]).astype(np.int32)
    return q, k, v, seg, pos


@pytest.mark.parametrize("impl, expect", [("ring", "collective-permute"), ("allgather", "all-gather")])
def test_cp_attention_matches_reference_with_grads(attn_inputs, impl, expect):
    from omnijax.layers.attention import dot_product_attention

    q, k, v, seg, pos = attn_inputs
    mesh = make_mesh("dp2xcp2xtp2")
    order = context.balanced_order(q.shape[1], 2)

    def ref(q, k, v):
        out = dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                    kv_positions=pos)
        return jnp.sum(jnp.where((seg > 0)[..., None, None], out, 0) ** 2)

    def par(q, k, v):
        so, po = seg[:, order], pos[:, order]
        out = context.cp_attention(q[:, order], k[:, order], v[:, order], so, so, po, po, mesh=mesh, impl=impl)
        return jnp.sum(jnp.where((so > 0)[..., None, None], out, 0) ** 2)

    r, gr = jax.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    fn = jax.jit(jax.value_and_grad(par, argnums=(0, 1, 2)))
    p, gp = fn(q, k, v)
    assert abs(float(p) - float(r)) <= 1e-5 * abs(float(r))
    for a, b in zip(gr, gp):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4)
    hlo = fn.lower(q, k, v).compile().as_text()
    assert count_collectives(hlo).get(expect, 0) >= 1
    if impl == "ring":  # empty tiles are skipped at run time
        assert "conditional(" in hlo


# ---------------------------------------------------------------------------------- pipeline
@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 3))
def test_schedule_runs_every_item_once_in_stage_order(stages, microbatches, repeats):
    if repeats > 1 and microbatches < stages:
        return
    sch = pipeline.Schedule(stages, microbatches, repeats)
    seen: dict = {}
    for t in range(sch.iterations):
        for s in range(stages):
            item = sch.item(t, s)
            if item is not None:
                seen.setdefault(item, []).append((t, sch.virtual_stage(s, item[1])))
    assert set(seen) == {(m, r) for m in range(microbatches) for r in range(repeats)}
    for m in range(microbatches):
        visits = sorted(v for r in range(repeats) for v in seen[(m, r)])
        assert [vs for _, vs in visits] == list(range(stages * repeats))  # virtual stages in order
        times = [t for t, _ in visits]
        assert times == sorted(times) and len(set(times)) == len(times)
    busy = sum(len(v) for v in seen.values())
    assert sch.bubble_fraction == pytest.approx(1 - busy / (stages * sch.iterations))


def test_make_schedule_errors():
    with pytest.raises(ConfigError, match="not divisible by pp=2 x circular repeats=2"):
        pipeline.make_schedule("circular", 2, 4, 2)
    with pytest.raises(ConfigError, match="at least pp=4 microbatches"):
        pipeline.make_schedule("circular", 4, 2, 8)
    with pytest.raises(ConfigError, match="must be 'gpipe' or 'circular'"):
        pipeline.make_schedule("1f1b", 2, 4, 4)


@pytest.mark.parametrize("kind, m", [("gpipe", 4), ("circular", 4)])
def test_spmd_pipeline_matches_sequential(kind, m):
    """Toy residual layers; circular with M > S exercises the lap buffer on stage 0."""
    mesh = make_mesh("pp2xdp2xtp2")
    n_layers, d, b = 4, 16, 8
    layers = [{"w": jax.random.normal(jax.random.key(i), (d, d)) * 0.3} for i in range(n_layers)]
    x = jax.random.normal(jax.random.key(9), (b, 3, d))
    bias = jax.random.normal(jax.random.key(7), (b, 3))

    def layer(p, h, e):
        return jnp.tanh(h @ p["w"]) + h + e[..., None]

    def ref(layers, x):
        aux = 0.0
        for p in layers:
            x = layer(p, x, bias)
            aux += jnp.mean(x ** 2)
        return jnp.sum(x ** 2) + aux

    sch = pipeline.make_schedule(kind, 2, m, n_layers)

    def stage(ps, h, e):
        aux = 0.0
        for j in range(ps["w"].shape[0]):
            h = layer({"w": ps["w"][j]}, h, e)
            aux += jnp.mean(h ** 2) / m
        return h, aux

    def par(layers, x):
        stacked = pipeline.stack_layers(layers, sch)
        ys, aux = pipeline.spmd_pipeline(stage, stacked, pipeline.split_microbatches(x, m),
                                         pipeline.split_microbatches(bias, m), mesh=mesh, schedule=sch)
        return jnp.sum(pipeline.merge_microbatches(ys) ** 2) + aux

    fn = jax.jit(jax.value_and_grad(par))
    (v, g), (vr, gr) = fn(layers, x), jax.value_and_grad(ref)(layers, x)
    assert abs(float(v) - float(vr)) <= 1e-5 * abs(float(vr))
    for a, b_ in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-4, atol=1e-4)
    assert count_collectives(fn.lower(layers, x).compile().as_text()).get("collective-permute", 0) >= 1
    assert pipeline.unstack_layers(pipeline.stack_layers(layers, sch), sch)[3]["w"].shape == (d, d)
    np.testing.assert_array_equal(pipeline.unstack_layers(pipeline.stack_layers(layers, sch), sch)[3]["w"],
                                  layers[3]["w"])


def test_count_collectives_reads_sync_and_async_ops():
    hlo = """
  %a = f32[4] all-reduce(f32[4] %x), replica_groups={{0,1}}
  %b = f32[8] all-gather-start(f32[4] %y)
  %c = f32[8] all-gather-done(%b)
  %d = f32[4] collective-permute(f32[4] %z)
  %e = (f32[4]) all-to-all(f32[4] %w)
"""
    assert count_collectives(hlo) == {"all-gather": 1, "all-reduce": 1, "all-to-all": 1, "collective-permute": 1}
