"""Pure PS planning: blocks/chunks cover the parameters exactly; placement plans are valid, never worse
than the current one, and move load off a slow server; the distributor's decisions are deterministic."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from omnijax.errors import ConfigError
from omnijax.models.classifier import Classifier, ClassifierConfig, classifier_loss
from omnijax.ps.blocks import chunk_ranges, forward_order, make_blocks, param_layout
from omnijax.ps.distributor import Distributor, makespan, plan_placement, server_loads, stragglers


@given(total=st.integers(1, 5000), n=st.integers(1, 64), chunk=st.integers(1, 700))
@settings(max_examples=60, deadline=None)
def test_blocks_and_chunks_cover_exactly(total, n, chunk):
    if n > total:
        with pytest.raises(ConfigError, match="num_blocks"):
            make_blocks(total, n)
        return
    blocks = make_blocks(total, n)
    assert blocks[0].start == 0 and blocks[-1].stop == total
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    assert max(b.size for b in blocks) - min(b.size for b in blocks) <= 1
    for b in blocks[:3]:
        ranges = chunk_ranges(b.size, chunk)
        assert ranges[0][0] == 0 and ranges[-1][1] == b.size
        assert all(e - s <= chunk and e > s for s, e in ranges)
        assert all(a[1] == c[0] for a, c in zip(ranges, ranges[1:]))


def test_layout_is_forward_order_and_round_trips():
    model = Classifier(ClassifierConfig(in_dim=8, hidden=[16], num_classes=3), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {"x": jnp.ones((2, 8)), "y": jnp.zeros(2, jnp.int32)}
    order = forward_order(lambda p: classifier_loss(nnx.merge(graphdef, p, rest), batch), params)
    layout = param_layout(params, order)
    paths = [e.path for e in layout.entries]
    assert paths[0].startswith("['layers'][0]") and paths[-1].startswith("['layers'][1]")
    flat = layout.flatten(params)
    assert flat.shape == (8 * 16 + 16 + 16 * 3 + 3,)
    back = layout.flatten(layout.unflatten(jnp.asarray(flat)))
    np.testing.assert_array_equal(back, flat)
    with pytest.raises(ValueError, match="permutation"):
        param_layout(params, [0, 0, 1, 2])


placements = st.integers(2, 24).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 1000), min_size=n, max_size=n),
    st.lists(st.integers(0, 3), min_size=n, max_size=n),
    st.lists(st.floats(0.1, 10), min_size=5, max_size=5),
    st.sets(st.integers(0, 4), min_size=1, max_size=5),
))


@given(placements)
@settings(max_examples=150, deadline=None)
def test_plan_is_valid_and_never_worse(args):
    sizes, current, costs, servers = args
    cost = dict(enumerate(costs))
    plan = plan_placement(sizes, current, cost, sorted(servers))
    assert len(plan) == len(sizes) and set(plan) <= servers
    assert plan == plan_placement(sizes, current, cost, sorted(servers))  # deterministic
    if set(current) <= servers:
        assert makespan(sizes, plan, cost) <= makespan(sizes, current, cost) + 1e-9
        # the largest single-block bound: no plan beats placing the biggest block on the cheapest server
    assert makespan(sizes, plan, cost) >= max(sizes) * min(cost[s] for s in servers) - 1e-9


def test_plan_moves_load_off_a_straggler():
    sizes = [100] * 32
    current = [b % 4 for b in range(32)]
    cost = {0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0}
    plan = plan_placement(sizes, current, cost, [0, 1, 2, 3])
    loads = server_loads(sizes, plan)
    assert loads[3] <= 300 and makespan(sizes, plan, cost) <= 1000  # ideal continuous share: 32*100/3.25
    assert sum(a != b for a, b in zip(plan, current)) <= 8  # about the 6 it must move, not a reshuffle
    assert stragglers(cost) == [3]
    with pytest.raises(ValueError, match="at least one server"):
        plan_placement(sizes, current, cost, [])


def test_distributor_rebalances_then_explores_and_reverts_a_bad_trial():
    sizes = tuple([100] * 16)
    d = Distributor(sizes, pool=(0, 1, 2), rebalance_every=2, explore_every=6, trial_steps=3, min_gain=0.05)
    placement = tuple(b % 2 for b in range(16))
    decisions = []
    for step in range(36):
        # server 1 is 3x slower per byte; throughput does not improve with a third server
        stats = [dict(sid=s, transfer_s=(3.0 if s == 1 else 1.0) * 1e-3 * n, processing_s=0.0, bytes_in=n, bytes_out=0)
                 for s, n in server_loads(sizes, placement).items()]
        d.observe(step, 1.0, stats)
        dec = d.decide(step, placement, step + 1)
        if dec is not None:
            decisions.append((step, dec.reason))
            placement = dec.placement
    reasons = [r for _, r in decisions]
    assert reasons[0] == "rebalance"
    assert server_loads(sizes, placement) == {0: 1200, 1: 400}  # 3x slower server keeps a quarter
    assert {"explore_add", "explore_remove", "revert"} <= set(reasons) and "keep" not in reasons  # no gain
    assert any(h["kind"].startswith("explore") and not h["kept"] for h in d.history)


def test_ps_digits_recipe_rejects_bad_config_before_starting_ray():
    from recipes import ps_digits

    with pytest.raises(ConfigError, match="unknown config key 'ps.num_server'"):
        ps_digits.main(["ps.num_server=3"])
    with pytest.raises(ConfigError, match="ps.min_servers"):
        ps_digits.main(["ps.min_servers=3"])
    with pytest.raises(ConfigError, match="model.in_dim"):
        ps_digits.main(["model.in_dim=10"])


def test_layout_is_generic_over_the_llm():
    """omnijax's LLM round-trips through the PS flat vector in forward order (embedding first)."""
    import jax
    import optax

    from omnijax.config import LLMConfig
    from omnijax.models.llm import LLM

    model = LLM(LLMConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          mlp_dim=64), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 64

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    layout = param_layout(params, forward_order(loss, params))
    assert layout.entries[0].path.startswith("['embedding']")
    flat = layout.flatten(params)
    assert flat.size == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    rebuilt = layout.unflatten(jnp.asarray(flat))
    assert jax.tree.structure(rebuilt) == jax.tree.structure(params)
    np.testing.assert_array_equal(layout.flatten(rebuilt), flat)
    jitted = jax.jit(loss)  # one compile for both calls (same structure)
    assert float(jitted(rebuilt)) == float(jitted(params))  # the model rebuilt from the flat vector is the same
