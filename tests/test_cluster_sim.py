"""Schedulers respect capacity (hypothesis); placement is valid; the simulator matches a hand-computed case."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnijax.cluster.jobs import Cluster, Job, check_allocation, place, place_one
from omnijax.cluster.perf_model import SpeedModel
from omnijax.cluster.schedulers import DRF, FIFO, FittedModel, FittedOracle, Tiresias, shadow_cost
from omnijax.cluster.simulator import SimConfig, first_slot, run_workload, simulate
from omnijax.cluster.traces import load_workload



pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")  # no shared data needed


SCHEDULERS = [FIFO, DRF, Tiresias, FittedModel, lambda: FittedModel(objective="remaining_time"),
              lambda: FittedModel(objective="completion_rate")]


def _job(i, arrival=0.0, requested=1, cpus=2, allocation=0, attained=0.0, steps=1000.0, **kw):
    speed = SpeedModel("allreduce", batch_size=64)
    for n in (1, 2, 4):
        speed.observe(n, 1, 64 / n * 0.01 + 0.05)
    return Job(name=f"j{i}", arrival=arrival, application="cifar10", batch_size=64, requested=requested,
               total_steps=steps, cpus_per_replica=cpus, allocation=allocation, attained_service=attained,
               speed_model=speed, **kw)


job_lists = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 8), st.floats(0, 1e5), st.integers(0, 6),
                               st.integers(1, 64)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(job_lists, st.integers(1, 6), st.sampled_from([1, 2, 4, 8]), st.integers(0, len(SCHEDULERS) - 1))
def test_every_scheduler_respects_capacity_and_placement_is_valid(specs, nodes, gpn, which):
    cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn, cpus_per_node=8 * gpn)
    jobs, used = [], 0
    for i, (req, cpus, attained, cur, cap) in enumerate(specs):
        cur = min(cur, cap, cluster.gpus - used)   # current allocations are themselves feasible
        used += cur
        jobs.append(_job(i, arrival=float(i), requested=req, cpus=cpus, allocation=cur, attained=attained,
                         max_replicas=cap))
    sched = SCHEDULERS[which]()
    alloc = sched.allocate(100.0, jobs, cluster)
    assert set(alloc) <= {j.name for j in jobs}
    check_allocation(alloc, {j.name: j for j in jobs}, cluster)   # raises if over GPU or CPU capacity
    assert all(alloc[j.name] <= max(j.max_replicas, 1) for j in jobs)
    placement = place(alloc, {}, cluster, pack=sched.pack)
    per_node = np.sum([p for p in placement.values()], axis=0) if placement else np.zeros(nodes)
    assert np.all(per_node <= gpn)
    assert {k: sum(v) for k, v in placement.items()} == {k: n for k, n in alloc.items() if n > 0}


def test_placement_keeps_unchanged_jobs_and_packs():
    cluster = Cluster(num_nodes=3, gpus_per_node=4, cpus_per_node=16)
    first = place({"a": 2, "b": 3}, {}, cluster, pack=True)
    assert first["b"] in [(3, 0, 0), (0, 3, 0), (0, 0, 3)] and sum(1 for c in first["a"] if c) == 1
    second = place({"a": 2, "b": 4, "c": 2}, first, cluster, pack=True)
    assert second["a"] == first["a"] and sum(1 for c in second["b"] if c) == 1
    spread = place({"x": 1, "y": 6}, {}, cluster, pack=False)
    assert spread["y"] == (4, 2, 0) and spread["x"] == (0, 1, 0)
    with pytest.raises(ValueError):
        check_allocation({"a": 13}, {"a": _job(0)}, cluster)


def test_simulator_matches_hand_computed_case():
    """1 node x 4 GPUs, 60 s slots, 30 s restart, step time 1/n s, FIFO.

    A (t=0, 300 steps, 4 GPUs): starts at 0, restart until 30, 0.25 s/step -> finishes at 30 + 75 = 105.
    B (t=30, 120 steps, 2 GPUs): admitted at 60 but blocked by A; starts at 120, restart until 150,
    0.5 s/step -> finishes at 150 + 60 = 210. JCTs 105 and 180; makespan 210;
    busy GPU-seconds 4*105 + 2*90 = 600 of 4*210 -> utilisation 0.714.
    """
    jobs = [_job(0, arrival=0.0, requested=4, steps=300.0), _job(1, arrival=30.0, requested=2, steps=120.0)]
    cfg = SimConfig(num_nodes=1, gpus_per_node=4, cpus_per_node=64, slot_s=60.0, restart_s=30.0, profile_sizes=())
    result = simulate(jobs, lambda job, n, nodes: 1.0 / n, FIFO(), cfg)
    jct = {j["name"]: j["jct"] for j in result.jobs}
    assert jct == pytest.approx({"j0": 105.0, "j1": 180.0})
    assert result.avg_jct_s == pytest.approx(142.5)
    assert result.makespan_s == pytest.approx(210.0)
    assert result.utilization == pytest.approx(600 / 840)
    assert [tuple(x) for x in result.jobs[1]["timeline"]] == [(120.0, 2, 1), (210.0, 0, 0)]


def test_a_job_is_first_scheduled_at_the_slot_boundary_at_or_after_its_arrival():
    """Also for an arrival so close to 0 that arrival / slot underflows (the simulator used to wait forever
    for slot 0, already past)."""
    assert [first_slot(a, 60.0) for a in (0.0, 5e-324, 1e-300, 59.9, 60.0, 60.000000001)] == [0, 1, 1, 1, 1, 2]
    cfg = SimConfig(num_nodes=1, gpus_per_node=1, cpus_per_node=64, slot_s=60.0, restart_s=30.0, profile_sizes=())
    result = simulate([_job(0, arrival=5e-324, requested=1, steps=10.0)], lambda job, n, nodes: 1.0, FIFO(), cfg)
    assert result.jobs[0]["start"] == 60.0 and result.jobs[0]["finish"] == pytest.approx(100.0)


def test_preemption_charges_restart_and_counts_it():
    """Tiresias: B (request 4) preempts A once A passes the first queue threshold."""
    jobs = [_job(0, arrival=0.0, requested=4, steps=1000.0), _job(1, arrival=60.0, requested=4, steps=60.0)]
    cfg = SimConfig(num_nodes=1, gpus_per_node=4, cpus_per_node=64, slot_s=60.0, restart_s=30.0, profile_sizes=())
    result = simulate(jobs, lambda job, n, nodes: 1.0 / n, Tiresias(queues_s=(200.0,)), cfg)
    by = {j["name"]: j for j in result.jobs}
    # A: 0-60 (30 s useful: 120 steps), attained 240 GPU-s -> queue 1; B takes over at 60, finishes at
    # 60 + 30 + 15 = 105; A restarts at 120 (pays 30 s again): 880 steps left -> 120 + 30 + 220 = 370
    assert by["j1"]["finish"] == pytest.approx(105.0)
    assert by["j0"]["finish"] == pytest.approx(370.0) and by["j0"]["restarts"] == 1
    # resize_restart_s=0: starts still cost 30 s, A's resumption at 120 is free -> 120 + 220 = 340
    jobs = [_job(0, arrival=0.0, requested=4, steps=1000.0), _job(1, arrival=60.0, requested=4, steps=60.0)]
    cfg.resize_restart_s = 0.0
    result = simulate(jobs, lambda job, n, nodes: 1.0 / n, Tiresias(queues_s=(200.0,)), cfg)
    by = {j["name"]: j for j in result.jobs}
    assert by["j1"]["finish"] == pytest.approx(105.0) and by["j0"]["finish"] == pytest.approx(340.0)


@pytest.fixture(scope="module")
def small_runs(synthetic_cluster_data):
    specs = load_workload("workloads/workload-1", limit=25)
    cfg = SimConfig(num_nodes=4)
    return {s().name: run_workload(specs, s(), cfg) for s in (FIFO, DRF, FittedModel)}


def test_trace_runs_finish_every_job_and_write_reports(small_runs, tmp_path):
    for name, r in small_runs.items():
        assert len(r.jobs) == 25 and all(j["finish"] >= j["arrival"] for j in r.jobs)
        assert 0 < r.utilization <= 1.0 + 1e-9
    paths = small_runs["fitted"].write(tmp_path / "run")
    assert json.loads(paths[0].read_text())["summary"]["variant"] == "fitted"
    assert paths[1].stat().st_size > 1000 and paths[1].read_bytes()[:4] == b"\x89PNG"


def test_simulator_rejects_an_over_capacity_scheduler():
    class Greedy(FIFO):
        def allocate(self, now, jobs, cluster):
            return {j.name: cluster.gpus for j in jobs}
    jobs = [_job(0), _job(1)]
    cfg = SimConfig(num_nodes=1, gpus_per_node=4, cpus_per_node=64, profile_sizes=())
    with pytest.raises(ValueError, match="capacity"):
        simulate(jobs, lambda job, n, nodes: 1.0, Greedy(), cfg)


def test_fitted_uses_measurements_and_bounds_growth():
    cluster = Cluster(num_nodes=4, gpus_per_node=4, cpus_per_node=64)
    # measured points win over the fit where they exist (the 5-term form cannot follow a one-node dip)
    kinked = SpeedModel("allreduce", batch_size=64)
    for n, t in [(1, 1.0), (2, 0.5), (4, 0.25), (8, 0.9)]:
        kinked.observe(n, max(1, n // 4), t)
    assert kinked.predict_many(np.array([8]), np.array([2]), measured=True)[0] == pytest.approx(0.9)
    assert kinked.largest_observed == 8
    job = _job(0, max_replicas=16)   # measured at 1, 2, 4 devices: grows to at most 2 x 4 = 8
    assert FittedModel().sizes(job, cluster).max() == 8
    assert FittedModel(explore_factor=0).sizes(job, cluster).max() == 16
    # two equally long jobs: A scales linearly, B stops scaling past 2 devices: A gets its 8
    lin, flat = SpeedModel("allreduce", 64), SpeedModel("allreduce", 64)
    for n in (1, 2, 4, 8):
        lin.observe(n, max(1, n // 4), 1.0 / n)
        flat.observe(n, max(1, n // 4), {1: 1.0, 2: 0.5, 4: 0.45, 8: 0.43}[n])
    a = Job("a", 0.0, "x", 64, 1, 1e4, speed_model=lin, max_replicas=8)
    b = Job("b", 0.0, "x", 64, 1, 1e4, speed_model=flat, max_replicas=8)
    small = Cluster(num_nodes=3, gpus_per_node=4, cpus_per_node=64)
    alloc = FittedModel(resize_penalty_s=0.0).allocate(0.0, [a, b], small)
    assert alloc["a"] == 8 and alloc["b"] >= 2
    assert sum(alloc.values()) <= small.gpus


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(1, 12))
def test_place_one_is_what_place_does_for_one_resized_job(used, n):
    cluster = Cluster(num_nodes=len(used), gpus_per_node=4, cpus_per_node=64)
    current = {f"k{i}": tuple(u if k == i else 0 for k in range(len(used))) for i, u in enumerate(used) if u}
    alloc = {name: sum(c) for name, c in current.items()}
    free = [4 - u for u in used]
    counts = place_one(free, n)
    if counts is None:
        assert n > sum(free)
        return
    alloc["new"] = n
    assert list(place(alloc, current, cluster, pack=True)["new"]) == counts


def test_shadow_cost_charges_device_seconds_to_the_jobs_behind():
    r, sizes = np.array([100.0, 70.0, 55.0]), np.array([1, 2, 4])
    assert np.allclose(shadow_cost(r, sizes, 0, 16), r)        # nobody waits: pure speed, largest size wins
    crowded = shadow_cost(r, sizes, 16, 16, beta=1.0)
    assert np.allclose(crowded, r * (1 + sizes))
    assert int(np.argmin(crowded)) == 0                          # many wait: the efficient size wins


def _measured(name, steps, times, max_replicas, allocation=0, placement=()):
    speed = SpeedModel("allreduce", batch_size=64)
    for (n, m), t in times.items():
        speed.observe(n, m, t)
    return Job(name, 0.0, "x", 64, 1, steps, speed_model=speed, max_replicas=max_replicas, cpus_per_replica=1,
               allocation=allocation, placement=placement)


def test_shadow_price_takes_an_efficient_size_while_others_wait_and_all_of_it_alone():
    cluster = Cluster(num_nodes=4, gpus_per_node=4, cpus_per_node=64)
    sched = FittedOracle(resize_penalty_s=0.0)
    short = lambda: _measured("a", 1000.0, {(1, 1): 1.0, (2, 1): 0.7, (4, 1): 0.55}, max_replicas=4)
    assert sched.allocate(0.0, [short()], cluster)["a"] == 4
    linear = {(n, max(1, n // 4)): 1.0 / n for n in (1, 2, 4, 8)}
    crowd = [_measured(f"b{i}", 1e5 * (i + 1), linear, max_replicas=16) for i in range(3)]
    alloc = sched.allocate(0.0, [short()] + crowd, cluster)
    assert alloc["a"] == 2                                       # 3 jobs wait behind it: R(n)·(1 + 2·3·n/16)
    assert sum(alloc.values()) == cluster.gpus                   # the rest goes to the long jobs, shortest first
    assert alloc["b0"] == max(alloc[f"b{i}"] for i in range(3))


def test_shadow_price_does_not_spread_a_small_job_over_two_nodes():
    cluster = Cluster(num_nodes=2, gpus_per_node=4, cpus_per_node=64)
    flat = {(1, 1): 1.0, (2, 1): 0.5}
    kept = [_measured("k1", 1e6, flat, 2, 2, (2, 0)), _measured("k2", 1e6, flat, 1, 1, (1, 0)),
            _measured("k3", 1e6, flat, 2, 2, (0, 2)), _measured("k4", 1e6, flat, 1, 1, (0, 1))]
    # one device free on each node: two devices would span both nodes, where this job is slower than on one
    new = _measured("n", 1000.0, {(1, 1): 1.0, (2, 1): 0.6, (2, 2): 2.0}, max_replicas=2)
    alloc = FittedOracle(resize_penalty_s=0.0).allocate(0.0, kept + [new], cluster)
    assert {k.name: alloc[k.name] for k in kept} == {"k1": 2, "k2": 1, "k3": 2, "k4": 1}
    assert alloc["n"] == 1
    assert FittedOracle(resize_penalty_s=0.0, repair_placement=0).allocate(0.0, kept + [new], cluster)["n"] == 2


def test_prior_comes_from_finished_jobs_of_the_same_application():
    by_app, mixed = FittedModel(), FittedModel(prior_by_app=False)
    for name, app, steps in [("c1", "cifar10", 400.0), ("c2", "cifar10", 900.0), ("i1", "imagenet", 90000.0)]:
        done = _job(name, steps=steps, progress=steps, attained=steps * 0.69)   # 0.69 s a step on one device
        done.application = app
        by_app.job_finished(done), mixed.job_finished(done)
    new = _job("new")                                           # a cifar10 job without a loss fit yet
    assert by_app.remaining_steps(new) == pytest.approx(600.0)  # geometric mean of the finished cifar10 jobs
    assert mixed.remaining_steps(new) == pytest.approx(3187.0, rel=1e-3)   # the whole mix: imagenet included
    other = _job("other")
    other.application = "bert"                                   # no finished bert job: the mix's prior
    assert by_app.remaining_steps(other) == pytest.approx(mixed.remaining_steps(other))
    by_app.reset()
    assert by_app.remaining_steps(new) == pytest.approx(FittedModel().remaining_steps(new))


class _GrowingEstimate(FittedModel):
    """Estimated length a hundred times the progress: what the early-fit cap gives a running job."""

    def remaining_steps(self, j):
        return 99.0 * j.progress


def test_a_running_jobs_rank_grows_at_most_rank_freeze_times_its_key_when_placed():
    cluster = Cluster(num_nodes=1, gpus_per_node=1, cpus_per_node=8)

    def pair(progress_a, progress_b, placed_at=0.0):
        a = _measured("a", 1e6, {(1, 1): 1.0}, 1, allocation=1, placement=(1,))
        a.progress, a.timeline = progress_a, [(placed_at, 1, 1)]
        b = _measured("b", 1e6, {(1, 1): 1.0}, 1)
        b.progress = progress_b
        return [a, b]

    for freeze, winner in [(0.0, "b"), (2.0, "a")]:
        sched = _GrowingEstimate(resize_penalty_s=0.0, rank_freeze=freeze)
        assert sched.allocate(60.0, pair(10.0, 12.0), cluster)["a"] == 1     # shorter: keeps running (key 990)
        # it ran on: 2970 now, above the waiting job's 2475, but under 2 x 990
        assert sched.allocate(120.0, pair(30.0, 25.0), cluster)[winner] == 1
    # the limit is relative to the latest placement: re-placed at 120 s, its key there is the new reference
    assert sched.allocate(180.0, pair(30.0, 25.0, placed_at=120.0), cluster)["b"] == 1
    sched.reset()
    assert sched._placed_key == {}
