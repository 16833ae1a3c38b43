"""Multi-host start-up: `jax.distributed.initialize` from flags/env, or auto-detected.

Explicit: `python -m recipes NAME --coordinator=HOST:PORT --num-processes=N --process-id=I ...`
(or the env vars OMNIJAX_COORDINATOR / OMNIJAX_NUM_PROCESSES / OMNIJAX_PROCESS_ID).
Auto: Slurm (srun), Open MPI (mpirun) and Kubernetes indexed Jobs are detected by jax itself.

Losing a process: `PeerWatch` (started by the trainer) has every process bump a counter in the
coordination service's key-value store about once a second and watch the others'. A process whose
counter has not moved for `trainer.peer_timeout_s` (or a coordinator that stops answering for as
long) makes every survivor print one line (which process, the last checkpoint, how to resume) and
exit with EXIT_PEER_LOST. jax's own heartbeat is set `_BACKSTOP_S` later, as a backstop; whatever
native code prints when it fires goes to the run folder's `native_stderr.p<I>.log`, not the terminal.

Finishing: after the last step one process may work on alone (process 0's held-out evaluation, an export, a
final save) while the others are done. A process that simply exits enters jax's shutdown barrier, which fails
(SIGABRT in every process, coordination service "Shutdown barrier has failed") when a peer arrives more than
`shutdown_timeout_seconds` later, or when a peer that failed in its lone work never arrives. So every process
of a run that ended well waits at one agreed point first (`exit_process` -> `finish_together`), with its
PeerWatch judging the others meanwhile: the processes reach jax's shutdown together and exit 0, and a peer lost
while the others wait makes them stop with the peer-lost line instead of an abort.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from omnijax.errors import UserError

_FLAGS = {"--coordinator": "OMNIJAX_COORDINATOR", "--num-processes": "OMNIJAX_NUM_PROCESSES",
          "--process-id": "OMNIJAX_PROCESS_ID"}
_initialized = False
_watch: "PeerWatch | None" = None
EXIT_PEER_LOST = 75      # EX_TEMPFAIL: a peer process was lost; rerunning the same command resumes
EXIT_PREEMPTED = 143     # 128 + SIGTERM: stopped by SIGTERM/SIGINT after saving; rerunning the same command resumes
EXIT_DIVERGED = 65       # EX_DATAERR: trainer.max_nonfinite_in_row non-finite steps; a rerun would diverge again
DEFAULT_PEER_TIMEOUT_S = 60.0
_BACKSTOP_S = 30         # jax's heartbeat timeout = peer timeout + this (ours speaks first)
SHUTDOWN_TIMEOUT_S = 300  # jax's shutdown barrier: processes arrive together after finish_together
FINISH_WAIT_S = 7 * 24 * 3600  # finish_together's own limit: a backstop, the PeerWatch judges the peers


def launch_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The `--coordinator=...`-style flags (keyed by their environment variables) and the other arguments."""
    flags, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a value, e.g. {name}=...")
                value, i = argv[i + 1], i + 1
            flags[_FLAGS[name]] = value
        else:
            rest.append(arg)
        i += 1
    return flags, rest


def pop_launch_flags(argv: list[str]) -> list[str]:
    """Move `--coordinator=...`-style flags into the environment; return the other arguments."""
    flags, rest = launch_flags(argv)
    os.environ.update(flags)
    return rest


def auto_detected(env=None) -> str | None:
    """The cluster launcher that started this process as one of several (jax finds the others), if any."""
    env = os.environ if env is None else env
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "kubernetes"
    return None


def maybe_initialize_distributed() -> int:
    """Initialise jax.distributed when this is one process of many; returns the process count."""
    global _initialized, _watch
    import jax

    if _initialized:
        return jax.process_count()
    coordinator = os.environ.get("OMNIJAX_COORDINATOR")
    if coordinator:
        try:
            num = int(os.environ["OMNIJAX_NUM_PROCESSES"])
            pid = int(os.environ["OMNIJAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise UserError("--coordinator also needs --num-processes=N and --process-id=I (integers)") from None
        if not 0 <= pid < num:
            raise UserError(f"--process-id={pid} must be in [0, {num})")
        _cpu_collectives()
        jax.distributed.initialize(coordinator, num_processes=num, process_id=pid,
                                   heartbeat_timeout_seconds=_heartbeat_s(),
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    elif auto_detected():
        _cpu_collectives()
        jax.distributed.initialize(heartbeat_timeout_seconds=_heartbeat_s(),
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    _initialized = True
    if jax.process_count() > 1:
        _avoid_cache_hang()
        _watch = PeerWatch().start()  # beats from now on; the trainer arms it with trainer.peer_timeout_s
        # one line per host: shows the job really formed (not N independent runs)
        print(f"omnijax: process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} of "
              f"{jax.device_count()} devices", file=sys.stderr, flush=True)
    return jax.process_count()


def _cpu_collectives() -> None:
    """Cross-process collectives on CPU need gloo (GPU and TPU have their own)."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


# jaxlib releases on which a multi-process CPU run hangs in its first gloo collective when process 0 loads
# a program from the persistent compilation cache (the other processes never hit it: their cache keys
# differ, so they compile theirs). Measured here with a 2-process tiny_lm pair run twice on one cache:
# 0.12.1 hangs in step 1 every time, 0.12.0.1 finishes; with no cache both finish.
CACHE_HANGS_GLOO = frozenset({"0.12.1"})


def cache_hangs(jaxlib_version: str, platform: str, cpu_collectives: str | None, processes: int,
                cache_dir: str | None) -> bool:
    """Whether this run would load cached programs that hang (see CACHE_HANGS_GLOO)."""
    return (processes > 1 and platform == "cpu" and cpu_collectives == "gloo" and bool(cache_dir)
            and jaxlib_version in CACHE_HANGS_GLOO)


def _avoid_cache_hang() -> None:
    """Turn the persistent compilation cache off for this run where the installed jaxlib hangs on it."""
    import jax
    from omnijax.jax_private import compilation_cache
    from jaxlib import version as jaxlib_version

    if cache_hangs(jaxlib_version.__version__, jax.default_backend(), jax.config.jax_cpu_collectives_implementation,
                   jax.process_count(), jax.config.jax_compilation_cache_dir):
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # is_cache_used() remembers its first answer
        if jax.process_index() == 0:
            print(f"omnijax: the persistent compilation cache is off for this run: on jaxlib "
                  f"{jaxlib_version.__version__} a program process 0 loads from it hangs in its first "
                  f"cross-process collective on CPU. pip install 'jaxlib!={jaxlib_version.__version__}' "
                  f"keeps the cache", file=sys.stderr, flush=True)


def cpu_platform_without_accelerator() -> None:
    """On a machine without an accelerator, run jax on the CPU (JAX_PLATFORMS=cpu unless set): the CUDA plugin
    the `gpu` extra installs (to compile for GPU targets) otherwise prints its failed driver check as a
    traceback at every start, burying a run's one-line errors. The plugin stays registered for compiling."""
    if not _has_accelerator():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _has_accelerator() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/accel0"))


def _heartbeat_s() -> int:
    """jax's own missed-heartbeat limit: the user's `trainer.peer_timeout_s` (from the recipe's YAML or the
    command line, put in OMNIJAX_PEER_TIMEOUT_S by `python -m recipes` before jax starts, since this runs before
    the config is built) plus a margin, so PeerWatch reports first."""
    try:
        timeout = float(os.environ.get("OMNIJAX_PEER_TIMEOUT_S", DEFAULT_PEER_TIMEOUT_S))
    except ValueError:
        timeout = DEFAULT_PEER_TIMEOUT_S  # the config's own validation names it
    return int(timeout) + _BACKSTOP_S


def native_log(run_dir: Path, process: int | str) -> Path:
    """Where a process of a multi-process run writes what native code prints (the trainer redirects
    there; a supervisor and the tests read it)."""
    return Path(run_dir) / f"native_stderr.p{process}.log"


def redirect_native_stderr(log: Path) -> None:
    """Send file descriptor 2 (what C++ writes: check-failure stacks, gRPC/gloo logs) to `log`, and keep
    Python's sys.stderr (one-line errors, the progress bar) on the terminal."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, closefd=False)


class PeerWatch:
    """Every process beats a counter in the coordination service; a peer that stops for `timeout_s`
    makes this process print one line and exit EXIT_PEER_LOST (see the module docstring)."""

    def __init__(self, timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 last_checkpoint: Callable[[], str] = lambda: "unknown", *, client=None, me: int | None = None,
                 n: int | None = None, clock: Callable[[], float] = time.monotonic):
        """`client` (the coordination client, with key_value_set / key_value_try_get), `me`, `n` and `clock`
        default to jax's and time.monotonic; tests pass their own to judge without wall time."""
        if client is None or me is None or n is None:
            from omnijax.jax_private import distributed
            import jax

            client, me, n = distributed.global_state.client, jax.process_index(), jax.process_count()
        self.client, self.me, self.n, self.clock = client, me, n, clock
        self.armed = False
        self._beat = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.lost: int | None = None
        self.arm(timeout_s, last_checkpoint, armed=False)

    def arm(self, timeout_s: float, last_checkpoint: Callable[[], str], armed: bool = True) -> "PeerWatch":
        """Start judging the peers (the trainer calls this with trainer.peer_timeout_s); beats run from start()."""
        self.timeout_s, self.last_checkpoint = float(timeout_s), last_checkpoint
        self.interval = max(0.05, min(1.0, self.timeout_s / 10))
        now = self.clock()
        self._seen = {j: (getattr(self, "_seen", {}).get(j, (None,))[0], now) for j in range(self.n) if j != self.me}
        self._last_round = now
        self.armed = armed and self.client is not None and self.n > 1
        return self

    def start(self) -> "PeerWatch":
        if self.client is None or self.n == 1:
            return self
        self._threads = [threading.Thread(target=target, daemon=True, name="omnijax-peer-watch")
                         for target in (self._run, self._watch_coordinator)]
        for t in self._threads:
            t.start()
        # A daemon thread still inside a coordination-client call when the interpreter finalises aborts the
        # process ("FATAL: exception not rethrown", SIGABRT) after a finished run. Exit handlers run last
        # registered first, so this one stops the threads before jax's own shuts the client down.
        atexit.register(self.close)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop beating and wait for the watch threads to leave their client calls (at exit)."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def disarm(self) -> None:
        """Stop judging the peers (this process finished training) but keep beating for the others."""
        self.armed = False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat_round()
            self._stop.wait(self.interval)

    def beat_round(self) -> None:
        """Bump this process's counter, read the peers'; report a peer whose counter has not moved for
        timeout_s (by `clock`)."""
        try:
            self._beat += 1
            self.client.key_value_set(f"omnijax_beat/{self.me}", str(self._beat), allow_overwrite=True)
            now = self.clock()
            for j, (value, since) in self._seen.items():
                try:
                    got = self.client.key_value_try_get(f"omnijax_beat/{j}")
                except Exception:  # noqa: BLE001 - not yet written
                    got = value
                if got != value:
                    self._seen[j] = (got, now)
                elif self.armed and now - since > self.timeout_s:
                    self._report(j, f"sent no heartbeat for {now - since:.0f} s")
            self._last_round = now
        except Exception:  # noqa: BLE001 - the coordinator is gone: check_coordinator reports it
            pass

    def _watch_coordinator(self) -> None:
        while not self._stop.is_set():
            self.check_coordinator()
            self._stop.wait(self.interval)

    def check_coordinator(self) -> None:
        """Report the coordinator when no round of beats has completed for timeout_s (by `clock`)."""
        quiet = self.clock() - self._last_round
        if self.armed and quiet > self.timeout_s:
            self._report(0, f"(the coordinator) did not answer for {quiet:.0f} s")

    def _report(self, j: int, why: str) -> None:
        self.lost = j
        try:
            where = self.last_checkpoint()
        except Exception:  # noqa: BLE001
            where = "unknown"
        print(f"\nerror: process {j} of {self.n} stopped answering: it {why} (trainer.peer_timeout_s="
              f"{self.timeout_s:g}); process {self.me} stops. Last checkpoint: {where}. To resume, run the same "
              f"command on every host again (`python -m recipes launch` and Slurm requeue do it)",
              file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

    def verdict(self, wait_s: float) -> None:
        """Called when a collective failed: give the watch up to `wait_s` to name a lost peer (it exits)."""
        deadline = time.monotonic() + wait_s
        while self.armed and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()


def peer_error(exc: BaseException) -> bool:
    """Whether the operation that failed is one a lost peer breaks: jax's runtime raises its own error type
    (jax.errors.JaxRuntimeError) when a collective or a coordination-service call fails. A wrapped failure
    (a checkpoint save or restore) is judged by the errors under it (`cause_error` and the exception chain).
    Words in a message are never read: a ValueError or a user error that mentions a closed socket is not a
    lost peer, and only the PeerWatch, seeing a peer stop, turns a candidate into exit 75."""
    import jax

    if isinstance(exc, UserError) and getattr(exc, "cause_error", None) is None:
        return False
    seen, todo = set(), [getattr(exc, "cause_error", None), exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, jax.errors.JaxRuntimeError):
            return True
        todo += [err.__cause__, err.__context__]
    return False


def finish_together(timeout_s: float | None = None) -> int:
    """Wait until every process of the job has finished its own work (0), or stop with the peer-lost line
    (EXIT_PEER_LOST) when a peer is lost meanwhile. Called once per process, by `exit_process(0)`.

    The wait is a barrier on the coordination service, whose heartbeats go on while it waits; the PeerWatch is
    armed for it, so a peer that dies in its lone work (process 0's evaluation or export) is named within
    trainer.peer_timeout_s instead of leaving the others waiting or aborting in jax's shutdown barrier."""
    from omnijax.jax_private import distributed

    client = distributed.global_state.client
    if client is None:
        return 0
    watch = _watch
    if watch is not None:
        watch.arm(watch.timeout_s, watch.last_checkpoint)
    try:
        client.wait_at_barrier("omnijax_finished", int((FINISH_WAIT_S if timeout_s is None else timeout_s) * 1000))
    except Exception as exc:  # noqa: BLE001 - the service or a peer is gone: let the watch name it
        if watch is not None:
            watch.verdict(watch.timeout_s + 5)  # exits EXIT_PEER_LOST with its line when it sees the loss
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        print(f"\nerror: this process finished, but not every process of the job did ({text}); rerun the same "
              "command to finish the run", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    finally:
        if watch is not None:
            watch.disarm()
    return 0


def exit_process(code: int) -> None:
    """End the process with `code`. In a multi-process run a process that ended well first waits for the
    others' work after the last step (`finish_together`; see the module docstring). A failed process skips
    the native teardown: after a peer is lost, the distributed runtime's destructors can abort (SIGABRT),
    which would hide the exit code the launcher and the user act on."""
    if _initialized:
        import jax

        if jax.process_count() > 1:
            if code == 0:
                code = finish_together()
            if code:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
    sys.exit(code)


def peer_watch() -> "PeerWatch | None":
    """The process's PeerWatch (None in a one-process run)."""
    return _watch
