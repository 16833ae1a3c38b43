"""Settings that act before a recipe's config exists (devices, threads, jax's heartbeat, the run folder) take
effect when a YAML sets them, an included YAML too, exactly as on the command line."""
import os
import sys
import types

import pytest

import recipes.__main__ as cli
from recipes import common


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A recipe `probe` whose YAML includes another that sets every early setting; its main() records what
    it finds when it starts (where jax would start)."""
    (tmp_path / "inc.yaml").write_text("parallel:\n  cpu_devices: 3\n  cpu_threads: 5\n"
                                       "trainer:\n  peer_timeout_s: 7\n  run_name: from_yaml\n")
    (tmp_path / "probe.yaml").write_text("base: inc.yaml\ntrainer:\n  steps: 2\n")
    monkeypatch.setattr(common, "CONFIGS", tmp_path)
    for var in ("XLA_FLAGS", "NPROC", common.PEER_TIMEOUT_ENV):
        monkeypatch.setenv(var, "")  # monkeypatch restores the caller's environment afterwards
        monkeypatch.delenv(var)
    seen = {}

    def main(argv):
        from omnijax.train.distributed import _heartbeat_s

        seen.update(xla=os.environ.get("XLA_FLAGS", ""), nproc=os.environ.get("NPROC"), heartbeat=_heartbeat_s(),
                    run_name=common.load_config("probe", argv).trainer.run_name)
        return 0

    monkeypatch.setitem(sys.modules, "probe_recipe", types.SimpleNamespace(main=main))
    monkeypatch.setattr(cli, "recipe_names", lambda: {"probe": "probe_recipe", "launch": "recipes.launch"})
    return seen


def test_yaml_settings_take_effect_before_the_recipe_starts(probe):
    from omnijax.train.distributed import _BACKSTOP_S
    from recipes.launch import checkpoint_dir as _checkpoint_dir

    assert cli.main(["probe"]) == 0
    assert "--xla_force_host_platform_device_count=3" in probe["xla"] and probe["nproc"] == "5"
    assert probe["heartbeat"] == 7 + _BACKSTOP_S
    assert probe["run_name"] == "from_yaml"
    assert _checkpoint_dir("probe", []).parent.name == "from_yaml"  # where a supervisor finds the run's logs


def test_the_command_line_still_wins_over_the_yaml(probe):
    from omnijax.train.distributed import _BACKSTOP_S
    from recipes.launch import checkpoint_dir as _checkpoint_dir

    argv = ["parallel.cpu_devices=2", "parallel.cpu_threads=4", "trainer.peer_timeout_s=11", "trainer.run_name=cli"]
    assert cli.main(["probe", *argv]) == 0
    xla = probe["xla"].split()
    assert "--xla_force_host_platform_device_count=2" in xla and len([f for f in xla if "device_count" in f]) == 1
    assert probe["nproc"] == "4" and probe["heartbeat"] == 11 + _BACKSTOP_S and probe["run_name"] == "cli"
    assert _checkpoint_dir("probe", argv).parent.name == "cli"


def test_a_recipe_without_a_yaml_and_a_stale_parent_value(probe, monkeypatch):
    """No YAML: the command line alone; a peer timeout set nowhere is the default, not one a parent left in
    the environment; the recipe name is the run name when nothing sets it."""
    from omnijax.train.distributed import _BACKSTOP_S, DEFAULT_PEER_TIMEOUT_S

    monkeypatch.setenv(common.PEER_TIMEOUT_ENV, "3")
    assert common.early_settings("no_such_yaml", ["RUN_DIR", "--flag", "parallel.cpu_devices=6"]) == {
        "parallel.cpu_devices": 6}
    common.before_jax("no_such_yaml", [])
    from omnijax.train.distributed import _heartbeat_s

    assert _heartbeat_s() == int(DEFAULT_PEER_TIMEOUT_S) + _BACKSTOP_S
    (common.CONFIGS / "plain.yaml").write_text("trainer:\n  steps: 2\n")
    assert common.load_config("plain", []).trainer.run_name == "plain"
