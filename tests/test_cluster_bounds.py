"""Lower bounds on average JCT: the speed-up envelope is right, the LP matches a hand-computed case and
stays below what every scheduler reaches in the simulator."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnijax.cluster.bounds import alone_bound, concave_cuts, lagrangian_bound, lp_bound
from omnijax.cluster.jobs import Job
from omnijax.cluster.schedulers import DRF, FIFO, FittedModel, Tiresias
from omnijax.cluster.simulator import SimConfig, jobs_from_specs, run_workload, simulate
from omnijax.cluster.traces import load_workload



pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")  # no shared data needed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=12))
def test_concave_cuts_are_the_upper_envelope(increments):
    rates = np.concatenate([[0.0], np.cumsum(increments)])
    cuts = concave_cuts(rates)
    env = np.array([min(a * n + b for a, b in cuts) for n in range(len(rates))])
    assert np.all(env >= rates - 1e-9)                      # above every point
    assert env[0] == pytest.approx(0.0, abs=1e-9) and env[-1] == pytest.approx(rates[-1])
    slopes = [a for a, _ in cuts]
    assert all(s1 >= s2 - 1e-12 for s1, s2 in zip(slopes, slopes[1:]))   # concave
    # the smallest concave majorant: every kink of the envelope is one of the points
    kinks = [n for n in range(1, len(rates) - 1) if env[n] - env[n - 1] > env[n + 1] - env[n] + 1e-9]
    assert all(env[n] == pytest.approx(rates[n]) for n in kinks)


def _one_device_job(name: str, steps: float) -> Job:
    return Job(name=name, arrival=0.0, application="x", batch_size=1, requested=1, total_steps=steps,
               max_replicas=1)


def test_lp_bound_matches_a_hand_computed_case():
    """One device, 60 s slots, 30 s restart, two 1000-step jobs at 1 s/step arriving at 0.

    Neither can progress before 30 s; one after the other (or shared) they complete on average at 1530.
    The relaxation may place both jobs' work in an interval at its start, so it is below that by less
    than one interval, and converges as the intervals shrink. The simulator also pays the second job's slot wait and restart: FIFO
    finishes it at 1080 + 30 + 1000 = 2110 (average 1570)."""
    cfg = SimConfig(num_nodes=1, gpus_per_node=1, cpus_per_node=64, slot_s=60.0, restart_s=30.0, profile_sizes=())
    step = lambda job, n, nodes: 1.0  # noqa: E731
    got = {}
    for dt in (300.0, 60.0, 5.0):
        got[dt] = lp_bound([_one_device_job("a", 1000.0), _one_device_job("b", 1000.0)], step, cfg, interval_s=dt).avg_jct_s
        assert 1530.0 - dt <= got[dt] <= 1530.0 + 1e-6
    assert got[5.0] > got[60.0] > got[300.0]   # converges to 1530 as the intervals shrink
    sim = simulate([_one_device_job("a", 1000.0), _one_device_job("b", 1000.0)], step, FIFO(), cfg)
    assert sim.avg_jct_s == pytest.approx(1570.0)
    assert alone_bound([_one_device_job("a", 1000.0)], step, cfg.cluster) == pytest.approx(1000.0)


@pytest.fixture(scope="module")
def trace_runs(synthetic_cluster_data):
    """25 jobs of a synthetic workload on 16 devices, and the average JCT every scheduler reaches on them."""
    specs = load_workload("workloads/workload-1", limit=25)
    cfg = SimConfig(num_nodes=4)
    return specs, cfg, {s().name: run_workload(specs, s(), cfg).avg_jct_s for s in (FIFO, DRF, Tiresias, FittedModel)}


def test_lp_bound_is_below_every_scheduler_on_a_trace(trace_runs):
    specs, cfg, results = trace_runs
    bound = lp_bound(*jobs_from_specs(specs, cfg), cfg, interval_s=300.0)
    alone = alone_bound(*jobs_from_specs(specs, cfg), cfg.cluster)
    assert all(bound.avg_jct_s < r for r in results.values()), (bound, results)
    # the relaxation knows the cluster is shared, so it is tighter than the no-queueing bound here
    assert bound.avg_jct_s > alone


def test_lagrangian_bound_charges_true_completion_on_a_hand_computed_case():
    """Two devices, 60 s slots, 30 s restart, both jobs arrive at 0 (so progress starts at 30).

    A takes 2000 s on one device and 1500 s on two; B runs on one device only, 2000 s. Best: both on one
    device, done at 2030 (A on two first ends at 1530 but B at 3530: average 2530). FIFO runs exactly that.
    The LP charges A only M_A + p_A/2 = 1030 + 750 (B: 1030 + 1000): (1780 + 2030)/2 = 1905. The Lagrangian
    bound charges A's real completion; it only loses, in A's last interval, work done at one device's
    rate but timed at two devices' (a quarter of that interval)."""
    cfg = SimConfig(num_nodes=1, gpus_per_node=2, cpus_per_node=64, slot_s=60.0, restart_s=30.0, profile_sizes=())
    times = {("a", 1): 2000.0, ("a", 2): 1500.0, ("b", 1): 2000.0}
    step = lambda job, n, nodes: times[(job.name, n)]  # noqa: E731

    def jobs():
        return [Job("a", 0.0, "x", 2, 1, 1.0, max_replicas=2), Job("b", 0.0, "x", 1, 1, 1.0, max_replicas=1)]
    fifo = simulate(jobs(), step, FIFO(), cfg).avg_jct_s
    assert fifo == pytest.approx(2030.0)
    got = lagrangian_bound(jobs(), step, cfg, interval_s=60.0, iterations=100)
    assert 1905.0 - 60.0 <= got.lp_avg_jct_s <= 1905.0 + 1e-6
    assert 2030.0 - 60.0 / 4 - 15.0 <= got.avg_jct_s <= fifo + 1e-6
    assert got.avg_jct_s <= got.master_avg_jct_s + 1e-6
    assert np.mean(got.master_completion) == pytest.approx(got.master_avg_jct_s)   # both arrive at 0


def test_lagrangian_bound_is_between_the_lp_and_every_scheduler_on_a_trace(trace_runs):
    specs, cfg, results = trace_runs
    lag = lagrangian_bound(*jobs_from_specs(specs, cfg), cfg, interval_s=300.0, iterations=3)
    assert lag.avg_jct_s > 1.02 * lag.lp_avg_jct_s, lag      # tighter than the LP on the same intervals
    assert all(lag.avg_jct_s < r for r in results.values()), (lag, results)


def test_lp_bound_rejects_bad_input():
    cfg = SimConfig(num_nodes=1, gpus_per_node=1)
    with pytest.raises(ValueError, match="interval_s"):
        lp_bound([_one_device_job("a", 10.0)], lambda job, n, nodes: 1.0, cfg, interval_s=0.0)
    with pytest.raises(ValueError, match="at least one job"):
        lp_bound([], lambda job, n, nodes: 1.0, cfg)


def test_simulator_refuses_to_grow_a_job_past_its_max_replicas():
    """The bounds assume no job runs on more devices than its batch allows; the simulator enforces it."""
    class Greedy(FIFO):
        def allocate(self, now, jobs, cluster):
            return {j.name: cluster.gpus for j in jobs}
    cfg = SimConfig(num_nodes=1, gpus_per_node=4, cpus_per_node=64, profile_sizes=())
    with pytest.raises(ValueError, match="max_replicas"):
        simulate([_one_device_job("a", 10.0)], lambda job, n, nodes: 1.0, Greedy(), cfg)


def _brute_job_minimum(rates, cpus, release, starts, dt, lam, mu):
    """The per-job Lagrangian problem as one small LP per completion interval (work ≤ a·D + b·time for
    every line above the envelope), minimised over the intervals: what `_JobPricer` must equal."""
    from scipy.optimize import linprog
    lines = concave_cuts(rates)
    run_all = np.clip(starts + dt - release, 0.0, dt)
    ks = np.nonzero(run_all > 0)[0]
    run, p = run_all[ks], (lam + mu * cpus)[ks]
    t0 = np.maximum(starts[ks], release)
    best = max(starts[-1] + dt, release + 1.0 / rates.max())
    for K in range(len(ks)):
        n = K + 1                              # variables: W_0..W_K, D_0..D_K, u
        c = np.concatenate([np.zeros(n), p[:n], [1.0]])
        A, b = [], []
        for q in range(n):
            for a, icpt in lines:
                row = np.zeros(2 * n + 1)
                row[q], row[n + q] = 1.0, -a
                if q == K:                     # the completion interval: b·u, u its running time
                    row[-1] = -icpt
                A.append(row)
                b.append(icpt * run[q] if q < K else 0.0)
        res = linprog(c, A_ub=np.array(A), b_ub=b, A_eq=np.r_[np.ones(n), np.zeros(n + 1)][None, :], b_eq=[1.0],
                      bounds=[(0, None)] * (2 * n) + [(0, run[K])], method="highs")
        if res.status == 0:
            best = min(best, t0[K] + res.fun)
    return best


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=6), st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
       st.floats(0.0, 250.0), st.floats(100.0, 700.0))
def test_job_pricer_is_the_exact_per_job_minimum(increments, prices, release, alone_s):
    """The Lagrangian bound's per-job term equals a brute-force LP of the same relaxed schedule, and the
    schedule it returns costs exactly its value (so column generation converges to the dual)."""
    from omnijax.cluster.bounds import _JobPricer
    rates = np.concatenate([[0.0], np.cumsum(increments)])
    rates = rates / rates[-1] / alone_s          # done in alone_s at the largest size: inside the 8 intervals
    dt, starts = 100.0, 100.0 * np.arange(8)
    lam, mu = np.array(prices) / 4.0, np.array(prices[::-1]) / 40.0
    pricer = _JobPricer(rates, 2.0, release, starts, dt)
    value, c, dev = pricer.price(lam, mu)
    assert value == pytest.approx(_brute_job_minimum(rates, 2.0, release, starts, dt, lam, mu), rel=1e-6, abs=1e-6)
    if dev is not None:
        p = (lam + mu * 2.0)[pricer.ks]
        assert c + p @ dev == pytest.approx(value, rel=1e-9)


def test_lagrangian_bound_warm_started_on_finer_intervals(trace_runs):
    """Halving the intervals from a coarse bound's prices climbs above it and stays below every scheduler."""
    specs, cfg, results = trace_runs
    jobs, step = jobs_from_specs(specs, cfg)
    coarse = lagrangian_bound(jobs, step, cfg, interval_s=600.0, iterations=3)
    fine = lagrangian_bound(jobs, step, cfg, interval_s=300.0, iterations=10, warm=coarse)
    assert fine.interval_s == 300.0 and len(fine.starts) == 2 * len(coarse.starts)
    assert coarse.avg_jct_s < fine.avg_jct_s < min(results.values()), (coarse, fine, results)
    with pytest.raises(ValueError, match="multiple"):
        lagrangian_bound(jobs, step, cfg, interval_s=400.0, warm=coarse)
