"""Configs: YAML + overrides, typed; bad keys/values fail with the field named."""
import pytest

from omnijax import config as C
from omnijax.errors import ConfigError


def test_yaml_then_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  steps: 7\nmodel:\n  embed_dim: 32\n")
    (tmp_path / "r.yaml").write_text("base: base.yaml\ntrainer:\n  steps: 9\n")
    cfg = C.build(C.Config, tmp_path / "r.yaml", ["optimizer.lr=1e-3", "model.rope.scaling=llama3"])
    assert cfg.trainer.steps == 9 and cfg.model.embed_dim == 32
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.rope.scaling == "llama3"


@pytest.mark.parametrize("override, message", [
    ("trainer.stepz=5", "unknown config key 'trainer.stepz'; did you mean 'trainer.steps'"),
    ("trainer.steps=abc", "trainer.steps='abc': must be int"),
    ("trainer.steps=1.5", "trainer.steps=1.5: must be int"),
    ("trainer.steps=0", "trainer.steps=0: must be > 0"),
    ("model.num_heads=3", "model.num_heads=3 must be a multiple of model.num_kv_heads=2"),
    ("model.rope.scaling=foo", "must be one of 'none', 'linear', 'llama3', 'yarn'"),
    ("optimizer.lr=-1", "optimizer.lr=-1.0: must be in (0, 10)"),
    ("trainer.steps", "expected key=value"),
    ("trainer=3", "trainer: expected a mapping of fields, got 3"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        C.build(C.Config, None, [override])
    assert message in str(err.value)


def test_missing_yaml_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        C.build(C.Config, tmp_path / "nope.yaml", [])
