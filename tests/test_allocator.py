"""The allocator choice: `python -m recipes` re-executes itself under tcmalloc where it is installed."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omnijax import allocator
from omnijax.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_the_decision_follows_the_choice_and_what_is_installed():
    lib = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    env = allocator.preloaded_env({"PATH": "/bin"}, lib)
    assert env["LD_PRELOAD"] == lib and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    # a user's own preload is kept, after the allocator
    assert allocator.preloaded_env({"LD_PRELOAD": "/x/libfoo.so"}, lib)["LD_PRELOAD"] == f"{lib} /x/libfoo.so"
    # already under tcmalloc (the re-executed process): carry on, no loop
    assert allocator.preloaded_env({"LD_PRELOAD": lib}, lib) is None
    assert allocator.preloaded_env({allocator.ENV: "system"}, lib) is None
    assert allocator.preloaded_env({}, None) is None  # not installed: glibc, no error
    with pytest.raises(UserError, match="apt-get install libtcmalloc-minimal4"):
        allocator.preloaded_env({allocator.ENV: "tcmalloc"}, None)
    with pytest.raises(UserError, match="OMNIJAX_ALLOCATOR='jemalloc': use one of auto, tcmalloc, system"):
        allocator.preloaded_env({allocator.ENV: "jemalloc"}, lib)


def test_the_log_line_names_the_allocator():
    assert allocator.describe({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}) == "allocator tcmalloc"
    assert allocator.describe({}).startswith("allocator glibc malloc (tcmalloc makes")
    assert allocator.describe({allocator.ENV: "system"}) == "allocator glibc malloc (OMNIJAX_ALLOCATOR=system)"
    assert allocator.in_use({"LD_PRELOAD": "/opt/libjemalloc.so.2"}) == "jemalloc"


def test_a_process_re_executes_itself_once_under_the_library(tmp_path):
    # a stand-in library that is safe to preload: a copy of libm under tcmalloc's name (what is checked is the
    # mechanism: same pid, same command, LD_PRELOAD set once)
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6",
                            "/usr/lib64/libm.so.6", "/lib64/libm.so.6") if os.path.exists(p))
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    shutil.copy(libm, fake)
    code = ("import os; print('start', os.getpid(), flush=True); from omnijax.allocator import reexec_under_tcmalloc; "
            "reexec_under_tcmalloc(); print('running', os.getpid(), os.environ.get('LD_PRELOAD'), "
            f"{str(fake)!r} in open('/proc/self/maps').read())")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    env.update({allocator.PATH_ENV: str(fake), "PYTHONPATH": str(ROOT)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    starts = [line for line in lines if line.startswith("start")]
    running = [line.split() for line in lines if line.startswith("running")]
    assert len(starts) == 2 and len(running) == 1, out.stdout  # ran again once, then carried on
    assert starts[0].split()[1] == starts[1].split()[1] == running[0][1]  # the same process
    assert running[0][2] == str(fake) and running[0][3] == "True"  # the library is loaded, not only named
    # OMNIJAX_ALLOCATOR=system keeps the process as it is
    out = subprocess.run([sys.executable, "-c", code], env={**env, allocator.ENV: "system"}, capture_output=True,
                         text=True, timeout=600)
    assert out.stdout.count("start") == 1 and out.stdout.split("\n")[1].split()[2:] == ["None", "False"], out.stdout


# run first in every process of the child interpreters below (before and after an exec): its pid, and at exit
# whether the stand-in library is mapped into the process and named in LD_PRELOAD
_PROBE = """import atexit, os, sys
print('start', os.getpid(), flush=True)
atexit.register(lambda: print('exit', os.getpid(), os.environ['PROBE_LIB'] in open('/proc/self/maps').read(),
                              os.environ.get('LD_PRELOAD') == os.environ['PROBE_LIB'], flush=True))
"""


def test_a_named_library_that_is_missing_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(allocator.PATH_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(UserError, match="OMNIJAX_TCMALLOC=.*nope.so: no such file"):
        allocator.find_tcmalloc()


def test_main_called_in_process_never_replaces_its_caller(tmp_path):
    """Only `python -m recipes` re-executes: `recipes.__main__.main` called from a test or a notebook keeps the
    caller's process (an exec there replaced pytest workers mid-suite)."""
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6",
                            "/usr/lib64/libm.so.6", "/lib64/libm.so.6") if os.path.exists(p))
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    shutil.copy(libm, fake)
    code = ("import os; print('start', flush=True); from recipes.__main__ import main; "
            "rc = main(['no_such_recipe']); print('back', rc, os.environ.get('LD_PRELOAD'))")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    env.update({allocator.PATH_ENV: str(fake), "PYTHONPATH": str(ROOT)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.count("start") == 1 and "back 2 None" in out.stdout, (out.stdout, out.stderr[-2000:])
    # the module run as a program does re-execute: the same process (pid) starts twice, and the one that runs
    # the command has the library loaded (a sitecustomize probe reports from inside it)
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE)
    env.update(PYTHONPATH=f"{probe}{os.pathsep}{ROOT}", PROBE_LIB=str(fake))
    out = subprocess.run([sys.executable, "-m", "recipes", "no_such_recipe"], env=env, capture_output=True,
                         text=True, timeout=600, cwd=str(ROOT))
    assert out.returncode == 2 and "no_such_recipe" in out.stderr, out.stderr[-2000:]
    starts = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("start")]
    exits = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("exit")]
    assert len(starts) == 2 and len(set(starts)) == 1 and exits == [[starts[0], "True", "True"]], out.stdout
    # OMNIJAX_ALLOCATOR=system: one start, nothing loaded
    out = subprocess.run([sys.executable, "-m", "recipes", "no_such_recipe"], env={**env, allocator.ENV: "system"},
                         capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert out.stdout.count("start") == 1 and "False False" in out.stdout, out.stdout
