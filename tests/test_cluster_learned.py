"""Learned scheduler: supervised warm-up reaches >= 90% agreement with its teacher on held-out slots,
its allocations respect capacity, and one actor-critic episode with replay runs and updates the policy."""

import jax
import numpy as np
import pytest
from flax import nnx

from omnijax.cluster.jobs import check_allocation
from omnijax.cluster.learned import (LearnedScheduler, PolicyNet, actor_critic, agreement, record_teacher,
                                     supervised_warmup)
from omnijax.cluster.simulator import SimConfig, run_workload
from omnijax.cluster.traces import load_workload



pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")  # no shared data needed


CFG = SimConfig(num_nodes=4, slot_s=300.0)


@pytest.fixture(scope="module")
def warmed(synthetic_cluster_data):
    train = record_teacher([load_workload("workloads/workload-1", 20), load_workload("workloads/workload-2", 20)], CFG)
    held = record_teacher([load_workload("workloads/workload-3", 20)], CFG)   # other workload: held-out slots
    net = PolicyNet(rngs=nnx.Rngs(0))
    before = agreement(net, held)
    losses = supervised_warmup(net, train, epochs=30, lr=1e-2, batch=128)
    return net, held, before, losses


def test_warmup_agreement_with_teacher_on_held_out_slots(warmed):
    net, held, before, losses = warmed
    assert len(held) > 200
    assert losses[-1] < 0.5 * losses[0]
    after = agreement(net, held)
    assert after >= 0.9 > before


def test_learned_allocations_respect_capacity_and_rl_updates(warmed):
    net, *_ = warmed
    specs = load_workload("workloads/workload-3", 8)

    class Checked(LearnedScheduler):
        def allocate(self, now, jobs, cluster):
            alloc = super().allocate(now, jobs, cluster)
            check_allocation(alloc, {j.name: j for j in jobs}, cluster)
            return alloc

    result = run_workload(specs, Checked(net=net), CFG)
    assert len(result.jobs) == 8
    before = jax.tree.map(np.array, nnx.state(net, nnx.Param))
    hist = actor_critic(net, [specs], CFG, replay=1)
    after = nnx.state(net, nnx.Param)
    assert hist and np.isfinite(hist[0]["policy_loss"]) and hist[0]["entropy"] >= 0
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), before, after))
    assert any(changed)
