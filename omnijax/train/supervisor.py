"""Watching a job's recipe processes from outside them: restart a local group, requeue a Slurm job, name a death.

Three supervisors, each a parent of `python -m recipes ...` processes (the CLI wiring is `recipes/launch.py`
and `recipes/__main__.py`):

- `run_group`: N processes on this machine (a free loopback port, a new one per attempt). When one exits
  non-zero or is killed, the others are killed (without a peer they can neither step nor save), the reason is
  printed, and the group starts again; the trainer resumes from its newest intact checkpoint, so the losses
  continue as if undisturbed. A group that hangs (exit 124) or is preempted (SIGTERM: it saved, exit 143) is
  restarted the same way. A user error (exit 2: bad config, missing data) or a diverged run (exit 65) is not: a
  rerun would fail the same way. Neither is an attempt that fails the same way (the same exit code) at the same
  step (the same last logged step) as the attempt before it: a deterministic crash.
- `run_slurm_task`: one Slurm task. The scheduler owns the processes; when the recipe fails in a way a restart
  can fix, every task that sees it asks Slurm to requeue the job (`scontrol requeue`, which needs
  `#SBATCH --requeue`; the first request wins), so the requeue does not depend on task 0 surviving.
- `supervise`: one process of several started by hand or by a cluster's launcher. A process that a signal ends
  runs no Python afterwards (gloo aborting it when a peer dies, the kernel's out-of-memory killer), so the line
  that names the cause and the way to resume comes from its parent (`describe_death`).

None of this imports jax: a supervisor holding jax would cost every process of a job its import time and memory.
See docs/reliability.md.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from omnijax.errors import UserError
from omnijax.train.distributed import (EXIT_DIVERGED, EXIT_PEER_LOST, EXIT_PREEMPTED, auto_detected, launch_flags,
                                       native_log)
from omnijax.train.watchdog import EXIT_HUNG
from omnijax.utils import runs_root

USER_ERROR = 2           # recipes' exit code for a UserError: not worth a restart
NOT_RESTARTED = {USER_ERROR: "a user error, see its line above",
                 EXIT_DIVERGED: "the run diverged; its line above names the checkpoint and the lower optimizer.lr"}
# what jax's coordination client logs (fatal) before it aborts a process whose job lost a task
COORDINATION_FATAL = "the JAX distributed service detected fatal errors"
SUPERVISED = "OMNIJAX_SUPERVISED"   # set for the recipe process a supervisor watches
_NOT_RUNS = {"list", "bench", "launch", "-h", "--help", "help"}  # `python -m recipes` commands that train nothing


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the coordinator's, for one attempt)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_dir(run_name: str) -> Path:
    """Where the trainer of run `run_name` saves (under $OMNIJAX_RUNS, else ./runs)."""
    return runs_root() / run_name / "checkpoints"


def last_logged_step(run_dir: Path) -> int:
    """The last step the run logged (metrics.jsonl, read by the resume rule; 0 before any, or when the file
    is damaged: the recipe process names that itself): where an attempt got to."""
    from omnijax.train.metrics import read_metrics  # (numpy, not jax; loaded only once an attempt failed)

    try:
        rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    except UserError:
        return 0
    return int(rows[-1]["step"]) if rows else 0


def last_checkpoint(folder: Path) -> str:
    """The newest step folder in `folder`, as the lines that say where a run resumes name it."""
    steps = sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.is_dir() else []
    return f"step {steps[-1]}" if steps else "step 0 (no checkpoint yet)"


def same_failure(before: tuple | None, now: tuple) -> bool:
    """Whether two consecutive attempts' (process, exit code, last logged step) say one deterministic
    failure: the same exit code at the same step. Which process is seen failing first is left out (a bug
    every process meets exits them all, in any order). A preemption is not one (the run saved and was asked
    to stop)."""
    return before is not None and before[1:] == now[1:] and now[1] != EXIT_PREEMPTED


def first_cause(exits: list[tuple[int, int]]) -> tuple[int, int]:
    """The failure to report among the processes that have exited non-zero, as (process, code), in process
    order: one that did not merely react to a lost peer. A survivor exits 75, or aborts (SIGABRT) when its
    collective breaks first; both follow the real cause (process 1 killed), which may sort after them."""
    if not exits:
        raise ValueError("first_cause needs at least one failed process")
    return next(((i, rc) for i, rc in exits if rc not in (EXIT_PEER_LOST, -signal.SIGABRT)), exits[0])


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def exit_reason(i: int, rc: int) -> str:
    """Process `i`'s exit code `rc` in words (a negative code: killed by that signal)."""
    if rc < 0:
        return f"process {i} was killed by {_signal_name(rc)}"
    if rc == EXIT_PEER_LOST:
        return f"process {i} stopped: a peer stopped answering (exit 75)"
    if rc == EXIT_PREEMPTED:
        return f"process {i} was preempted: it saved and stopped (exit {EXIT_PREEMPTED})"
    if rc == EXIT_DIVERGED:
        return f"process {i} stopped: the run diverged (exit {EXIT_DIVERGED})"
    if rc == EXIT_HUNG:
        return f"process {i} stopped: no training step finished for trainer.hang_timeout_s (exit 124, stacks in its log)"
    return f"process {i} exited with code {rc}"


def _kill_survivors(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the processes of a failed attempt that still run. A group short of a process can neither
    step nor save (a checkpoint needs every process), so a SIGTERM would only have them wait in a
    collective for a grace period (measured: 10 s of the restart) before the kill."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_group(command: Callable[[int, int], list[str]], processes: int, checkpoints: Path, max_restarts: int = 0,
              cpu_devices_per_process: int = 0) -> int:
    """Run `command(i, port)` for i < `processes` (their coordinator on loopback `port`), restarting the whole
    group as the module says, up to `max_restarts` times; the run's `checkpoints` folder (and its run folder
    above it) say where an attempt got to. Returns the exit code to end with."""
    env = dict(os.environ, **{SUPERVISED: "1"})  # the group is watched here
    if cpu_devices_per_process:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices_per_process}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    folder = Path(checkpoints)
    stopping = {"signal": None}

    def forward(signum, frame):  # the launcher's own preemption: pass it on, then stop
        stopping["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    attempt, previous = 0, None
    while True:
        port = free_port()
        procs = [subprocess.Popen(command(i, port), env=env) for i in range(processes)]
        while any(p.poll() is None for p in procs):
            if stopping["signal"] is not None:  # SIGTERM (idempotent: a Ctrl-C already reached them too)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                for p in procs:
                    p.wait()
                return max((p.returncode for p in procs), default=0) or 0
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        exits = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if not exits:
            return 0
        failed = first_cause(exits)
        _kill_survivors(procs)
        why = exit_reason(*failed)
        if failed[1] in NOT_RESTARTED:
            print(f"launch: {why} ({NOT_RESTARTED[failed[1]]}); not restarting", file=sys.stderr, flush=True)
            return failed[1]
        logged = last_logged_step(folder.parent)
        if same_failure(previous, (*failed, logged)):
            print(f"launch: {why}, again after step {logged} as in the attempt before: a failure a restart does "
                  f"not fix; not restarting (the last checkpoint is {last_checkpoint(folder)} in {folder}). See "
                  f"the processes' lines above", file=sys.stderr, flush=True)
            return failed[1] if failed[1] > 0 else 1
        previous = (*failed, logged)
        if attempt >= max_restarts:
            print(f"launch: {why}; no restarts left (--max-restarts={max_restarts}); the last checkpoint is "
                  f"{last_checkpoint(folder)} in {folder}: run the same command to resume", file=sys.stderr,
                  flush=True)
            return failed[1] if failed[1] > 0 else 1
        attempt += 1
        print(f"launch: restart {attempt} of {max_restarts}: {why}; restarting all {processes} processes "
              f"from {last_checkpoint(folder)} in {folder}", file=sys.stderr, flush=True)


def run_slurm_task(command: list[str], max_restarts: int) -> int:
    """One Slurm task: run `command`; on a restartable failure this task requeues the job, whichever task it
    is (task 0 may be the one that died), while SLURM_RESTART_COUNT < `max_restarts`."""
    rc = subprocess.call(command, env={**os.environ, SUPERVISED: "1"})
    if rc == 0 or rc in NOT_RESTARTED:
        return rc
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    job = os.environ["SLURM_JOB_ID"]
    if restarts >= max_restarts:
        print(f"launch: task {os.environ.get('SLURM_PROCID')} exited {rc}; Slurm restarted the job {restarts} times "
              f"(--max-restarts={max_restarts}): not requeueing", file=sys.stderr, flush=True)
        return rc
    print(f"launch: task {os.environ.get('SLURM_PROCID')} exited {rc}; requeueing Slurm job {job} (restart "
          f"{restarts + 1} of {max_restarts})", file=sys.stderr, flush=True)
    subprocess.call(["scontrol", "requeue", job], stderr=subprocess.DEVNULL)  # (a later task's finds it requeued)
    return rc


# ------------------------------------------------------------------ one process of several, started by hand
def wants_supervisor(argv: list[str], env: dict | os._Environ) -> bool:
    """A recipe run (`python -m recipes ARGV`) that is one process of several and has no supervisor of ours
    above it: started by hand (`--coordinator`) or by a cluster's own launcher (srun, mpirun, a Kubernetes Job)."""
    try:
        flags, rest = launch_flags(argv)
    except UserError:  # the recipe process itself says what is wrong with the flags
        return False
    if env.get(SUPERVISED) or not rest or rest[0] in _NOT_RUNS:
        return False
    return bool(flags.get("OMNIJAX_COORDINATOR") or env.get("OMNIJAX_COORDINATOR") or auto_detected(env))


def process_of(argv: list[str], env) -> tuple[str, str]:
    """(index, count) of this process in its job, as jax will number it: our flags, else the cluster's."""
    env = {**env, **launch_flags(argv)[0]}
    for index, count in (("OMNIJAX_PROCESS_ID", "OMNIJAX_NUM_PROCESSES"), ("SLURM_PROCID", "SLURM_NTASKS"),
                         ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("JOB_COMPLETION_INDEX", "")):
        if index in env:
            return env[index], env.get(count, "?")
    return "0", "?"


def describe_death(rc: int, process: str, log: Path, where: str) -> tuple[str, int]:
    """The line a supervisor prints for a recipe process killed by a signal, and the code to end with
    (a negative code: die of that signal too). Judged by the operation that failed, as its native log names
    it: jax's coordination client aborting the process (a task of the job was lost) or gloo aborting it (a
    collective broke) means a peer was lost: exit 75 like the peer watch, whose line it could not print."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    tail, recent = lines[-3:], lines[-80:]  # (the log is appended across attempts: this death's end only)
    resume = (f"Last checkpoint: {where}. To resume, run the same command on every host again "
              "(`python -m recipes launch` and Slurm requeue do it)")
    if rc == -signal.SIGABRT and any(COORDINATION_FATAL in line for line in recent):  # the failing operation: the coordination service
        return (f"\nerror: process {process} stopped: a peer process was lost (jax's coordination service reported "
                f"it and ended this process; see {log}). {resume}", EXIT_PEER_LOST)
    if rc == -signal.SIGABRT and any("gloo" in line for line in tail):
        what = next((line for line in tail if "what():" in line), tail[-1])
        what = re.sub(r"^\s*what\(\):\s*(\[[^\]]*\]\s*)?", "", what).split(" Is there a")[0].strip()[:300]
        return (f"\nerror: process {process} stopped: its collectives broke because a peer process was lost "
                f"(gloo aborted it: {what}; see {log}). {resume}", EXIT_PEER_LOST)
    oom = " (the kernel's out-of-memory killer sends it: see `dmesg`)" if rc == -signal.SIGKILL else ""
    native = f"; the end of its native log {log}: {tail[-1].strip()[:300]}" if tail else ""
    return f"\nerror: process {process} was killed by {_signal_name(rc)}{oom}{native}. {resume}", rc


def _pdeathsig_setter():
    """A function for the child to call between fork and exec (loaded before the fork: nothing to load
    after it) that has the kernel kill it when its supervisor dies (Linux; elsewhere None). Killing the
    process a user started then stops the whole run, as without a supervisor."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def supervise(argv: list[str], checkpoints: Callable[[], Path], command: list[str] | None = None) -> int:
    """Run `python -m recipes ARGV` (or `command`) as a child and report how it ended; a death by signal gets
    its line (`describe_death`, naming the last checkpoint in `checkpoints()`, asked only then) and is passed on."""
    child = subprocess.Popen(command or [sys.executable, "-m", "recipes", *argv],
                             env={**os.environ, SUPERVISED: "1"}, preexec_fn=_pdeathsig_setter())

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    signal.signal(signal.SIGTERM, forward)   # preemption: the child saves and stops
    signal.signal(signal.SIGUSR1, forward)   # the child's stacks
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child itself (same process group)
    try:
        rc = child.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if rc >= 0:
        return rc
    index, count = process_of(argv, os.environ)
    folder = checkpoints()
    line, code = describe_death(rc, f"{index} of {count}", native_log(folder.parent, index),
                                f"{last_checkpoint(folder)} in {folder}")
    print(line, file=sys.stderr, flush=True)
    if code < 0:  # end the same way, for whatever watches this process (a launcher, Slurm)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
