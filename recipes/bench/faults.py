"""Faults injected in turn on the tiny recipes: each is survived or stops cleanly with one line.

Each row: the fault, `outcome` (survived | clean stop | FAILED), `detect_s` (fault to the line naming it),
`recover_s` (fault until the run is back at the step it had reached), `steps_redone`, `max_loss_delta`
(max |loss - undisturbed run's loss| over the steps logged after the fault; null where the data changed)
and the line the run printed. Every run is a real `python -m recipes ...` process on real files.
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from omnijax.train.distributed import EXIT_DIVERGED, EXIT_PREEMPTED
from omnijax.train.metrics import read_metrics
from omnijax.utils import read_jsonl

DESCRIPTION = ("faults injected on the tiny recipes (damaged checkpoint, failed save, SIGKILL under launch, SIGTERM "
               "during an async save, truncated shard, undecodable media, changed config on resume, I/O error on "
               "restore, preemption and a deterministic crash under launch, NaN streak): survived or a one-line stop")


@dataclass
class FaultsBench:
    steps: int = 20
    every: int = 5               # checkpoint interval
    cpu_devices: int = 8
    faults: str = "all"          # comma-separated subset of the row names
    timeout_s: int = 900         # per run


ROWS = ("damaged_checkpoint", "failed_save", "sigkill_under_launch", "sigterm_during_save", "truncated_shard",
        "undecodable_media", "resume_changed_config", "io_error_on_restore", "preemption_under_launch",
        "crash_under_launch", "nan_streak", "checksum_cost")
NEEDS_REF = {"damaged_checkpoint", "failed_save", "sigkill_under_launch", "sigterm_during_save",
             "resume_changed_config", "preemption_under_launch"}


class Run:
    """A `python -m recipes ...` child whose stderr lines are timestamped as they arrive."""

    def __init__(self, args: list[str], env: dict | None = None, preexec=None):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "recipes", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=preexec)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(5)
        return rc

    def first(self, needle: str) -> tuple[float, str] | None:
        return next(((t, l) for t, l in self.lines if needle in l), None)

    def text(self) -> str:
        return "\n".join(l for _, l in self.lines)


def _env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def _runs() -> Path:
    return Path(os.environ.get("OMNIJAX_RUNS", "runs"))


def _metrics(name: str) -> list[dict]:
    """Run `name`'s metrics rows by the resume rule (`metrics.read_metrics`)."""
    return read_metrics(_runs() / name / "metrics.jsonl")


def losses(name: str) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in _metrics(name) if "loss" in r}


def _lm_args(b: FaultsBench, name: str, *extra: str) -> list[str]:
    return ["tiny_lm", f"trainer.steps={b.steps}", f"trainer.run_name={name}", f"trainer.checkpoint_every={b.every}",
            "trainer.log_every=1", "trainer.progress=false", *extra]


def _fresh(name: str) -> None:
    shutil.rmtree(_runs() / name, ignore_errors=True)
    shutil.rmtree(_runs() / f"{name}_set_aside", ignore_errors=True)


def _wait_step(name: str, step: int, run: Run, timeout: float) -> float | None:
    """Time at which run `name` logged `step` (None if the process ended or time ran out first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(losses(name) or {0: 0}) >= step:
            return time.monotonic()
        if run.proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def _row_count(name: str) -> int:
    """Complete rows in run `name`'s metrics.jsonl as written (every attempt's, in the order logged)."""
    return len(read_jsonl(_runs() / name / "metrics.jsonl"))


def _steps_after(name: str, n: int) -> list[int]:
    """The steps of the rows logged after the first `n` (those of the attempts since)."""
    return [int(r["step"]) for r in read_jsonl(_runs() / name / "metrics.jsonl")[n:] if "step" in r]


def _delta(ref: dict, got: dict, steps) -> float | None:
    common = [s for s in steps if s in ref and s in got]
    return max(abs(ref[s] - got[s]) for s in common) if common else None


def _row(fault: str, outcome: str, detect: float | None, recover: float | None, redone: int | None,
         delta: float | None, line: str, **extra) -> dict:
    r = lambda x: None if x is None else round(x, 2)  # noqa: E731
    return {"variant": fault, "outcome": outcome, "detect_s": r(detect), "recover_s": r(recover),
            "steps_redone": redone, "max_loss_delta": delta, "line": line[:240], **extra}


# ------------------------------------------------------------------------------------ faults
def damaged_checkpoint(b: FaultsBench, ref: dict) -> dict:
    name = "bench_faults_ck"
    _fresh(name)
    Run(_lm_args(b, name), _env(b.cpu_devices)).wait(b.timeout_s)
    ck = _runs() / name / "checkpoints" / str(b.steps)
    files = sorted((p for p in ck.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(files[-1], "r+b") as f:                       # the newest checkpoint's largest file cut in half
        f.truncate(files[-1].stat().st_size // 2)
    fault_at = time.monotonic()
    run = Run(_lm_args(b, name), _env(b.cpu_devices))
    rc = run.wait(b.timeout_s)
    warn = run.first(f"checkpoint step {b.steps} is damaged")
    got = losses(name)
    back = b.steps - b.every
    ok = rc == 0 and warn is not None and min(got) == 1 and max(got) == b.steps
    return _row("damaged_checkpoint", "survived" if ok else "FAILED", warn and warn[0] - fault_at,
                run.lines[-1][0] - fault_at if ok else None, b.steps - back,
                _delta(ref, got, range(back + 1, b.steps + 1)), warn[1] if warn else run.text()[-240:])


def failed_save(b: FaultsBench, ref: dict) -> dict:
    """Once the first checkpoint is committed, the process may write no file larger than 64 KiB (a full
    disk as the process sees it: EFBIG). The run must stop with one line naming the folder, the earlier
    checkpoint must restore, and a rerun with room again finishes with the undisturbed losses."""
    name = "bench_faults_save"
    _fresh(name)
    run = Run(_lm_args(b, name), _env(b.cpu_devices))
    first = _runs() / name / "checkpoints" / str(b.every)
    while run.proc.poll() is None and not (first / "omnijax_checksums.json").exists():
        time.sleep(0.02)
    resource.prlimit(run.proc.pid, resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    fault_at = time.monotonic()
    rc = run.wait(b.timeout_s)
    stop = run.first("failed:")
    last = next((l for _, l in reversed(run.lines) if l.strip()), "")
    # the run's own report is its last line; tensorstore callbacks still running when orbax closes its event
    # loop print "Event loop is closed" tracebacks above it (counted, see docs/reliability.md)
    one_line = rc == 2 and stop is not None and last == stop[1] and str(_runs() / name) in stop[1]
    noise = run.text().count("Traceback (most recent call last)")
    rerun = Run(_lm_args(b, name), _env(b.cpu_devices))
    rc2 = rerun.wait(b.timeout_s)
    resumed = rerun.first("resumed from")
    got = losses(name)
    ok = one_line and rc2 == 0 and resumed is not None and max(got) == b.steps
    return _row("failed_save", "clean stop" if ok else "FAILED", stop and stop[0] - fault_at, None,
                b.every, _delta(ref, got, range(b.every + 1, b.steps + 1)), stop[1] if stop else run.text()[-240:],
                exit_code=rc, library_tracebacks_above=noise, rerun_resumed_from=resumed[1] if resumed else None)


def sigkill_under_launch(b: FaultsBench, ref: dict) -> dict:
    name = "bench_faults_launch"
    _fresh(name)
    devices = max(1, b.cpu_devices // 2)
    run = Run(["launch", "--processes", "2", "--cpu-devices-per-process", str(devices), "--max-restarts", "2",
               *_lm_args(b, name)], dict(os.environ))
    kill_at = b.every * 2 + b.every // 2
    _wait_step(name, kill_at, run, b.timeout_s)
    victims = [p for p, args in _descendants(run.proc.pid) if "--process-id 1" in args]
    reached = max(losses(name) or {0: 0})
    if not victims:
        run.proc.kill()
        return _row("sigkill_under_launch", "FAILED", None, None, None, None, "no process 1 found")
    os.kill(victims[-1], signal.SIGKILL)
    fault_at = time.monotonic()
    seen = _row_count(name)
    back_t = None
    while run.proc.poll() is None and back_t is None:  # rows logged after the kill reach the step it had reached
        if any(s >= reached for s in _steps_after(name, seen)):
            back_t = time.monotonic()
        time.sleep(0.1)
    rc = run.wait(b.timeout_s)
    restarted = run.first("launch: restart")
    got = losses(name)
    last_ck = (reached // b.every) * b.every
    ok = rc == 0 and restarted is not None and max(got) == b.steps
    return _row("sigkill_under_launch", "survived" if ok else "FAILED", restarted and restarted[0] - fault_at,
                back_t and back_t - fault_at, reached - last_ck, _delta(ref, got, range(1, b.steps + 1)),
                restarted[1] if restarted else run.text()[-240:])


def _descendants(pid: int) -> list[tuple[int, str]]:
    rows = subprocess.run(["ps", "-ww", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
    kids: dict[int, list] = {}
    for r in rows:
        parts = r.strip().split(None, 2)
        if len(parts) == 3:
            kids.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2]))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c[0])
    return out


def sigterm_during_save(b: FaultsBench, ref: dict) -> dict:
    """SIGTERM the moment an async save's temporary folder appears: the run finishes that save, says so
    and exits EXIT_PREEMPTED (it did not finish); the rerun resumes from it."""
    name = "bench_faults_term"
    _fresh(name)
    run = Run(_lm_args(b, name), _env(b.cpu_devices))
    folder = _runs() / name / "checkpoints"
    target = 2 * b.every
    while run.proc.poll() is None and not list(folder.glob(f"{target}.orbax-checkpoint-tmp*")):
        time.sleep(0.01)
    run.proc.send_signal(signal.SIGTERM)
    fault_at = time.monotonic()
    rc = run.wait(b.timeout_s)
    said = run.first("preempted")
    stopped_at = max(losses(name) or {0: 0})
    rerun = Run(_lm_args(b, name), _env(b.cpu_devices))
    rc2 = rerun.wait(b.timeout_s)
    resumed = rerun.first("resumed from")
    at = int(re.search(r"at step (\d+)", resumed[1]).group(1)) if resumed else 0
    got = losses(name)
    ok = rc == EXIT_PREEMPTED and said is not None and rc2 == 0 and resumed is not None and max(got) == b.steps
    back = _wait_t(rerun, "resumed from")
    return _row("sigterm_during_save", "survived" if ok else "FAILED", said and said[0] - fault_at,
                back and back - fault_at, stopped_at - at, _delta(ref, got, range(1, b.steps + 1)),
                said[1] if said else run.text()[-240:], stopped_at_step=stopped_at, resumed_at_step=at, exit_code=rc)


def _wait_t(run: Run, needle: str) -> float | None:
    hit = run.first(needle)
    return hit[0] if hit else None


def _world_shards_n(folder: Path, samples: int = 200, shards: int = 4) -> list[Path]:
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "recipes", "convert", "input=world", f"output={folder}",
                    f"samples={samples}", f"shards={shards}"], check=True, capture_output=True)
    return sorted(folder.glob("*.arrayrecord"))


def truncated_shard(b: FaultsBench, ref: dict) -> Iterator[dict]:
    src = _runs() / "bench_faults_data"
    victim = _world_shards_n(src)[1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size * 2 // 3)
    common = ["tiny_omni", f"data.sources=[{src}]", "trainer.steps=3", "trainer.checkpoint_every=0",
              "trainer.progress=false", "trainer.log_every=1"]
    _fresh("bench_faults_shard")
    fault_at = time.monotonic()
    run = Run([*common, "trainer.run_name=bench_faults_shard"])
    rc = run.wait(b.timeout_s)
    last = run.lines[-1] if run.lines else (0.0, "")
    ok = rc != 0 and victim.name in last[1] and "Traceback" not in run.text()
    yield _row("truncated_shard", "clean stop" if ok else "FAILED", last[0] - fault_at if ok else None, None, None,
               None, last[1], exit_code=rc)
    _fresh("bench_faults_shard_skip")
    fault_at = time.monotonic()
    run = Run([*common, "trainer.run_name=bench_faults_shard_skip", "data.bad_shards=skip"])
    rc = run.wait(b.timeout_s)
    warn = run.first("skipping damaged shard")
    rows = _metrics("bench_faults_shard_skip")
    skipped = rows[-1].get("skipped_shards") if rows else None
    ok = rc == 0 and warn is not None and skipped == 1
    yield _row("truncated_shard_skip", "survived" if ok else "FAILED", warn and warn[0] - fault_at, None, None, None,
               warn[1] if warn else run.text()[-240:], skipped_shards=skipped)


def undecodable_media(b: FaultsBench, ref: dict) -> dict:
    """Every 8th record of a converted shard gets a media payload that cannot decode (its bytes cut short;
    the manifest rewritten to match, as if the source media had been bad): the loader must count and
    skip them, never crash the step."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    from omnijax.data import records

    src = _runs() / "bench_faults_media"
    (shard,) = _world_shards_n(src, 64, 1)
    reader = ArrayRecordReader(str(shard))
    raws = reader.read_all()
    reader.close()
    writer = ArrayRecordWriter(str(shard), "group_size:1")
    for i, raw in enumerate(raws):
        writer.write(raw[: len(raw) // 2] if i % 8 == 3 else raw)
    writer.close()
    manifest_path = Path(str(shard) + records.MANIFEST_SUFFIX)
    manifest = json.loads(manifest_path.read_text())
    manifest.update(bytes=shard.stat().st_size, sha256=records.file_sha256(shard))
    records.write_json_atomic(manifest_path, manifest)
    name = "bench_faults_media_run"
    _fresh(name)
    fault_at = time.monotonic()
    run = Run(["tiny_omni", f"data.sources=[{src}]", "trainer.steps=4", f"trainer.run_name={name}",
               "trainer.checkpoint_every=0", "trainer.progress=false", "trainer.log_every=1"])
    rc = run.wait(b.timeout_s)
    rows = _metrics(name)
    skipped = max((r.get("skipped_bad_records", 0) for r in rows), default=None)
    warn = run.first("skipped bad record")
    ok = rc == 0 and bool(skipped) and len(rows) == 4
    return _row("undecodable_media", "survived" if ok else "FAILED", warn and warn[0] - fault_at, None, 0, None,
                warn[1] if warn else run.text()[-240:], skipped_bad_records=skipped)


def _snapshot(root: Path) -> dict:
    """Every file under `root` with its size and modification time ("nothing moved" compares two)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _last_line(run: Run) -> str:
    return next((l for _, l in reversed(run.lines) if l.strip()), "")


def resume_changed_config(b: FaultsBench, ref: dict) -> dict:
    """The undisturbed run's command again with model.num_layers=3 (it trained 4): a checkpoint of another
    model, not damage. One line naming the differing parameters and the key, exit 2, every file in place."""
    name = "bench_faults_ref"
    folder = _runs() / name
    before = _snapshot(folder)
    t0 = time.monotonic()
    run = Run(_lm_args(b, name, f"trainer.steps={b.steps + b.every}", "model.num_layers=3"), _env(b.cpu_devices))
    rc = run.wait(b.timeout_s)
    line = _last_line(run)
    moved = _snapshot(folder) != before or (_runs() / f"{name}_set_aside").exists() or any(
        folder.glob("checkpoints_*"))
    ok = (rc == 2 and line.startswith("error:") and "model.num_layers: 4 -> 3" in line and "damaged" not in run.text()
          and "Traceback" not in run.text() and not moved)
    at = run.first("holds another model")
    return _row("resume_changed_config", "clean stop" if ok else "FAILED", at and at[0] - t0, None, None, None, line,
                exit_code=rc, files_moved=moved)


def io_error_on_restore(b: FaultsBench, ref: dict) -> Iterator[dict]:
    """An OS error (EIO, as a flaky network mount gives) on the reads of a restore, in-process on the trainer's
    Checkpointer: twice, then the reads work (retried, restored); every time (one line naming the file).
    Nothing is set aside either way. The failing read is injected into orbax's restore call."""
    import errno
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from omnijax.train import checkpoint
    from omnijax.train.checkpoint import Checkpointer, CheckpointReadError

    with tempfile.TemporaryDirectory(dir=_runs()) as tmp:
        ck = Checkpointer(Path(tmp) / "checkpoints")
        tree = {"w": jnp.asarray(np.arange(4096, dtype=np.float32))}
        ck.save(1, tree)
        ck.wait()
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        victim = str(max((p for p in Path(tmp).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size))
        real, fails, lines = ck._manager.restore, [], []

        def flaky(step, args=None):
            if fails:
                fails.pop()
                raise OSError(errno.EIO, os.strerror(errno.EIO), victim)
            return real(step, args=args)

        ck._manager.restore = flaky
        for variant, n in (("io_error_on_restore_transient", 2), ("io_error_on_restore_persistent", 99)):
            before = _snapshot(Path(tmp))
            fails[:] = [1] * n
            t0 = time.monotonic()
            try:
                state, _, _ = ck.restore_good(target, log=lines.append)
                ok, line = bool(np.array_equal(np.asarray(state["w"]), np.asarray(tree["w"]))), lines[-1]
                outcome = "survived"
            except CheckpointReadError as exc:
                ok, line, outcome = n > len(checkpoint.READ_RETRY_S), f"error: {exc}", "clean stop"
            took = time.monotonic() - t0
            moved = _snapshot(Path(tmp)) != before or (Path(tmp) / "checkpoints_set_aside").exists()
            yield _row(variant, outcome if ok and not moved else "FAILED", took, None, None, None, line,
                       attempts=min(n, len(checkpoint.READ_RETRY_S)) + 1, files_moved=moved)
        ck._manager.restore = real
        ck.close()


def preemption_under_launch(b: FaultsBench, ref: dict) -> dict:
    """SIGTERM to the recipe process under `launch` (one process; the launcher itself is not signalled): it
    saves, exits EXIT_PREEMPTED, launch restarts it, and the run ends with the undisturbed losses."""
    name = "bench_faults_preempt"
    _fresh(name)
    run = Run(["launch", "--processes", "1", "--cpu-devices-per-process", str(b.cpu_devices), "--max-restarts", "1",
               *_lm_args(b, name)], dict(os.environ))
    at = b.every + b.every // 2
    _wait_step(name, at, run, b.timeout_s)
    kids = [p for p, args in _descendants(run.proc.pid) if "--process-id 0" in args]
    reached = max(losses(name) or {0: 0})
    if not kids:
        run.proc.kill()
        return _row("preemption_under_launch", "FAILED", None, None, None, None, "no recipe process found")
    os.kill(kids[-1], signal.SIGTERM)
    fault_at = time.monotonic()
    rc = run.wait(b.timeout_s)
    restarted = run.first("launch: restart")
    got = losses(name)
    ok = (rc == 0 and restarted is not None and f"preempted: it saved and stopped (exit {EXIT_PREEMPTED})" in
          restarted[1] and max(got) == b.steps)
    return _row("preemption_under_launch", "survived" if ok else "FAILED", restarted and restarted[0] - fault_at,
                None, None, _delta(ref, got, range(1, b.steps + 1)),
                restarted[1] if restarted else run.text()[-240:], stopped_at_step=reached)


# injected into real recipe processes through sitecustomize (every Python process imports it at start): patches
# applied when the named omnijax module is first imported, so jax starts as the recipe configures it
_SITE = """
import importlib.abc, importlib.util, os, sys
crash_at, nan_from = int(os.environ.get("BENCH_CRASH_AT", "0")), int(os.environ.get("BENCH_NAN_FROM", "0"))

def _patch(name, module):
    if name == "omnijax.train.loop" and crash_at:          # a deterministic bug at one step
        check = module.Trainer._check_finite
        def crash(self, step, scalars):
            if step == crash_at:
                raise IndexError(f"an injected bug at step {step}")
            return check(self, step, scalars)
        module.Trainer._check_finite = crash
    if name == "omnijax.models.losses" and nan_from:       # NaN gradients from a step on (a poison the loader adds)
        import jax.numpy as jnp
        lm = module.lm_loss
        def poisoned(model, batch):
            loss_sum, count, aux = lm(model, {k: v for k, v in batch.items() if k != "poison"})
            return loss_sum + jnp.sum(batch["poison"]) * loss_sum, count, aux
        module.lm_loss = poisoned
    if name == "recipes.common" and nan_from:
        import numpy as np
        nxt = module.IndexedLoader.__next__
        def poison(self):
            batch = nxt(self)
            bad = self.step >= nan_from
            return {**batch, "poison": np.full(len(batch["tokens"]), np.nan if bad else 0.0, np.float32)}
        module.IndexedLoader.__next__ = poison

class _Finder(importlib.abc.MetaPathFinder):
    wanted = {"omnijax.train.loop", "omnijax.models.losses", "recipes.common"}
    def find_spec(self, name, path, target=None):
        if name not in self.wanted:
            return None
        self.wanted = self.wanted - {name}
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            _patch(name, module)
        spec.loader.exec_module = exec_module
        return spec

if crash_at or nan_from:
    sys.meta_path.insert(0, _Finder())
"""


def _injected_env(base: dict, folder: Path, **values: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITE)
    path = os.pathsep.join([str(folder), str(Path(__file__).resolve().parents[2]), base.get("PYTHONPATH", "")])
    return {**base, "PYTHONPATH": path.rstrip(os.pathsep), **{k: str(v) for k, v in values.items()}}


def crash_under_launch(b: FaultsBench, ref: dict) -> dict:
    """A deterministic bug (an IndexError raised at step every+2 in both processes) under `launch` with
    --max-restarts 3: restarted once from the last checkpoint, and when the attempt fails the same way at
    the same step again, not restarted a second time."""
    name = "bench_faults_crash"
    _fresh(name)
    at = b.every + 2
    env = _injected_env(dict(os.environ), _runs() / name / "inject", BENCH_CRASH_AT=at)
    t0 = time.monotonic()
    run = Run(["launch", "--processes", "2", "--cpu-devices-per-process", str(max(1, b.cpu_devices // 2)),
               "--max-restarts", "3", *_lm_args(b, name)], env)
    rc = run.wait(b.timeout_s)
    restarts = [l for _, l in run.lines if l.startswith("launch: restart")]
    stop = run.first("again after step")
    ok = rc != 0 and len(restarts) == 1 and stop is not None and max(losses(name) or {0: 0}) < b.steps
    return _row("crash_under_launch", "clean stop" if ok else "FAILED", stop and stop[0] - t0, None, None, None,
                stop[1] if stop else run.text()[-240:], exit_code=rc, restarts=len(restarts))


def nan_streak(b: FaultsBench, ref: dict) -> dict:
    """NaN gradients from step every+3 on (injected through the batch): the run skips those updates and stops
    after trainer.max_nonfinite_in_row=3 with EXIT_DIVERGED, naming checkpoint `every` and the command with a
    lower optimizer.lr; under launch it is not restarted."""
    name = "bench_faults_nan"
    _fresh(name)
    env = _injected_env(dict(os.environ), _runs() / f"{name}_inject", BENCH_NAN_FROM=b.every + 3)
    t0 = time.monotonic()
    run = Run(["launch", "--processes", "1", "--cpu-devices-per-process", str(b.cpu_devices), "--max-restarts", "3",
               *_lm_args(b, name, "trainer.max_nonfinite_in_row=3")], env)
    rc = run.wait(b.timeout_s)
    line = run.first("training diverged")
    ok = (rc == EXIT_DIVERGED and line is not None and f"Last good checkpoint: step {b.every} in" in line[1]
          and "optimizer.lr=" in line[1] and run.first("launch: restart") is None)
    shutil.rmtree(_runs() / f"{name}_inject", ignore_errors=True)
    return _row("nan_streak", "clean stop" if ok else "FAILED", line and line[0] - t0, None, None, None,
                line[1] if line else run.text()[-240:], exit_code=rc)


def checksum_cost(b: FaultsBench, ref: dict) -> Iterator[dict]:
    """What the checksums cost: seconds to hash a checkpoint at save (process 0's background thread, before
    the commit) and to verify it at restore, beside orbax's own save and restore, for a few sizes."""
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from omnijax.train.checkpoint import Checkpointer

    for mb in (8, 256):
        n = mb * (1 << 20) // 4
        tree = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(n, dtype=np.float32))}
        with tempfile.TemporaryDirectory(dir=_runs()) as tmp:
            ck = Checkpointer(Path(tmp) / "checkpoints")
            t0 = time.perf_counter()
            ck.save(1, tree)
            ck.wait()
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ck.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree), 1)
            restore_s = time.perf_counter() - t0
            ck.close()
            size = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        yield {"variant": f"checksum_cost_{mb}MB", "checkpoint_bytes": size, "save_s": round(save_s, 3),
               "checksum_at_save_s": round(ck.checksum_s[-1], 3), "restore_s": round(restore_s, 3),
               "verify_at_restore_s": round(ck.verify_s, 3),
               "hash_GB_per_s": round(size / max(ck.verify_s, 1e-9) / 1e9, 2)}


def run(overrides: list[str]) -> Iterator[dict]:
    from omnijax.config import build

    b = build(FaultsBench, None, overrides, check=None)
    want = ROWS if b.faults == "all" else tuple(f.strip() for f in b.faults.split(","))
    ref_name = "bench_faults_ref"
    ref: dict = {}
    if set(want) & NEEDS_REF:
        _fresh(ref_name)
        Run(_lm_args(b, ref_name), _env(b.cpu_devices)).wait(b.timeout_s)
        ref = losses(ref_name)
        if max(ref or {0: 0}) != b.steps:
            raise RuntimeError(f"the undisturbed reference run did not finish: see {_runs() / ref_name}")
    for fault in want:
        out = globals()[fault](b, ref)
        yield from (out if not isinstance(out, dict) else [out])
