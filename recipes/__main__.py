"""Command line: `python -m recipes list | NAME [overrides] | bench NAME [overrides]`."""
from __future__ import annotations

import difflib
import importlib
import json
import os
import pkgutil
import sys
from pathlib import Path

from omnijax.errors import UserError

_HERE = Path(__file__).parent
_NOT_RECIPES = {"__main__", "common"}


def _modules(package: str, folder: Path) -> dict[str, str]:
    names = {m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_")}
    return {n: f"{package}.{n}" for n in sorted(names - _NOT_RECIPES)}


def recipe_names() -> dict[str, str]:
    return {n: m for n, m in _modules("recipes", _HERE).items() if n != "bench"}


def bench_names() -> dict[str, str]:
    return _modules("recipes.bench", _HERE / "bench")


def _unknown(kind: str, name: str, known: list[str]) -> int:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    print(f"error: unknown {kind} '{name}'.{hint} `python -m recipes list` shows them all.", file=sys.stderr)
    return 2


def _description(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "DESCRIPTION", "").strip().splitlines()[0]
    except Exception as exc:  # a broken recipe must not hide the others
        return f"(failed to import: {exc.__class__.__name__}: {exc})"


def cmd_list() -> int:
    recipes, benches = recipe_names(), bench_names()
    width = max([len(n) for n in [*recipes, *(f"bench {b}" for b in benches)]] or [0]) + 2
    for name, module in recipes.items():
        print(f"{name:<{width}}{_description(module)}")
    for name, module in benches.items():
        print(f"{'bench ' + name:<{width}}{_description(module)}")
    return 0


def cmd_bench(name: str, overrides: list[str]) -> int:
    benches = bench_names()
    if name not in benches:
        return _unknown("benchmark", name, list(benches))
    module = importlib.import_module(benches[name])
    out_dir = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{name}.jsonl", "w") as f:
        for row in module.run(overrides):
            line = json.dumps(row, sort_keys=False)
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(__doc__)
        return 0 if argv else 2
    try:
        from omnijax.train.distributed import cpu_platform_without_accelerator, pop_launch_flags

        argv = pop_launch_flags(argv)
        cpu_platform_without_accelerator()  # before jax starts: no CUDA-plugin traceback on a CPU-only machine
        name, rest = argv[0], argv[1:]
        if name == "list":
            return cmd_list()
        if name == "bench":
            if not rest:
                print("error: `python -m recipes bench NAME`; benchmarks: " + ", ".join(bench_names()), file=sys.stderr)
                return 2
            return cmd_bench(rest[0], rest[1:])
        recipes = recipe_names()
        if name not in recipes:
            return _unknown("recipe", name, list(recipes))
        if name != "launch":  # (launch hands the arguments to the processes it starts, which read them so)
            from recipes.common import before_jax

            before_jax(name, rest)  # devices, threads, heartbeat: from the recipe's YAML too, before jax starts
        return int(importlib.import_module(recipes[name]).main(rest) or 0)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)  # 2, or a distinct code the error declares (a diverged run: 65)


if __name__ == "__main__":
    import faulthandler
    import signal

    from omnijax.train.supervisor import wants_supervisor
    from recipes.launch import supervise

    if wants_supervisor(sys.argv[1:], os.environ):  # one process of several: report a death by signal too
        sys.exit(supervise(sys.argv[1:]))

    # `kill -USR1 PID` prints every thread's Python stack (to the run's native_stderr log in a multi-process
    # run): what a hung process is waiting on, without stopping it
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if sys.argv[1:2] != ["list"]:  # before jax starts: an allocator is chosen at process start or never. Only
        from omnijax.allocator import reexec_under_tcmalloc  # here: main() called in-process (tests, notebooks)
        reexec_under_tcmalloc()                              # must never replace its caller's process
    try:
        code = main(sys.argv[1:])
    except Exception:  # noqa: BLE001 - printed as Python would, then the exit below
        import traceback

        traceback.print_exc()
        code = 1
    from omnijax.train.distributed import exit_process

    exit_process(code)
