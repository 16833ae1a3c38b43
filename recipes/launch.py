"""Start a job's processes and restart the whole group from the last checkpoint when one dies.

`python -m recipes launch --processes N [--cpu-devices-per-process K] [--max-restarts R] RECIPE KEY=VALUE...`

Locally, each process runs as `python -m recipes RECIPE KEY=VALUE... --coordinator 127.0.0.1:PORT
--num-processes N --process-id I` (the flags a user would type) under `omnijax.train.supervisor.run_group`,
which restarts the group as its docstring says; under Slurm (SLURM_JOB_ID and SLURM_PROCID set: this task
was started by `srun`) the recipe runs in this task and a restartable failure requeues the job
(`supervisor.run_slurm_task`) while SLURM_RESTART_COUNT < --max-restarts. See docs/reliability.md.

This module is the command line's wiring: its arguments, and where the recipe's run keeps its checkpoints
(`trainer.run_name` from the recipe's YAML or the command line).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omnijax.errors import UserError  # (none of these imports jax: the launcher and supervisor start without it)
from omnijax.train import supervisor
from omnijax.train.distributed import launch_flags

DESCRIPTION = "start N processes of a recipe; restart the group from the last checkpoint when one dies"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes launch", add_help=False)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--cpu-devices-per-process", type=int, default=0)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("recipe", nargs="?")
    p.add_argument("overrides", nargs=argparse.REMAINDER)
    try:
        args = p.parse_args(argv)
    except SystemExit:
        raise UserError("usage: python -m recipes launch --processes N [--cpu-devices-per-process K] "
                        "[--max-restarts R] RECIPE KEY=VALUE...") from None
    if not args.recipe:
        raise UserError("launch needs a recipe: python -m recipes launch --processes 2 tiny_lm trainer.steps=100")
    if args.processes < 1 or args.max_restarts < 0 or args.cpu_devices_per_process < 0:
        raise UserError(f"--processes={args.processes} must be >= 1, --max-restarts={args.max_restarts} and "
                        f"--cpu-devices-per-process={args.cpu_devices_per_process} >= 0")
    return args


def checkpoint_dir(recipe: str, overrides: list[str]) -> Path:
    """The checkpoint folder of `python -m recipes RECIPE OVERRIDES...`'s run."""
    from recipes.common import early_settings  # trainer.run_name from the recipe's YAML or the command line

    try:
        name = str(early_settings(recipe, overrides).get("trainer.run_name") or recipe)
    except UserError:  # a malformed override: the recipe itself names it
        name = recipe
    return supervisor.checkpoint_dir(name)


def run_local(args: argparse.Namespace, command=None) -> int:
    """The group on this machine; `command(i, port)` replaces the recipe process's command line (tests)."""
    def recipe_process(i: int, port: int) -> list[str]:
        return [sys.executable, "-m", "recipes", args.recipe, *args.overrides, "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", str(args.processes), "--process-id", str(i)]

    return supervisor.run_group(command or recipe_process, args.processes, checkpoint_dir(args.recipe, args.overrides),
                                args.max_restarts, args.cpu_devices_per_process)


def run_slurm(args: argparse.Namespace, command: list[str] | None = None) -> int:
    """This Slurm task's recipe process (or `command`), requeueing the job on a restartable failure."""
    return supervisor.run_slurm_task(command or [sys.executable, "-m", "recipes", args.recipe, *args.overrides],
                                     args.max_restarts)


def supervise(argv: list[str], command: list[str] | None = None) -> int:
    """`python -m recipes ARGV` (one process of several) as a supervised child: a death by signal is named."""
    recipe, *overrides = launch_flags(argv)[1]
    return supervisor.supervise(argv, lambda: checkpoint_dir(recipe, overrides), command)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ:
        return run_slurm(args)
    return run_local(args)
