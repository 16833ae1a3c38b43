"""The recipes command line: list, unknown names, user errors as one line."""
import subprocess
import sys

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
