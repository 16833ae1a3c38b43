"""Cluster performance models and trace loading: fitting recovers known coefficients; bad input errors."""
from pathlib import Path

import numpy as np
import pytest

from omnijax.cluster.perf_model import LossCoeffs, LossModel, SpeedModel, fit_loss_curve, speed_features
from omnijax.cluster.traces import load_profile, load_workload, shared_data_root
from omnijax.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures" / "cluster"


pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")  # no shared data needed


@pytest.mark.parametrize("true", [LossCoeffs(2e-3, 0.5, 0.3), LossCoeffs(1e-4, 1.0, 1.2), LossCoeffs(5e-2, 2.0, 0.0)])
def test_loss_fit_recovers_coefficients_from_noisy_points(true):
    rng = np.random.default_rng(0)
    k = np.linspace(0, 3 * true.b / true.a, 60)
    loss = true(k) * (1 + 0.01 * rng.standard_normal(k.size))
    fit = fit_loss_curve(k, loss)
    assert fit.a == pytest.approx(true.a, rel=0.15)
    assert fit.b == pytest.approx(true.b, rel=0.1)
    assert fit.c == pytest.approx(true.c, abs=0.05 * (1 / true.b + true.c))
    assert min(fit.a, fit.b, fit.c) >= 0


def test_loss_model_reports_prediction_error_and_predicts_length():
    true = LossCoeffs(a=19.0 / 1000, b=1.0, c=0.5)       # converges (eps=0.05) at k = 1000
    model = LossModel(eps=0.05)
    rng = np.random.default_rng(1)
    for k in range(0, 600, 20):
        model.observe(k, float(true(k)) * (1 + 0.005 * rng.standard_normal()))
    assert model.total_steps() == pytest.approx(1000, rel=0.15)
    assert len(model.errors) == len(model.steps) - model.min_points and max(model.errors[-5:]) < 0.05
    model.observe(700, float("nan"))   # a bad point is ignored, not fitted
    assert len(model.steps) == 30


def test_loss_fit_rejects_too_few_points():
    with pytest.raises(ValueError):
        fit_loss_curve(np.array([1.0, 2.0]), np.array([1.0, 0.9]))


def _speed_points(form, theta, noise, seed=2):
    rng = np.random.default_rng(seed)
    model = SpeedModel(form, batch_size=32)
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 32):
        for m in (1, 2, 4, 8):
            model.observe(n, m, float(speed_features(form, 32, n, m) @ theta) * (1 + noise * rng.standard_normal()))
    return model


@pytest.mark.parametrize("form", ["allreduce", "ps"])
def test_speed_nnls_recovers_coefficients(form):
    theta = np.array([0.01, 0.05, 0.2, 0.003, 0.1])
    # coefficients: identifiable at small noise (the features are close to collinear at 1% noise)
    np.testing.assert_allclose(_speed_points(form, theta, 0.002).theta, theta, rtol=0.2, atol=2e-3)
    # predictions: accurate at realistic noise, and the reported running error reflects the noise
    model = _speed_points(form, theta, 0.02)
    assert 0.005 < model.mean_error < 0.05
    for n, m in [(5, 2), (24, 6), (1, 1)]:
        assert model.predict(n, m) == pytest.approx(float(speed_features(form, 32, n, m) @ theta), rel=0.04)
    with pytest.raises(ValueError):
        speed_features(form, 32, 0, 1)


def test_shared_data_missing_is_a_clear_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIJAX_SHARED_DATA", str(tmp_path))
    with pytest.raises(UserError, match="OMNIJAX_SHARED_DATA"):
        shared_data_root()


def test_workload_and_profile_loading(tmp_path, monkeypatch):
    """On the synthetic fixtures (make_synthetic.py): cifar10 computes 0.01 + 1e-4·b s per step at local
    batch b (gradient accumulation above b = 512), syncs 0.004·(1 + log2 r / 4) s on one node plus
    0.03·(1 + log2 nodes / 2) s across nodes, and needs 12000·(128/B)^0.6 iterations at batch B."""
    jobs = load_workload("workloads/workload-1")
    assert len(jobs) == 40 and jobs == sorted(jobs, key=lambda j: (j.time, j.name))
    assert len(load_workload("workload-1", limit=5)) == 5
    prof = load_profile("cifar10")
    assert prof.total_iterations(128) == 12000
    assert prof.total_iterations(384) == pytest.approx(12000 * (128 / 384) ** 0.6, rel=2e-3)   # log-log interpolation
    assert prof.step_time(1, 1, 256) == pytest.approx(0.01 + 1e-4 * 256)
    assert prof.step_time(1, 1, 2048) == pytest.approx(4 * (0.01 + 1e-4 * 512))       # 4 accumulation steps
    assert prof.step_time(4, 1, 2048) == pytest.approx(0.01 + 1e-4 * 512 + 0.004 * 1.5)
    assert prof.step_time(4, 4, 2048) == pytest.approx(0.01 + 1e-4 * 512 + 0.004 * 1.5 + 0.03 * 2)
    # more replicas on one node: faster; the same replicas spread over nodes: slower
    assert prof.step_time(4, 1, 2048) < prof.step_time(2, 1, 2048) < prof.step_time(1, 1, 2048)
    with pytest.raises(UserError, match="unknown workload"):
        load_workload("workloads/workload-99")
    bad = tmp_path / "pollux" / "workloads"
    bad.mkdir(parents=True)
    (bad / "workload-1.csv").write_text("name,time,application,num_replicas,batch_size\nx,1,gpt9,1,8\n")
    monkeypatch.setenv("OMNIJAX_SHARED_DATA", str(tmp_path))
    with pytest.raises(UserError, match="row 2"):
        load_workload("workload-1")


def test_profiles_follow_the_data_root(tmp_path, monkeypatch):
    """Profiles are cached per data root: pointing OMNIJAX_SHARED_DATA at other files takes effect."""
    import shutil
    before = load_profile("ncf").total_iterations(256)
    shutil.copytree(FIXTURES / "pollux", tmp_path / "pollux")
    (tmp_path / "pollux" / "traces" / "ncf" / "validation-256.csv").write_text(
        "progress,iteration,metric,grad_sqr,grad_var\n10,10,0.5,1,1\n77,77,0.6,1,1\n")
    monkeypatch.setenv("OMNIJAX_SHARED_DATA", str(tmp_path))
    assert before == 6000 and load_profile("ncf").total_iterations(256) == 77


def test_cluster_recipes_reject_bad_config():
    from omnijax.errors import ConfigError
    from recipes import cluster_exec, cluster_sim
    from recipes.bench import cluster as bench_cluster
    with pytest.raises(ConfigError, match="scheduler"):
        cluster_sim.main(["scheduler=lottery"])
    with pytest.raises(ConfigError, match="unknown config key"):
        cluster_sim.main(["sim.gpus=8"])
    with pytest.raises(ConfigError, match="schedulers"):
        next(bench_cluster.run(["schedulers=[fifo,lottery]"]))
    with pytest.raises(ConfigError, match="applications"):
        next(bench_cluster.run(["schedulers=[fifo]", "applications=[gpt9]"]))
    with pytest.raises(ConfigError, match="lp_interval_s"):
        next(bench_cluster.run(["schedulers=[fifo]", "lp_interval_s=-60"]))
    with pytest.raises(ConfigError, match="lagrange_interval_s"):
        next(bench_cluster.run(["schedulers=[fifo]", "lagrange_interval_s=-60"]))
    with pytest.raises(ConfigError, match="milp_time_s"):
        next(bench_cluster.run(["schedulers=[fifo]", "milp_time_s=-1"]))
    with pytest.raises(ConfigError, match="runner"):
        cluster_exec.main(["runner=slurm"])
