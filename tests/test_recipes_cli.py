"""The recipes command line: list, unknown names, user errors as one line."""
import os
import subprocess
import sys

import pytest

from recipes.__main__ import bench_names, recipe_names


def _run(*args):
    return subprocess.run([sys.executable, "-m", "recipes", *args], capture_output=True, text=True, timeout=300)


def test_list_prints_one_recipe_per_line():
    out = _run("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    names = set(recipe_names())
    assert "tiny_lm" in names and "llm_step" in bench_names()
    for line in lines:
        name = line.split("  ")[0].strip()
        assert name in names or name.startswith("bench "), line
        assert "failed to import" not in line, line


def test_unknown_recipe_suggests_close_match():
    out = _run("tiny_lmm")
    assert out.returncode == 2
    assert "unknown recipe 'tiny_lmm'" in out.stderr and "tiny_lm" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_override_is_one_clear_line():
    out = _run("tiny_lm", "trainer.stepz=3")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: unknown config key 'trainer.stepz'; did you mean 'trainer.steps'?"


def test_cpu_threads_sizes_xla_cpu_intra_op_pool_in_a_fresh_process(monkeypatch):
    """`parallel.cpu_threads=T` reaches XLA (it reads NPROC when it makes the CPU client): the process has T
    intra-op threads (as `xla_cpu_threads`, which benchmark rows report, counts them), one CPU device unchanged;
    a malformed value is left to the config's one-line error (setup_devices runs before the config exists)."""
    code = ("import sys; from recipes.common import setup_devices; setup_devices(sys.argv[1:]);"
            "import jax, jax.numpy as jnp; (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready();"
            "from omnijax.train.metrics import xla_cpu_threads; print(jax.device_count(), xla_cpu_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    more = len(os.sched_getaffinity(0)) + 3   # more than XLA's default (the cores) on any machine
    out = subprocess.run([sys.executable, "-c", code, "parallel.cpu_devices=1", f"parallel.cpu_threads={more}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert tuple(int(x) for x in out.stdout.split()) == (1, more)
    from recipes.common import setup_devices

    monkeypatch.setenv("NPROC", "unset")   # monkeypatch now restores the caller's environment afterwards
    monkeypatch.delenv("NPROC")
    for bad in ("-2", "abc", "0", ""):
        setup_devices([f"parallel.cpu_threads={bad}"])
        assert "NPROC" not in os.environ, bad
    setup_devices(["parallel.cpu_threads=6"])
    assert os.environ["NPROC"] == "6"
    from omnijax.config import Config, validate
    from omnijax.errors import ConfigError

    cfg = Config()
    cfg.parallel.cpu_threads = -2
    with pytest.raises(ConfigError, match="parallel.cpu_threads=-2: must be >= 0"):
        validate(cfg)
