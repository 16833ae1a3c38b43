"""The slot-exact bound: exact on hand-computed cases where the relaxations are not, below every schedule
the simulator runs, and at or above the Lagrangian bound wherever HiGHS proves its optimum."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnijax.cluster.bounds import lagrangian_bound
from omnijax.cluster.jobs import Job
from omnijax.cluster.schedulers import DRF, FIFO, FittedModel, Tiresias
from omnijax.cluster.simulator import SimConfig, simulate
from omnijax.cluster.slot_bound import slot_bound, useful_sizes


NODES = 20000   # HiGHS's work cap instead of a time limit: the same answer on any machine, under any load


def _cfg(gpus: int) -> SimConfig:
    return SimConfig(num_nodes=1, gpus_per_node=gpus, cpus_per_node=64, slot_s=60.0, restart_s=30.0,
                     profile_sizes=(1, 2))


def test_slot_bound_is_exact_where_the_relaxations_are_not():
    """One device, two 1000-step jobs at 1 s/step from 0: the first completes at 30 + 1000 = 1030, in slot
    17, whose end (1080) the second waits for, then restarts: 1080 + 30 + 1000 = 2110 (FIFO: 1570 on average,
    the optimum). The relaxations let the second job use the rest of the first one's slot and start without
    the slot wait, so they stay below."""
    cfg = _cfg(1)
    step = lambda job, n, nodes: 1.0  # noqa: E731

    def jobs():
        return [Job(x, 0.0, "x", 1, 1, 1000.0, max_replicas=1) for x in "ab"]
    fifo = simulate(jobs(), step, FIFO(), cfg).avg_jct_s
    got = slot_bound(jobs(), step, cfg, time_limit_s=math.inf, node_limit=NODES)
    lag = lagrangian_bound(jobs(), step, cfg, interval_s=60.0)
    assert fifo == pytest.approx(1570.0)
    assert got.optimal and got.avg_jct_s == pytest.approx(1570.0, abs=1e-3)
    assert got.incumbent_avg_jct_s == pytest.approx(1570.0, abs=1e-3)
    assert lag.avg_jct_s < 1570.0 - 20.0


def test_slot_bound_charges_the_slot_a_job_finishes_in():
    """Two devices; A takes 2000 s on one and 1500 s on two, B runs on one only (2000 s). Best: both on one
    device from 30 s, done at 2030 (the Lagrangian bound's hand case: it is up to a quarter interval below)."""
    cfg = _cfg(2)
    times = {("a", 1): 2000.0, ("a", 2): 1500.0, ("b", 1): 2000.0}
    step = lambda job, n, nodes: times[(job.name, n)]  # noqa: E731

    def jobs():
        return [Job("a", 0.0, "x", 2, 1, 1.0, max_replicas=2), Job("b", 0.0, "x", 1, 1, 1.0, max_replicas=1)]
    got = slot_bound(jobs(), step, cfg, time_limit_s=math.inf, node_limit=NODES)
    assert got.optimal and got.avg_jct_s == pytest.approx(2030.0, abs=1e-3)
    assert simulate(jobs(), step, FIFO(), cfg).avg_jct_s == pytest.approx(2030.0)


def test_useful_sizes_drop_counts_no_faster_than_a_smaller_one():
    assert useful_sizes(np.array([0.0, 1.0, 1.5, 1.5, 1.4, 2.0])) == [1, 2, 5]


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0.0, 400.0), st.floats(200.0, 900.0), st.floats(0.3, 1.0)),
                min_size=2, max_size=3))
def test_slot_bound_is_below_every_scheduler_and_above_the_lagrangian(specs):
    """Random jobs (arrival, seconds on one device, parallel fraction) on two devices: the bound is below
    what FIFO, DRF, Tiresias and fitted reach, and, where proved optimal, at or above the Lagrangian bound
    (every schedule of the program is one of the relaxation's)."""
    cfg = _cfg(2)
    alone = {f"j{i}": (t1, p) for i, (_, t1, p) in enumerate(specs)}

    def step(job, n, nodes):      # Amdahl: a fraction p of a step parallelises; 1 step = the whole job
        t1, p = alone[job.name]
        return t1 * ((1 - p) + p / n)

    def jobs():
        return [Job(f"j{i}", a, "x", 2, 1, 1.0, max_replicas=2) for i, (a, _, _) in enumerate(specs)]
    got = slot_bound(jobs(), step, cfg, time_limit_s=math.inf, node_limit=NODES)
    runs = {s.name: simulate(jobs(), step, s, cfg).avg_jct_s for s in (FIFO(), DRF(), Tiresias(), FittedModel())}
    assert all(got.avg_jct_s <= r + 1e-6 for r in runs.values()), (got, runs)
    # instances this small are proved within the node cap (a count of work, not of seconds)
    assert got.optimal, got
    lag = lagrangian_bound(jobs(), step, cfg, interval_s=60.0, iterations=50)
    assert got.avg_jct_s >= lag.avg_jct_s - 1e-3 * lag.avg_jct_s, (got, lag)
    assert got.incumbent_avg_jct_s == pytest.approx(got.avg_jct_s, rel=1e-3)


def test_slot_bound_rejects_what_it_cannot_bound():
    step = lambda job, n, nodes: 1.0  # noqa: E731
    one = [Job("a", 0.0, "x", 1, 1, 10.0, max_replicas=1)]
    with pytest.raises(ValueError, match="at least one job"):
        slot_bound([], step, _cfg(1))
    with pytest.raises(ValueError, match="restart_s <= slot_s"):
        slot_bound(one, step, SimConfig(num_nodes=1, gpus_per_node=1, slot_s=20.0, restart_s=30.0))
    with pytest.raises(ValueError, match="resize_restart_s"):
        slot_bound(one, step, SimConfig(num_nodes=1, gpus_per_node=1, resize_restart_s=0.0))


def test_bench_reports_the_slot_bound_on_a_small_workload(synthetic_cluster_data):
    """`bench cluster milp_time_s=...` on the first jobs of a file: a bound_slot row below every scheduler,
    at or above the Lagrangian bound it starts from, with per-file figures."""
    from recipes.bench import cluster as bench_cluster
    rows = {r["variant"]: r for r in bench_cluster.run([
        "schedulers=[fifo,drf,fitted]", "workloads=[workloads]", "files=1", "limit=3", "sim.num_nodes=1",
        "lp_interval_s=0", "lagrange_interval_s=60", "milp_time_s=20"])}
    slot, lag = rows["bound_slot"], rows["bound_lagrange"]
    assert slot["per_file"] == [slot["avg_jct_s"]] and slot["integers"] > 0
    assert lag["avg_jct_s"] - 0.1 <= slot["avg_jct_s"] <= min(rows[s]["avg_jct_s"] for s in ("fifo", "drf", "fitted"))
    assert rows["bound_best"]["avg_jct_s"] == slot["avg_jct_s"]
    assert slot["fitted_over_bound_per_file"] == [pytest.approx(slot["fitted_over_bound"], abs=2e-4)]
