"""Learned (ES-steered fitted) scheduler: the untrained policy is the fitted scheduler decision for
decision, the generator draws new workloads from training traces, and evolution strategies improve
the training objective from a deliberately bad policy within a few iterations."""

import numpy as np
import pytest

from omnijax.cluster.residual.es import accept, episode_score, evolve
from omnijax.cluster.residual.policy import MLP
from omnijax.cluster.residual.scheduler import ResidualScheduler
from omnijax.cluster.residual.workloads import generate_workload
from omnijax.cluster.schedulers import FittedModel
from omnijax.cluster.simulator import SimConfig, run_workload
from omnijax.cluster.traces import load_workload

pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")

CFG = SimConfig(num_nodes=2, slot_s=300.0)
HIDDEN = 4


def test_untrained_policy_is_the_fitted_scheduler():
    specs = load_workload("workloads/workload-1", 16)
    a = run_workload(specs, FittedModel(), CFG)
    b = run_workload(specs, ResidualScheduler(hidden=HIDDEN), CFG)
    assert [j["timeline"] for j in a.jobs] == [j["timeline"] for j in b.jobs]


def test_generated_workloads_resample_a_training_window():
    pool = [load_workload("workloads/workload-2")]
    rng = np.random.default_rng(0)
    a, b = generate_workload(pool, rng, window_s=3600.0), generate_workload(pool, rng, window_s=3600.0)
    assert a and [s.time for s in a] == sorted(s.time for s in a) and max(s.time for s in a) <= 3600.0
    assert {s.application for s in a} <= {s.application for s in pool[0]}
    assert [(s.application, s.time) for s in a] != [(s.application, s.time) for s in b]


def test_evolution_strategies_improve_a_bad_policy():
    specs = load_workload("workloads/workload-3", 16)
    mlp = MLP(hidden=HIDDEN)
    bad = mlp.init(0)
    bad[-2:] = [-2.0, 2.0]          # rank the largest jobs first-ish, price devices far too high
    ref = run_workload(specs, FittedModel(), CFG).avg_jct_s
    before = episode_score(bad, specs, CFG, HIDDEN, ref)
    theta, hist = evolve(bad, [specs] * 3, CFG, hidden=HIDDEN, pairs=2, sigma=0.5, lr=1.0, seed=0)
    after = episode_score(theta, specs, CFG, HIDDEN, ref)
    assert len(hist) == 3 and before > 1.0
    assert after < before


def test_acceptance_needs_a_gain_beyond_the_noise():
    assert accept([0.95, 0.96, 0.94, 0.97])                 # consistently better
    assert not accept([0.90, 1.08, 0.97, 1.02])             # mean below 1, but within its noise
    assert not accept([0.99])                               # one workload says nothing about the spread
    assert not accept([1.01, 1.02, 1.00, 1.03])
    assert accept([0.98, 0.99, 0.98, 0.99], z=0.0) and not accept([0.98, 0.99, 0.98, 0.99], z=1e6)
