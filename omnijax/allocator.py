"""The memory allocator a run uses: tcmalloc where it is installed, glibc malloc otherwise.

XLA:CPU allocates and frees many large, short-lived buffers every step. Under glibc malloc a training step on
2-core machines ran 27-41% slower, and far noisier, than under tcmalloc, and the multi-device step lost its
lead over one device. An allocator can only be chosen before the process starts, so `python -m recipes`
re-executes itself once under tcmalloc (LD_PRELOAD) when the library is present. `OMNIJAX_ALLOCATOR` picks:
`auto` (the default: tcmalloc if installed), `tcmalloc` (an error when it is missing) or `system` (keep glibc);
`OMNIJAX_TCMALLOC=PATH` names a library outside the system's folders.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from typing import Mapping

from omnijax.errors import UserError

ENV = "OMNIJAX_ALLOCATOR"
PATH_ENV = "OMNIJAX_TCMALLOC"
_CHOICES = ("auto", "tcmalloc", "system")
_SONAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
         "/opt/homebrew/lib")
INSTALL_HINT = ("apt-get install libtcmalloc-minimal4 (Debian/Ubuntu), dnf install gperftools-libs (Fedora/RHEL) "
                "or conda install gperftools")
# tcmalloc reports every allocation over 1 GiB on stderr by default; a big model's buffers are not news
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def find_tcmalloc() -> str | None:
    """The path of an installed tcmalloc shared library (the minimal build first), or None."""
    named = os.environ.get(PATH_ENV, "")
    if named:
        if not os.path.isfile(named):
            raise UserError(f"{PATH_ENV}={named}: no such file")
        return named
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    for soname in _SONAMES:
        for line in listing.splitlines():
            name, _, path = line.strip().partition(" => ")
            if name.split(" ")[0] == soname and os.path.exists(path):
                return path
        prefixes = [os.environ.get("CONDA_PREFIX", ""), sys.prefix, sys.base_prefix]
        for folder in [os.path.join(p, "lib") for p in prefixes if p] + list(_DIRS):
            hits = sorted(glob.glob(os.path.join(folder, soname)))
            if hits:
                return hits[0]
    return None


def in_use(env: Mapping[str, str] | None = None) -> str:
    """Which allocator this process runs under, read from LD_PRELOAD (what every benchmark row reports)."""
    env = os.environ if env is None else env
    preload = env.get("LD_PRELOAD", "")
    named = env.get(PATH_ENV, "")
    return "tcmalloc" if "tcmalloc" in preload or (named and named in preload.split()) else "jemalloc" if "jemalloc" in preload else "glibc malloc"


def choice(env: Mapping[str, str] | None = None) -> str:
    value = (os.environ if env is None else env).get(ENV, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise UserError(f"{ENV}={value!r}: use one of {', '.join(_CHOICES)}")
    return value


def preloaded_env(env: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to re-execute under, or None when this process should carry on as it is.

    Pure (the library path is passed in) so the decision is testable without the library installed."""
    wanted = choice(env)
    if wanted == "system" or in_use(env) != "glibc malloc":
        return None
    if library is None:
        if wanted == "tcmalloc":
            raise UserError(f"{ENV}=tcmalloc but no tcmalloc library is installed: {INSTALL_HINT}")
        return None
    new = dict(env)
    new["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    for key, value in _QUIET.items():
        new.setdefault(key, value)
    return new


def reexec_under_tcmalloc() -> None:
    """Replace this process by the same command under tcmalloc when that is wanted and possible.

    Called first thing by `python -m recipes`, before jax is imported; the pid stays the same, so launchers
    (Slurm, torchrun-style supervisors, `recipes launch`) see one process."""
    env = preloaded_env(os.environ, find_tcmalloc() if choice() != "system" else None)
    if env is None:
        return
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def describe(env: Mapping[str, str] | None = None) -> str:
    """One line for the start of a run's log."""
    name = in_use(env)
    if name == "tcmalloc":
        return "allocator tcmalloc"
    if choice(env) == "system":
        return f"allocator {name} ({ENV}=system)"
    return f"allocator {name} (tcmalloc makes CPU steps faster and steadier: {INSTALL_HINT})"

