"""Cost model: FLOP defaults, per-span costs from metadata, and the calibration fit."""
import numpy as np
import pytest

from omnijax.data.cost import Coeffs, CostModel, fit_coeffs, sample_cost
from omnijax.data.sample import SampleMeta, SegmentMeta
from omnijax.data.tokens import default_mm_config, sample_tokens
from omnijax.errors import UserError


def test_costs_are_per_span_and_quadratic():
    mm = default_mm_config()
    model = CostModel(Coeffs(1.0, 0.01), {"vision": Coeffs(2.0, 0.1), "audio": Coeffs(3.0, 0.0)})
    img = SegmentMeta("image", (32, 32, 3))
    one = SampleMeta((SegmentMeta("text", (10,)), img))
    two = SampleMeta((SegmentMeta("text", (10,)), img, img))
    enc_rows, llm = sample_tokens(one, mm)
    c1, c2 = sample_cost(one, model, mm), sample_cost(two, model, mm)
    n = enc_rows["vision"]
    assert c1.encoder == pytest.approx(2.0 * n + 0.1 * n * n)
    assert c2.encoder == pytest.approx(2 * c1.encoder)        # two images = two spans, not one of 2n
    assert c1.llm == pytest.approx(llm + 0.01 * llm * llm)      # the sample is one LLM span
    assert c2.llm_tokens == llm + (llm - 10)
    with pytest.raises(UserError, match="no coefficients"):
        sample_cost(one, CostModel(Coeffs(), {}), mm)


def test_flop_defaults_and_save_load(tmp_path):
    m = CostModel.from_flops()
    assert m.llm.a > 0 and m.llm.b > 0 and set(m.encoders) == {"vision", "audio"}
    m.save(tmp_path / "c.json")
    again = CostModel.load(tmp_path / "c.json")
    assert again.llm == m.llm and again.encoders == m.encoders
    with pytest.raises(UserError, match="calibrate_cost"):
        CostModel.load(tmp_path / "missing.json")


def test_fit_recovers_coefficients_from_timings():
    a, b, c = 2e-6, 1e-8, 5e-4
    noise = np.random.default_rng(0)

    def time_fn(n):  # a known law with 5% timing noise (a real clock is too noisy on a shared CPU)
        return (c + a * n + b * n * n) * (1 + 0.05 * noise.standard_normal())

    coeffs, info = fit_coeffs(time_fn, [64, 256, 512, 768, 1024, 2048], repeats=5)
    assert info["r2"] > 0.98
    assert coeffs.b == pytest.approx(b, rel=0.2) and coeffs.a == pytest.approx(a, abs=2e-6)
    with pytest.raises(UserError, match="at least 3"):
        fit_coeffs(time_fn, [1, 2])


def test_calibrate_recipe_with_injected_steps():
    from recipes.calibrate_cost import CalibrateConfig, calibrate
    import jax.numpy as jnp

    def step(n):
        x = jnp.ones((n, n), jnp.float32)
        return lambda: x @ x

    def broken(n):
        raise RuntimeError("module not written yet")

    model, report = calibrate(CalibrateConfig(sizes=[32, 64, 128], repeats=2, components=["llm", "vision"]),
                              steps={"llm": step, "vision": broken})
    assert len(report["llm"]["times_s"]) == 3 and "r2" in report["llm"] and model.unit == "s"
    assert "FLOP default kept" in report["vision"]["status"]
