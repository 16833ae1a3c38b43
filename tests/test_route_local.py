"""Routing per host group (issue 47): the hosts holding the same LLM batch shards plan, place and route
only their own rows' encoder segments on their own devices; the joined per-group plans give the
single-device loss and gradients, and no route leaves its group."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import from_dict
from omnijax.data.packing import SamplePacker as Packer
from omnijax.data.world import World
from omnijax.errors import ConfigError
from omnijax.mm_config import MMConfig
from omnijax.models import mllm
from omnijax.parallel import routing
from omnijax.parallel.context import balanced_order
from omnijax.parallel.engine import LLMParallel, unstack_params
from omnijax.parallel.multiplex import Multiplexer
from omnijax.train.step import loss_and_grads
from numerics import assert_grads_close
from test_multiplex_step import ENCODERS, LLM, WORLD

ROWS = 16  # twice the multiplex tests' batch


@pytest.fixture(scope="module")
def setup():
    cfg = from_dict(MMConfig, {"llm": LLM, "encoders": ENCODERS})
    batch, _ = Packer(cfg, ROWS, 64, {"vision": 1024, "audio": 512}).pack(World(WORLD).sample(i) for i in range(160))
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    g, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(g, rest, mllm.mm_loss, p, b))(
        params, {k: jnp.asarray(v) for k, v in batch.items()})
    return cfg, batch, model, float(loss), nnx.to_pure_dict(grads)


def _segments_in(view: dict, rows: np.ndarray, L: int) -> int:
    """Segments of a group's view; each one's outputs land in the group's rows (renumbered 0..len(rows))."""
    segs = routing.segments_of(view, {"vision": 4, "audio": 4}, lambda *_: 0.0)
    for s in segs:
        assert s.dests.min() >= 0 and s.dests.max() < len(rows) * L
    return len(segs)


@pytest.mark.parametrize("layout,hosts,groups,micro", [("dp2xfsdp2xtp2", 2, 2, 1), ("pp2xdp2xtp2", 4, 2, 2)])
def test_per_group_plans_match_one_device(setup, layout, hosts, groups, micro):
    """dp2 x fsdp2 x tp2 on 2 hosts (a group per host) and pp2 x dp2 x tp2 on 4 hosts of 2 devices (the
    stages of a dp rank on two hosts: a group of two hosts each): the joined group plans give one device's
    loss and gradients (<= 1e-5 relative), every group's plan holds only the segments of its own rows,
    every route stays inside its group, and the capacities are the same for every group."""
    cfg, batch, model, ref_loss, ref_grads = setup
    engine = LLMParallel(layout, cfg.llm, microbatches=micro)
    mx = Multiplexer(engine, cfg, encoder_layout="edp4xesp2", balance_rows=False, hosts=hosts, route_local=True)
    found = mx.host_groups()
    assert len(found) == groups and all(len(g.hosts) == hosts // groups for g in found)
    mx.size_window([batch])
    g, params, rest = nnx.split(mx.prepare(model), nnx.Param, ...)
    params = mx.put_state(params)
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(g, rest, mx.loss_fn, p, b))(params, mx.put_batch(batch))
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (float(loss), ref_loss)
    got = nnx.to_pure_dict(grads)
    if engine.schedule is not None:
        got["llm"] = unstack_params(grads["llm"], engine.schedule)
    assert_grads_close(got, ref_grads)
    plan = mx.last_plan
    # each group: only its own rows' segments, and together every segment of the step once
    L = batch["tokens"].shape[1]
    counts = [_segments_in(view, grp.rows(ROWS, mx.grid.batch_shards), L) for grp, view in mx._views(batch)]
    assert all(c > 0 for c in counts) and sum(counts) == plan.stats["segments"]
    assert sum(counts) == len(routing.segments_of(batch, mx.reductions, lambda *_: 0.0))
    # routes: a device sends to and receives from its own group's devices only (pad entries elsewhere)
    group_of = np.zeros(mx.grid.num_devices, np.int64)
    for grp in found:
        group_of[grp.devices] = grp.index
    send, recv = plan.arrays["route_send"], plan.arrays["route_recv"]
    pad, drop = int(plan.stats["pad_row"]), int(plan.stats["drop_index"])
    for d in range(mx.grid.num_devices):
        other = group_of != group_of[d]
        assert (send[d][other] == pad).all() and (recv[d][other] == drop).all()
    assert (send != pad).sum() > 0
    # the same capacities for every group (one program): each group's own plan inside the window's
    for grp, view in mx._views(batch):
        p = routing.build_plan(view, grp.grid, mx.reductions, mx.dims, mx.cost_fn, order=balanced_order,
                               capacities=mx.capacities, fill_devices=(), host_of=grp.host_of)
        assert dict(p.capacities) == mx.capacities


def test_host_groups_link_hosts_that_share_a_batch_shard():
    """Hosts are grouped by the batch shards they hold: pipeline stages of the same rows on different
    hosts share a group; a group's sub-grid maps onto whole esp groups, else a one-line error."""
    grid = routing.DeviceGrid((2, 2, 1, 1, 1, 2), esp=2)  # pp2 x dp2 x tp2
    four = routing.host_groups(grid, np.arange(8) // 2)
    assert [g.hosts for g in four] == [(0, 2), (1, 3)]
    assert four[0].devices.tolist() == [0, 1, 4, 5] and four[1].devices.tolist() == [2, 3, 6, 7]
    assert four[0].host_of.tolist() == [0, 0, 1, 1]
    two = routing.host_groups(grid, np.arange(8) // 4)  # a stage per host: one group of both
    assert len(two) == 1 and two[0].devices.tolist() == list(range(8))
    wide = routing.DeviceGrid((1, 2, 1, 1, 1, 4), esp=4)  # dp2 x tp4 on 2 hosts: a group (and esp group) each
    assert len(routing.host_groups(wide, np.arange(8) // 4)) == 2
    with pytest.raises(ConfigError, match="esp"):
        routing.host_groups(routing.DeviceGrid((1, 1, 1, 4, 1, 2), esp=4), np.arange(8) // 4 * 0 + np.array(
            [0, 0, 1, 1, 0, 0, 1, 1]))
