"""Workload families where the fitted forms break (omnijax/cluster/families.py), the `fitted_aware` baseline and
the learned scheduler's view of them: each family changes the hidden truth the way its docstring says, off means
the simulator is unchanged, the fitted loss form misreads a step-decay plateau, bad names and parameters are
one-line ConfigErrors, and the untrained learned policy is still the fitted scheduler under every family."""
import math

import numpy as np
import pytest

from omnijax.cluster import families as fam
from omnijax.cluster.aware import FittedAware, NodeSpeeds, slowdown
from omnijax.cluster.config import ClusterConfig, LearnedConfig, validate
from omnijax.cluster.jobs import Cluster, Job, place, place_one
from omnijax.cluster.perf_model import SpeedModel, fit_loss_curve
from omnijax.cluster.residual.scheduler import ResidualScheduler
from omnijax.cluster.residual.store import load_policy, save_policy
from omnijax.cluster.residual.workloads import episode_configs
from omnijax.cluster.schedulers import DRF, FittedModel
from omnijax.cluster.simulator import SimConfig, jobs_from_specs, run_workload
from omnijax.cluster.traces import load_profile, load_workload
from omnijax.errors import ConfigError, UserError

pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")

CFG = SimConfig(num_nodes=2, slot_s=300.0)


def _timelines(result):
    return [(j["name"], j["timeline"]) for j in result.jobs]


def test_families_off_is_the_unchanged_simulator_and_each_family_changes_it():
    from omnijax.cluster.simulator import simulate
    specs = load_workload("workloads/workload-1", 10)
    base = run_workload(specs, FittedModel(), CFG)
    assert _timelines(run_workload(specs, FittedModel(), SimConfig(num_nodes=2, slot_s=300.0, families=()))) == \
        _timelines(base)

    def losses(cfg):
        jobs, step_time = jobs_from_specs(specs, cfg)
        simulate(jobs, step_time, DRF(), cfg)
        return [j.loss_model.losses for j in jobs]
    assert losses(SimConfig(num_nodes=2, families=("stepdecay",))) != losses(SimConfig(num_nodes=2))
    for f in ("straggler", "turnover"):
        other = run_workload(specs, FittedModel(), SimConfig(num_nodes=2, slot_s=300.0, families=(f,),
                                                             straggler_frac=1.0, turnover_size=2))
        assert other.avg_jct_s > base.avg_jct_s, f


def test_slowdowns_straggler_is_the_slowest_node_and_interference_weighs_neighbours():
    cfg = SimConfig(num_nodes=3, families=("straggler", "interference"), interference_alpha=0.5, interference_cap=1.4)
    slow = np.array([1.0, 1.5, 1.0])
    placements = {"a": (2, 0, 0), "b": (2, 2, 0), "c": (0, 0, 4)}
    shares = {"a": 0.2, "b": 0.6, "c": 0.9}
    out = fam.slowdowns(cfg, placements, shares, slow)
    assert out["a"] == pytest.approx(1.0 * (1 + 0.5 * 0.6))          # neighbour b on node 0
    assert out["b"] == pytest.approx(1.5 * (1 + 0.5 * 0.2))          # node 1 is slow; neighbour a
    assert out["c"] == pytest.approx(1.0)                            # alone on a normal node
    capped = fam.slowdowns(cfg, {"a": (2, 0, 0), "b": (2, 0, 0)}, {"a": 1.0, "b": 1.0}, slow)
    assert capped["a"] == pytest.approx(1.4)


def test_straggler_nodes_slow_the_measured_step_times():
    specs = load_workload("workloads/workload-1", 6)
    cfg = SimConfig(num_nodes=2, slot_s=300.0, families=("straggler",), straggler_frac=1.0, straggler_slowdown=2.0,
                    speed_noise=0.0)
    jobs, step_time = jobs_from_specs(specs, cfg)
    from omnijax.cluster.simulator import simulate
    simulate(jobs, step_time, DRF(), cfg)
    for j in jobs:      # every node is slow: every measurement after profiling is twice the profile
        later = [v for vals in j.speed_model.points.values() for v in vals[1:]]
        assert later and all(v == pytest.approx(2.0 * j.speed_model.points[k][0])
                             for k, vals in j.speed_model.points.items() for v in vals[1:])


def test_interference_slows_co_located_jobs_under_drf():
    specs = load_workload("workloads/workload-1", 10)
    plain = run_workload(specs, DRF(), CFG)
    noisy = run_workload(specs, DRF(), SimConfig(num_nodes=2, slot_s=300.0, families=("interference",),
                                                 interference_alpha=2.0))
    assert noisy.avg_jct_s > plain.avg_jct_s


def test_stepdecay_plateau_fools_the_fitted_loss_form():
    """Before the first learning-rate drop the 1/(a·k + b) + c fit takes the plateau for convergence (too short);
    once a drop is in the history it predicts a job several times longer than it is."""
    curve = fam.StepDecayLoss(total_steps=3000.0, c=0.5, gap=1.0, milestones=(1 / 3, 2 / 3, 8 / 9), factor=0.3)
    k = np.arange(20.0, 980.0, 20.0)
    assert fit_loss_curve(k, curve(k)).steps_to_converge(0.05) < 0.8 * 3000.0
    k = np.arange(20.0, 1500.0, 20.0)
    assert fit_loss_curve(k, curve(k)).steps_to_converge(0.05) > 3 * 3000.0
    before, after = float(curve(990.0)), float(curve(1100.0))
    assert after < before - 0.1                                           # the learning-rate drop
    every = np.arange(20.0, 2900.0, 20.0)
    assert _watch_curve(curve, every, 0) is not None and _watch_curve(lambda x: 1.0 / (0.002 * x + 1.0) + 0.5, every, 0) is None


def test_turnover_only_past_its_size_and_only_for_communication_bound_apps():
    cfg = SimConfig(families=("turnover",), turnover_size=8)
    bert, imagenet = load_profile("bert"), load_profile("imagenet")
    f = fam.turnover_step_time(bert, cfg)
    assert f(8, 2, 192) == bert.step_time(8, 2, 192)
    assert f(16, 4, 192) > f(8, 2, 192) > bert.step_time(16, 4, 192)      # speed falls past 8
    g = fam.turnover_step_time(imagenet, cfg)                               # compute-bound in the fixture
    assert g(16, 4, 3200) == imagenet.step_time(16, 4, 3200)


@pytest.mark.parametrize("sim, match", [
    (dict(families=("gremlins",)), "unknown family"),
    (dict(straggler_slowdown=0.5), "straggler"),
    (dict(decay_milestones=(0.7, 0.3)), "decay_milestones"),
    (dict(interference_alpha=-1.0), "interference"),
    (dict(turnover_size=0), "turnover"),
])
def test_bad_family_settings_are_one_line_config_errors(sim, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate(ClusterConfig(sim=SimConfig(**sim)))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=match):
        run_workload(load_workload("workloads/workload-1", 2), FittedModel(), SimConfig(**sim))


def test_unknown_training_family_is_a_config_error():
    with pytest.raises(ConfigError, match="train_families"):
        validate(ClusterConfig(learned=LearnedConfig(train_families=["stepdecay", "solar flares"])))
    with pytest.raises(ConfigError, match="supervised_columns"):
        validate(ClusterConfig(learned=LearnedConfig(supervised_columns=[15, 99])))
    with pytest.raises(ConfigError, match="anchor_workloads"):
        validate(ClusterConfig(learned=LearnedConfig(anchor_workloads=-1)))


def test_node_order_breaks_ties_only():
    assert place_one([4, 4, 4], 4, order=[2, 0, 1]) == [0, 0, 4]
    assert place_one([4, 4, 4], 4) == [4, 0, 0]
    assert place_one([2, 4, 4], 2, order=[2, 1, 0]) == [2, 0, 0]          # the tightest fit still wins
    got = place({"a": 8}, {}, Cluster(3, 4, 32), order=[1, 2, 0])
    assert got["a"] == (0, 4, 4)


def _running(name, placement, observed, profiled=1.0):
    speed = SpeedModel("allreduce", batch_size=64)
    n, m = sum(placement), sum(1 for c in placement if c)
    speed.observe(n, m, profiled)
    j = Job(name=name, arrival=0.0, application="cifar10", batch_size=64, requested=n, total_steps=100.0,
            allocation=n, placement=placement, speed_model=speed)
    j.observed_step_s = observed
    return j


def test_fitted_aware_finds_the_slow_node_from_measured_step_times():
    cluster = Cluster(3, 4, 32)
    jobs = [_running("a", (4, 0, 0), 1.0), _running("b", (0, 4, 0), 1.8), _running("c", (0, 0, 4), 1.0)]
    assert slowdown(jobs[1]) == pytest.approx(1.8)
    slow = NodeSpeeds(memory=0.0).update(jobs, cluster)
    assert slow.tolist() == pytest.approx([1.0, 1.8, 1.0])
    sched = FittedAware()
    sched.observe(jobs, cluster)
    assert sched.node_order(cluster)[-1] == 1                              # the slow node last
    # one slot seen: the estimate moved halfway from 1 to 1.8; a job of m nodes lands on m nodes drawn at random
    assert sched.nodes.slow.tolist() == pytest.approx([1.0, 1.4, 1.0])
    assert sched.expected_slowdown(np.array([1, 3])).tolist() == pytest.approx([1.0 + 0.4 / 3, 1.4 - 0.4 * (2 / 3) ** 3])


def test_fitted_aware_prices_the_size_a_job_holds_like_any_other():
    """A job on a slow node, priced at its own measured slowdown, saw every other size as faster and moved each
    slot to nodes as likely slow (restarts x2.8 on a generated straggler workload): the held size takes the
    expected slowdown too, so the slow node does not push the job to resize."""
    cluster = Cluster(3, 4, 32)
    jobs = [_running("a", (4, 0, 0), 1.0), _running("b", (0, 4, 0), 1.8), _running("c", (0, 0, 4), 1.0)]
    sched = FittedAware()
    sched.observe(jobs, cluster)
    on_slow, on_fast = (sched.remaining_times(j, np.array([4]), cluster) for j in jobs[1:])
    assert on_slow == pytest.approx(on_fast)
    expected = sched.remaining_steps(jobs[1]) * 1.0 * sched.expected_slowdown(np.array([1]))[0]   # profiled 1 s
    assert on_slow[0] == pytest.approx(expected)


def test_learned_node_weights_adjust_the_fast_first_order_rather_than_replace_it():
    cluster = Cluster(3, 4, 32)
    sched = ResidualScheduler(hidden=4, aware=True)
    sched.nodes.slow = np.array([1.0, 1.5, 1.0])
    feats = np.zeros((3, 3))
    feats[:, 0] = np.log(sched.nodes.slow)
    feats[:, 1] = [0.5, 0.0, 0.25]                     # jobs on each node (x 0.25)
    sched._node_features = feats
    assert sched.node_order(cluster) == [0, 2, 1]      # zero weights: fitted_aware's order
    sched.theta[sched.mlp.head + 2 * sched.mlp.features:][:3] = [0.0, 0.1, 0.0]   # small weight on occupancy
    assert sched.mlp.node_weights(sched.theta).tolist() == [0.0, 0.1, 0.0]
    assert sched.node_order(cluster) == [2, 0, 1]      # the emptier fast node first; the slow node still last
    sched.aware = False
    assert sched.node_order(cluster) == [1, 2, 0]      # without the fast-first term: occupancy alone


def test_fitted_aware_and_untrained_learned_run_every_family():
    specs = load_workload("workloads/workload-2", 10)
    cfg = SimConfig(num_nodes=2, slot_s=300.0, families=fam.FAMILIES)
    a = run_workload(specs, FittedModel(), cfg)
    b = run_workload(specs, ResidualScheduler(hidden=4), cfg)
    assert _timelines(a) == _timelines(b)          # the warm start is the fitted scheduler, families or not
    c = run_workload(specs, FittedAware(), cfg)
    assert len(c.jobs) == len(specs) and all(math.isfinite(j["jct"]) for j in c.jobs)


def test_policy_round_trips_and_bad_files_are_user_errors(tmp_path):
    sched = ResidualScheduler(hidden=4)
    sched.theta = sched.theta + 0.01
    sched.accepted, sched.validation_vs_fitted = True, 0.93
    save_policy(str(tmp_path / "p.npz"), sched)
    back = load_policy(str(tmp_path / "p.npz"))
    assert np.array_equal(back.theta, sched.theta) and back.accepted and back.validation_vs_fitted == 0.93
    assert back.anchor.size == 0
    save_policy(str(tmp_path / "a.npz"), ResidualScheduler(hidden=4, anchor=[2.9, 2.5]))
    assert load_policy(str(tmp_path / "a.npz")).anchor.tolist() == [2.5, 2.9]
    (tmp_path / "bad.npz").write_text("not a policy")
    with pytest.raises(UserError, match="not a saved learned policy"):
        load_policy(str(tmp_path / "bad.npz"))


def test_training_episodes_draw_families_and_seeds():
    rng = np.random.default_rng(0)
    sims = episode_configs(CFG, ["stepdecay", "straggler"], 30, rng)
    assert {s.families for s in sims} == {(), ("stepdecay",), ("straggler",)}
    assert len({s.seed for s in sims}) == 30
    assert episode_configs(CFG, [], 3, rng) == [CFG] * 3


def _watch_curve(curve, steps, seed, noise=0.01):
    """Feed a loss curve to a LossModel as the simulator does (1% relative noise); the first drop a DropWatch sees."""
    from omnijax.cluster.perf_model import LossModel
    from omnijax.cluster.residual.drops import DropWatch
    rng = np.random.default_rng(seed)
    model, watch = LossModel(), DropWatch()
    for k in steps:
        model.observe(float(k), float(curve(k)) * (1.0 + noise * rng.standard_normal()))
        if watch.update("job", model) is not None:
            return watch.first["job"]
    return None


def test_a_drop_is_seen_within_a_few_observations_and_a_smooth_curve_gives_none():
    """The drop watch flags a step-decay drop within a few observations of the milestone (the block test of
    the block test it replaced needed several blocks), and never flags a noisy 1/(a·k + b) + c curve."""
    total, dk = 3000.0, 30.0
    steps = np.arange(dk, total, dk)
    for seed in range(5):
        c, gap = 0.2 + 0.4 * seed, 1.0
        curve = fam.StepDecayLoss(total_steps=total, c=c, gap=gap, milestones=(1 / 3, 2 / 3, 8 / 9), factor=0.3)
        at = _watch_curve(curve, steps, seed)
        assert at is not None and total / 3 <= at <= total / 3 + 4 * dk, (seed, at)
        smooth = lambda k, a=0.001 * (seed + 1), c=c: 1.0 / (a * k + 1.0) + c
        assert _watch_curve(smooth, steps, seed) is None


def test_drop_anchor_learns_where_drops_fall_and_is_silent_without_them():
    """The anchor (lengths over the steps at the first seen drop) is learned from finished jobs: near 3 when the
    schedule decays first at a third of the job, near 2 at half; with it on, no drop means fitted's decisions."""
    from omnijax.cluster.residual.supervised import drop_anchor
    specs = [load_workload("workloads/workload-1", 40), load_workload("workloads/workload-2", 40)]
    med = {}
    for first, rest in ((1 / 3, (2 / 3, 8 / 9)), (1 / 2, (3 / 4,))):
        sims = [SimConfig(slot_s=30.0, families=("stepdecay",), decay_milestones=(first, *rest), seed=s) for s in (0, 1)]
        anchor, stats = drop_anchor(specs, sims, hidden=4)
        assert stats["jobs"] >= 5 and len(anchor) == 10
        med[first] = float(np.median(anchor))
    assert 2.4 < med[1 / 3] < 3.05 and 1.6 < med[1 / 2] < 2.05, med
    cfg = SimConfig(num_nodes=2, slot_s=300.0)
    a = run_workload(specs[0], FittedModel(), cfg)
    b = run_workload(specs[0], ResidualScheduler(hidden=4, anchor=[2.5, 2.9]), cfg)
    assert _timelines(a) == _timelines(b)


def test_supervised_length_correction_learns_from_finished_jobs():
    """The warm start's supervised step fits log(true / fitted remaining) on the features of the slots the fitted
    decisions visited; only the ranking output's linear path on the misfit features changes. Under step-decay
    losses whose first drop comes at a third of the job, the true remaining steps after a drop seen at step d are
    about 3d - now, so log(true / fitted remaining) = log(d / fitted remaining) + log(3 - now / d): the weight
    of column 18 (log(d / fitted remaining)) is 1 in the generator, and the fit finds it."""
    from omnijax.cluster.residual.policy import MLP
    from omnijax.cluster.residual.supervised import MISFIT_COLUMNS, length_correction
    specs = [load_workload("workloads/workload-1", 12), load_workload("workloads/workload-2", 12)]
    sims = [SimConfig(num_nodes=2, slot_s=60.0, families=("stepdecay",), seed=s) for s in (0, 1)]
    theta, stats = length_correction(specs, sims, hidden=4, seed=0)
    mlp = MLP(hidden=4)
    base = mlp.init(0)
    changed = np.flatnonzero(theta != base)
    assert stats["rows"] > 50 and stats["residual_sd"] < stats["target_sd"]
    assert 0.8 < stats["weights"][MISFIT_COLUMNS.index(18)] < 1.2, stats
    assert changed.size and set(changed) <= {mlp.head + 2 * c for c in MISFIT_COLUMNS}   # L[c, 0]: the rank output
    assert np.allclose(theta[[mlp.head + 2 * c for c in MISFIT_COLUMNS]], stats["weights"], atol=5e-4)


def test_length_correction_recovers_the_generators_weights(monkeypatch):
    """Rows from a known generator, log(true / fitted remaining) = x[MISFIT_COLUMNS] @ w + noise (sd 0.2), fed to
    length_correction through the recorder in place of a simulation: the fitted weights are the generator's
    (within 0.03: the standard error is ~0.005 at 3000 rows, the ridge's shrinkage ~0.001), the other
    features are ignored, and r² is the generator's 1 - noise variance / target variance (within 0.02)."""
    from types import SimpleNamespace

    from omnijax.cluster import simulator
    from omnijax.cluster.residual.supervised import MISFIT_COLUMNS, length_correction

    w_true = np.array([0.6, -0.4, 0.9, -0.7])
    rng = np.random.default_rng(0)
    made = {}

    def fake_run_jobs(specs, rec, sim):
        n, jobs = 1500, []
        for i in range(n):
            x = rng.normal(0.0, 1.0, 24)   # every feature varies; only the misfit columns carry the signal
            x[list(MISFIT_COLUMNS)] = rng.normal(0.0, 0.5, len(MISFIT_COLUMNS))
            y = float(x[list(MISFIT_COLUMNS)] @ w_true + rng.normal(0.0, 0.2))
            fitted, progress = float(rng.uniform(100, 1000)), float(rng.uniform(0, 500))
            name = f"{sim.seed}-{i}"
            rec.rows.append((name, progress, fitted, x))
            jobs.append(SimpleNamespace(name=name, total_steps=progress + fitted * math.exp(y)))
            made.setdefault("y", []).append(y)
        return jobs, None

    monkeypatch.setattr(simulator, "run_jobs", fake_run_jobs)
    _, stats = length_correction([[], []], [SimpleNamespace(seed=0), SimpleNamespace(seed=1)], hidden=4)
    assert stats["rows"] == 3000
    assert np.allclose(stats["weights"], w_true, atol=0.03), stats["weights"]
    y = np.array(made["y"])
    assert stats["r2"] == pytest.approx(1 - 0.2 ** 2 / y.var(), abs=0.02)


def test_executor_learned_needs_a_saved_policy_and_bench_needs_seeds(tmp_path, monkeypatch):
    from recipes import cluster_exec
    from recipes.bench import cluster as bench_cluster
    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path))
    with pytest.raises(ConfigError, match="policy=PATH"):
        cluster_exec.main(["scheduler=learned", "runner=toy", "jobs=1", "steps=[5]", "arrivals_s=[0]"])
    with pytest.raises(ConfigError, match="applications"):
        cluster_exec.main(["scheduler=fitted", "runner=toy", "jobs=1", "steps=[5]", "arrivals_s=[0]",
                           'applications=[""]'])
    with pytest.raises(ConfigError, match="seeds"):
        list(bench_cluster.run(["schedulers=[fitted]", "seeds=0"]))
    with pytest.raises(ConfigError, match="unknown family"):
        list(bench_cluster.run(["schedulers=[fitted]", "sim.families=[gremlins]"]))


def test_bench_seeds_rows_average_every_seed(tmp_path, monkeypatch):
    from recipes.bench import cluster as bench_cluster
    rows = list(bench_cluster.run(["schedulers=[fitted,fitted_aware]", "workloads=[workloads]", "files=1", "limit=6",
                                   "seeds=2", "lp_interval_s=0", "lagrange_interval_s=0", "sim.num_nodes=2",
                                   "sim.slot_s=300", "sim.families=[straggler]", "sim.straggler_frac=0.5"]))
    fitted, aware = rows[0], rows[1]
    assert fitted["families"] == ["straggler"] and len(fitted["per_seed"][0]) == 2
    assert fitted["avg_jct_s"] == pytest.approx(np.mean(fitted["per_seed"]), abs=0.1)
    assert aware["vs"] == "fitted" and aware["ratio_per_run_range"][0] <= aware["ratio_per_run_mean"] <= \
        aware["ratio_per_run_range"][1]


def test_class_lengths_predict_recurring_jobs_and_fall_back_when_outlived():
    from types import SimpleNamespace as Seen
    from omnijax.cluster.residual.lengths import ClassLengths
    lengths = ClassLengths()
    for i, done in enumerate((100.0, 120.0, 300.0)):
        lengths.finished(Seen(application="cifar10", batch_size=2048, progress=done, name=f"c{i}"))
    job = lambda progress, batch=2048: Seen(application="cifar10", batch_size=batch, progress=progress)
    assert lengths.remaining(job(0.0)) == 120.0                       # the median of the class's lengths
    assert lengths.remaining(job(110.0)) == pytest.approx(210.0 - 110.0)   # ... of those it has not outlived
    assert lengths.remaining(job(400.0)) is None                      # outlived them all: the fit decides
    assert lengths.remaining(job(0.0, batch=4096)) is None            # another batch size is another class
    # scored when jobs finish: a class whose lengths predicted worse than the other estimate is not trusted
    other = Seen(application="bert", batch_size=384, progress=0.0, name="b1")
    assert lengths.trusted(other)                                     # nothing scored yet
    lengths.record(other, 1000.0, 410.0)
    lengths.record(other, 900.0, 390.0)
    lengths.finished(Seen(application="bert", batch_size=384, progress=400.0, name="b1"))
    assert not lengths.trusted(other) and lengths.trusted(job(0.0))


def test_length_spread_varies_jobs_of_one_class_and_off_is_the_profile_length():
    specs = load_workload("workloads/workload-1", 10)
    base = [j.total_steps for j in jobs_from_specs(specs, SimConfig(num_nodes=2))[0]]
    prof = [load_profile(s.application).total_iterations(s.batch_size) for s in specs]
    assert base == prof
    spread = [j.total_steps for j in jobs_from_specs(specs, SimConfig(num_nodes=2, length_spread=0.5))[0]]
    again = [j.total_steps for j in jobs_from_specs(specs, SimConfig(num_nodes=2, length_spread=0.5))[0]]
    assert spread == again and all(a != b for a, b in zip(spread, base))
    assert 0.2 < np.std(np.log(np.array(spread) / base)) < 1.0
    with pytest.raises(ConfigError, match="length_spread"):
        validate(ClusterConfig(sim=SimConfig(length_spread=-1.0)))


class _Estimates(ResidualScheduler):
    """Records, every slot, each job's remaining-steps estimate against its true remaining steps."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.errors: list[float] = []

    def allocate(self, now, jobs, cluster):
        for j in jobs:
            if self.lengths.remaining(j) is not None:
                self.errors.append(abs(math.log(self.remaining_steps(j) / max(j.total_steps - j.progress, 1.0))))
        return super().allocate(now, jobs, cluster)


def test_class_lengths_read_recurring_jobs_where_the_step_decay_fit_is_wrong():
    """Under step-decay losses the fitted form is far off; once a job of the same application and batch size has
    finished, the learned scheduler reads the recurring job's remaining steps from it instead."""
    from omnijax.cluster.simulator import simulate
    specs = load_workload("workloads/workload-2", 24)
    cfg = SimConfig(num_nodes=2, slot_s=120.0, families=("stepdecay",))
    runs = {}
    for on in (False, True):
        sched = _Estimates(hidden=4, class_lengths=on)
        jobs, step_time = jobs_from_specs(specs, cfg)
        simulate(jobs, step_time, sched, cfg)
        runs[on] = np.asarray(sched.errors)
    assert min(runs[True].size, runs[False].size) > 20
    assert np.median(runs[True]) < 0.05 < np.median(runs[False])      # exact for recurring jobs, the fit is not


def test_training_keeps_the_trained_policy_else_the_warm_start_else_fitted(monkeypatch, tmp_path):
    """The acceptance test decides what `learned` is, on the same held-out workloads: of the ES-trained policy and
    its warm start (class lengths, drop anchor, step-time terms), the one that beats fitted; if both do, the
    trained policy only if it also beats the warm start; if neither, the fitted scheduler's decisions."""
    from omnijax.cluster.residual import training as residual
    from omnijax.cluster.config import ClusterConfig
    from tests.conftest import CLUSTER_FIXTURES
    cfg = ClusterConfig(sim=SimConfig(num_nodes=2, slot_s=300.0), learned=LearnedConfig(
        train_sets=[str(CLUSTER_FIXTURES / "pollux" / "workloads")], es_iterations=1, es_pairs=1, es_sigma=0.5,
        es_validation=2, hidden_es=4, anchor_workloads=0, window_s=3600.0, save=str(tmp_path / "p.npz")))
    calls = []

    def verdicts(*answers):
        calls.clear()
        monkeypatch.setattr(residual, "accept", lambda scores, z=2.0: answers[len(calls.append(1) or calls) - 1])

    verdicts(True, True, True)                                         # beats fitted and its warm start
    assert residual.train_residual(cfg).kept == "trained policy" and len(calls) == 3
    verdicts(True, True, False)                                        # beats fitted, not its warm start
    assert residual.train_residual(cfg).kept == "warm start"
    verdicts(True, False)                                              # beats fitted; the warm start does not
    assert residual.train_residual(cfg).kept == "trained policy" and len(calls) == 2
    verdicts(False, True)
    warm = residual.train_residual(cfg)
    assert warm.kept == "warm start" and warm.class_lengths and warm.aware and len(calls) == 2
    assert not np.array_equal(warm.theta, warm.trained_theta)           # the ES step moved it; the warm start is kept
    back = load_policy(str(tmp_path / "p.npz"))
    assert (back.kept, back.class_lengths, back.aware) == ("warm start", True, True)
    verdicts(False, False)
    fitted = residual.train_residual(cfg)
    assert fitted.kept == "fitted" and not fitted.class_lengths and not fitted.aware and fitted.anchor.size == 0
    assert not np.any(fitted.theta[fitted.mlp.head:])
