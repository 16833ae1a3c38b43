"""Faults (docs/reliability.md): damaged checkpoints, failed saves, damaged shards, a lost process, the launcher.

Real orbax checkpoints, real shards, real `python -m recipes` processes; no mocks."""
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.errors import UserError
from omnijax.train.checkpoint import CheckpointSaveError, Checkpointer

REPO = Path(__file__).resolve().parents[1]
TINY_LM = ["model.embed_dim=64", "model.num_layers=2", "model.head_dim=16", "model.mlp_dim=128", "data.seq_len=32",
           "data.batch_size=8", "data.eval_batches=1", "trainer.log_every=1", "trainer.progress=false",
           "optimizer.warmup_steps=2"]


def _tree(k: float) -> dict:
    noise = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)  # incompressible
    return {"w": jnp.asarray(noise) + k, "b": jnp.arange(16, dtype=jnp.float32) + k}


def _files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_damaged_checkpoints_are_set_aside_and_the_newest_good_one_restored(tmp_path):
    ck = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2, 3):
        ck.save(step, _tree(float(step)), {"step": step})
    ck.wait()
    assert all(ck.verify(s) is None for s in (1, 2, 3))
    big = _files(tmp_path / "checkpoints" / "3")[-1]
    with open(big, "r+b") as f:  # the newest cut in half
        f.truncate(big.stat().st_size // 2)
    mid = _files(tmp_path / "checkpoints" / "2")[-1]
    size = mid.stat().st_size
    with open(mid, "r+b") as f:  # step 2: bytes overwritten in the middle, same size
        f.seek(size // 2)
        f.write(b"\x00\xff" * 64)
    assert "bytes" in ck.verify(3) and "checksum mismatch" in ck.verify(2) and mid.stat().st_size == size
    lines = []
    state, loader, step = ck.restore_good(_tree(0.0), log=lines.append)
    assert step == 1 and loader == {"step": 1} and float(state["b"][0]) == 1.0
    assert len(lines) == 2 and "step 3" in lines[0] and "step 2" in lines[1]
    aside = tmp_path / "checkpoints_set_aside"
    assert sorted(p.name for p in aside.iterdir()) == ["2", "3"]  # renamed, not deleted
    assert ck.all_steps() == [1]
    with pytest.raises(UserError, match="resume_step=3: no such checkpoint"):
        ck.restore_good(_tree(0.0), step=3)
    big = _files(tmp_path / "checkpoints" / "1")[-1]
    with open(big, "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError, match="no readable checkpoint") as err:
        ck.restore_good(_tree(0.0), log=lines.append)
    assert "\n" not in str(err.value)
    ck.close()


def test_a_failed_save_names_the_folder_and_keeps_earlier_checkpoints(tmp_path):
    ck = Checkpointer(tmp_path / "checkpoints")
    ck.save(1, _tree(1.0))
    ck.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))  # no file over 16 KiB: a full disk (EFBIG)
    try:
        with pytest.raises(CheckpointSaveError) as err:
            ck.save(2, _tree(2.0))
            ck.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    msg = str(err.value)
    assert str(tmp_path / "checkpoints") in msg and "step 2" in msg and "checkpoints 1 are intact" in msg
    fresh = Checkpointer(tmp_path / "checkpoints")
    state, _, step = fresh.restore_good(_tree(0.0))
    assert step == 1 and float(state["b"][3]) == 4.0
    fresh.close()


def test_damaged_shards_are_named_or_skipped_and_counted(tmp_path):
    from omnijax.data import records
    from omnijax.data.sources import HostArrayRecords, SourceSpec, open_sources
    from recipes import convert

    out = tmp_path / "shards"
    assert convert.main(["input=world", f"output={out}", "samples=40", "shards=4"]) == 0
    shards = sorted(str(p) for p in out.glob("*.arrayrecord"))
    assert all(records.check_shard(p) is None for p in shards)
    with open(shards[1], "r+b") as f:
        f.truncate(os.path.getsize(shards[1]) * 2 // 3)
    spec = [SourceSpec(name="mine", path=str(out))]
    with pytest.raises(records.BadShard) as err:
        open_sources(spec)
    assert shards[1] in str(err.value) and "\n" not in str(err.value)
    (src,) = open_sources(spec, bad_shards="skip")
    assert len(src) == 30 and src.skipped_shards == 1
    # same size, different bytes: the checksum names it; unchecked, reading the record names the shard
    size = os.path.getsize(shards[2])
    with open(shards[2], "r+b") as f:
        f.seek(size // 3)
        f.write(os.urandom(4096))
    assert "checksum mismatch" in records.check_shard(shards[2])
    assert records.check_shard(shards[2], checksum=False) is None
    host = HostArrayRecords([[shards[2]]])
    bad = []
    for i in range(len(host)):
        try:
            records.decode(host.read(i))
        except records.BadRecord as exc:
            bad.append(str(exc))
    assert bad and all(shards[2] in b for b in bad)


FAST_COMPILE = "--xla_backend_optimization_level=0"  # as the rest of the suite (conftest.py): what these tests
# check (a lost process's line, the restart, equal losses) holds at any level, and compiling is most of their CPU


def _recipes(args, log: Path, env=None):
    """`python -m recipes ARGS`, its stderr (what a user's terminal shows) into `log` (files, not pipes: a
    full pipe would stall the process)."""
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    if "XLA_FLAGS" not in (env or {}):  # the suite's compile level (conftest.py), not its device count
        e["XLA_FLAGS"] = FAST_COMPILE
    return subprocess.Popen([sys.executable, "-m", "recipes", *args], cwd=REPO, env=e, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))


def _losses(run: Path) -> dict[int, float]:
    if not (run / "metrics.jsonl").exists():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _main_stack(text: str) -> str:
    """The last faulthandler block of the thread that took the signal (the main thread), else the tail."""
    at = text.rfind("Current thread ")
    return text[at:at + 1500] if at >= 0 else text[-600:]


def _wait_for_checkpoint(run: Path, step: int, procs, logs: list[Path], timeout=300) -> None:
    """Until checkpoint `step` is committed (metrics.jsonl is written in blocks; checkpoints show progress).
    A run that stops or hangs fails with its logs and, for a hang, every process's Python stacks (SIGUSR1)."""
    from recipes.bench.faults import _descendants

    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / str(step) / "omnijax_checksums.json").exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for pid in [p.pid for p in procs if p.poll() is None] + [d for p in procs for d, _ in _descendants(p.pid)]:
                os.kill(pid, signal.SIGUSR1)  # recipes/__main__.py: faulthandler prints the stacks
            time.sleep(3)
            files = [log for log in [*logs, *sorted(run.glob("native_stderr.p*.log"))] if log.exists()]
            tails = "\n".join(f"--- {log}:\n{log.read_text()[-4000:]}" for log in files)
            # each process's main thread last: what a truncated CI log still shows
            mains = "\n".join(f"--- main thread of {log.name}:\n{_main_stack(log.read_text())}" for log in files)
            raise AssertionError(f"no checkpoint {step} in {run} after {time.monotonic() - deadline + timeout:.0f} s "
                                 f"(exit codes {[p.poll() for p in procs]})\n{tails}\n{mains}")
        time.sleep(0.05)


def test_the_launcher_reports_the_lost_process_not_its_survivor():
    """Process 1 killed: process 0 (polled first) exits 75 or aborts when its collective breaks first; the
    line names process 1 whichever the survivor did (the race once named process 0's SIGABRT)."""
    import signal as sig

    from omnijax.train.supervisor import exit_reason as _why, first_cause

    killed = -int(sig.SIGKILL)
    assert first_cause([(0, -int(sig.SIGABRT)), (1, killed)]) == (1, killed)
    assert first_cause([(0, 75), (1, killed)]) == (1, killed)
    assert first_cause([(0, 1), (1, killed)]) == (0, 1)           # a real failure of its own comes first
    assert first_cause([(0, -int(sig.SIGABRT))]) == (0, -int(sig.SIGABRT))  # nothing else to blame
    assert first_cause([(0, 75), (1, 124)]) == (1, 124)          # a hung process stopped; its peer reacted
    assert "trainer.hang_timeout_s" in _why(1, 124) and "peer" in _why(0, 75)
    with pytest.raises(ValueError):
        first_cause([])


def test_a_save_broken_by_a_lost_peer_is_told_from_a_disk_fault(tmp_path):
    """A save a lost process broke (gloo's all-gather under orbax) goes to the peer watch (one line, exit 75);
    a disk fault or any other user error does not (CI once saw the survivor print the save error instead)."""
    import jax

    from omnijax.train.distributed import peer_error

    runtime = jax.errors.JaxRuntimeError  # what jax raises when a collective or the coordination service fails
    ck = Checkpointer(tmp_path / "checkpoints", async_save=False)
    lost = ck._save_error(12, runtime("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer"))
    full = ck._save_error(12, OSError(28, os.strerror(28), str(tmp_path / "x")))
    assert isinstance(lost, CheckpointSaveError) and "saving step 12" in str(lost)
    assert peer_error(lost) and not peer_error(full)
    assert not peer_error(UserError("a peer path: /home/peer/data.jsonl closed"))  # a user error's own words
    assert peer_error(runtime("Gloo AllGather failed: Connection reset by peer"))
    assert not peer_error(ValueError("shapes (3,) and (4,) differ"))
    # classified by the operation that failed (its error type), never by words: a bug that talks of sockets
    # is not a lost peer (it was exit 75 and a restart loop), a runtime failure under a wrapper is
    assert not peer_error(ValueError("Connection closed by peer: socket UNAVAILABLE (gloo barrier heartbeat)"))
    assert not peer_error(RuntimeError("DEADLINE_EXCEEDED: coordination heartbeat from a peer, socket closed"))
    try:
        try:
            raise runtime("UNAVAILABLE: the coordination service is gone")
        except Exception as inner:
            raise ValueError("orbax: commit failed") from inner
    except ValueError as wrapped:
        assert peer_error(wrapped)


def test_the_compilation_cache_is_turned_off_only_where_the_installed_jaxlib_hangs_on_it():
    """jaxlib 0.12.1: process 0 of a CPU (gloo) group that loads a cached program hangs in step 1 (CI saw the
    launched group below stall for 300 s); one process, other jaxlibs, or no cache folder keep the cache."""
    from omnijax.train.distributed import CACHE_HANGS_GLOO, cache_hangs

    assert "0.12.1" in CACHE_HANGS_GLOO
    assert cache_hangs("0.12.1", "cpu", "gloo", 2, "/tmp/cache")
    assert not cache_hangs("0.12.0.1", "cpu", "gloo", 2, "/tmp/cache")  # measured: finishes
    assert not cache_hangs("0.12.1", "cpu", "gloo", 1, "/tmp/cache")    # one process: no cross-process collective
    assert not cache_hangs("0.12.1", "cpu", "gloo", 2, None) and not cache_hangs("0.12.1", "cpu", "gloo", 2, "")
    assert not cache_hangs("0.12.1", "gpu", "gloo", 2, "/tmp/cache")    # NCCL, not gloo: not measured to hang
    assert not cache_hangs("0.12.1", "cpu", "mpi", 2, "/tmp/cache")


_EXIT_PAIR = """
import time
from omnijax.train import distributed as launch
launch.maybe_initialize_distributed()
watch = launch.peer_watch()
real = watch.client

class Blocking:  # every read of a peer's beat waits 2 s inside a native coordination-client call
    def key_value_set(self, *args, **kwargs):
        return real.key_value_set(*args, **kwargs)

    def key_value_try_get(self, key):
        try:
            return real.blocking_key_value_get("never/" + key, 2000)
        except Exception:
            return real.key_value_try_get(key)

watch.client = Blocking()
watch.arm(0.5, lambda: "none", armed=False)
watch.interval = 0.0
time.sleep(1.0)  # from here the watch thread is inside a blocking client call nearly all the time
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("done")
"""


def test_a_finished_process_exits_cleanly_while_its_peer_watch_is_busy(tmp_path):
    """A clean-clone suite run saw a finished tiny_lm pair's process 0 abort at exit (SIGABRT, "FATAL: exception
    not rethrown"): a watch thread was inside a coordination-client call when the interpreter finalised. The
    race is made deterministic: every read of the watch blocks 2 s inside a native client call, so at exit a
    thread is always inside one. Without `PeerWatch.close` at exit both processes abort (checked: rc 134);
    with it, close waits for the thread to leave the call and both exit 0."""
    from omnijax.train.supervisor import free_port

    port = free_port()
    procs = []
    for pid in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE,
                   OMNIJAX_COORDINATOR=f"127.0.0.1:{port}", OMNIJAX_NUM_PROCESSES="2", OMNIJAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, "-c", _EXIT_PAIR], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"p{pid}.log", "w")))
    for pid, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (tmp_path / f"p{pid}.log").read_text()[-2000:]


@pytest.mark.slow
def test_a_lost_process_stops_the_survivor_in_one_line_and_launch_restarts_the_group(tmp_path):
    runs = tmp_path / "runs"
    env = {"OMNIJAX_RUNS": str(runs), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}"}
    steps = 24  # the kill comes once step 4 or 8 is saved: 16 or more steps before the end
    # a stuck group ends itself (exit 124, its stacks in the native logs) long before the test's own wait
    common = ["tiny_lm", *TINY_LM, f"trainer.steps={steps}", "trainer.checkpoint_every=4", "trainer.hang_timeout_s=120"]
    # the undisturbed run: one process, 8 devices, no checkpoints (saving does not change a loss)
    ref = _recipes([*common, "trainer.run_name=ref", "parallel.cpu_devices=8", "trainer.checkpoint_every=0"],
                   tmp_path / "ref.log", env={"OMNIJAX_RUNS": str(runs)})
    assert ref.wait(900) == 0, (tmp_path / "ref.log").read_text()[-2000:]
    reference = _losses(runs / "ref")

    # two processes started by hand, process 1 killed: process 0 stops within trainer.peer_timeout_s with one
    # line and exit 75. Either its peer watch prints the line, or (2 runs in 10 here) gloo's transport thread
    # first receives a message of a size it did not expect and aborts the process: then its supervisor
    # (`python -m recipes` with --coordinator runs the recipe as its child) prints it (docs/reliability.md)
    from omnijax.train.supervisor import free_port

    port = free_port()
    procs = [_recipes([*common, "trainer.run_name=pair", "trainer.peer_timeout_s=5", "--coordinator",
                       f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], tmp_path / f"p{i}.log",
                      env=env)
             for i in range(2)]
    _wait_for_checkpoint(runs / "pair", 8, procs, [tmp_path / "p0.log", tmp_path / "p1.log"])
    procs[1].send_signal(signal.SIGKILL)
    rc = procs[0].wait(300)
    err = (tmp_path / "p0.log").read_text()
    native = (runs / "pair" / "native_stderr.p0.log").read_text()
    last = [l for l in err.splitlines() if l.strip()][-1]
    assert rc == 75, err[-2000:] + native[-2000:]
    assert ("process 1 of 2 stopped answering" in last or "because a peer process was lost (gloo aborted it" in last)
    assert "Last checkpoint: step " in last and "same command" in last
    assert "Traceback" not in err and "Check failure" not in err and "terminate called" not in err
    procs[1].wait()

    # the same under the launcher: the group restarts from the last checkpoint and ends as if undisturbed
    launcher = _recipes(["launch", "--processes", "2", "--cpu-devices-per-process", "4", "--max-restarts", "1",
                         *common, "trainer.run_name=launched"], tmp_path / "launch.log", env={"OMNIJAX_RUNS": str(runs)})
    _wait_for_checkpoint(runs / "launched", 4, [launcher], [tmp_path / "launch.log"])
    from recipes.bench.faults import _descendants  # the process tree under the launcher

    group = _descendants(launcher.pid)
    for pid, _ in group:  # freeze the group mid-run, then kill process 1 and let process 0 go on
        os.kill(pid, signal.SIGSTOP)
    victim = [pid for pid, args in group if "--process-id 1" in args]
    assert victim, (group, (tmp_path / "launch.log").read_text()[-3000:])
    os.kill(victim[-1], signal.SIGKILL)
    for pid, _ in group:
        os.kill(pid, signal.SIGCONT)
    rc = launcher.wait(900)
    err = (tmp_path / "launch.log").read_text()
    assert rc == 0, err[-3000:] + "".join(f"\n--- {p}:\n{p.read_text()[-3000:]}"
                                         for p in sorted((runs / "launched").glob("native_stderr.p*.log")))
    assert "launch: restart 1 of 1: process 1 was killed by SIGKILL" in err
    got = _losses(runs / "launched")
    assert sorted(got) == list(range(1, steps + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [reference[s] for s in sorted(got)], rtol=0, atol=1e-5)


GLOO_ABORT = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= "
              "op.nbytes. 512 vs 16. Received data size doesn't match expected size. Is there a distributed "
              "collective mismatch in your code?\n")


def test_a_supervisor_names_what_a_signal_ended(tmp_path):
    """`python -m recipes NAME --coordinator ...` runs the recipe as its child: a child that gloo aborts
    (the text CI's survivor left in its native log) ends in the peer-lost line and exit 75; any other
    death by signal is named, with the end of the native log, and passed on."""
    from omnijax.train.supervisor import describe_death, process_of, wants_supervisor

    runs = tmp_path / "runs"
    (runs / "pair" / "checkpoints" / "8").mkdir(parents=True)
    native = runs / "pair" / "native_stderr.p0.log"
    argv = ["tiny_lm", "trainer.run_name=pair", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
            "--process-id", "0"]

    def supervised(child: str) -> subprocess.CompletedProcess:  # in a process of its own, as users run it
        code = (f"import sys; from recipes.launch import supervise; "
                f"sys.exit(supervise({argv!r}, command=[sys.executable, '-c', {child!r}]))")
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO), OMNIJAX_RUNS=str(runs)))

    aborted = supervised(f"import os, pathlib, resource; pathlib.Path({str(native)!r}).write_text({GLOO_ABORT!r}); "
                         "resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); os.abort()")  # (no core file)
    line = aborted.stderr.strip().splitlines()[-1]
    assert aborted.returncode == 75, aborted.stderr
    assert line.startswith("error: process 0 of 2 stopped: its collectives broke because a peer process was lost")
    assert "512 vs 16. Received data size" in line and "enforce fail" not in line and "mismatch in your code" not in line
    assert f"Last checkpoint: step 8 in {runs / 'pair' / 'checkpoints'}" in line and "same command" in line
    assert supervised("import sys; sys.exit(3)").returncode == 3  # exit codes pass through
    killed = supervised("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -int(signal.SIGKILL) and "was killed by SIGKILL" in killed.stderr  # and dies so
    native.write_text("E0000 some unrelated native error\n")
    line, code = describe_death(-int(signal.SIGKILL), "1 of 2", native, "step 8 in x")
    assert code == -int(signal.SIGKILL) and "killed by SIGKILL (the kernel's out-of-memory killer" in line
    assert "some unrelated native error" in line
    assert describe_death(-int(signal.SIGABRT), "0 of 2", native, "x")[1] == -int(signal.SIGABRT)  # not gloo's
    assert wants_supervisor(argv, {}) and wants_supervisor(["tiny_lm"], {"SLURM_NTASKS": "4", "SLURM_PROCID": "1"})
    assert process_of(argv, {"SLURM_PROCID": "3"}) == ("0", "2")                          # the flags first
    assert wants_supervisor(["--process-id=1", "--coordinator", "h:1", "tiny_lm"], {})  # flags before the recipe
    assert not wants_supervisor(["tiny_lm", "--coordinator"], {})  # no value: the recipe process says so
    assert process_of(["tiny_lm"], {"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}) == ("1", "4")  # else the cluster's
    assert process_of(["tiny_lm"], {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8"}) == ("2", "8")
    assert not wants_supervisor(argv, {"OMNIJAX_SUPERVISED": "1"})  # the child itself, or under launch
    assert not wants_supervisor(["tiny_lm", "trainer.steps=3"], {}) and not wants_supervisor(["launch", *argv], {})


def test_the_command_line_launcher_and_supervisor_start_without_jax():
    """They import omnijax (errors, the exit codes, the allocator choice) but must not pay for jax: a
    supervisor or launcher holding jax would cost every process of a job its import time and memory."""
    code = ("import sys, recipes.__main__, recipes.launch, omnijax.allocator; "
            "assert not {'jax', 'flax'} & set(sys.modules), sorted(m for m in sys.modules if m.startswith(('jax', 'flax')))")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True)


# ----------------------------------------------------------------- a changed config is not damage (issue 46)
def _snapshot(root: Path) -> dict:
    """Every file under `root` with its size and modification time: what "nothing was moved" compares."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_checkpoint_of_another_model_is_one_line_and_nothing_moves(tmp_path):
    from omnijax.train.checkpoint import CheckpointMismatch

    ck = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2):
        ck.save(step, _tree(float(step)), {"step": step})
    ck.wait()
    (tmp_path / "config.json").write_text(json.dumps({"model": {"width": 256, "bias": 16}, "trainer": {"steps": 2}}))
    before = _snapshot(tmp_path)
    wider = {"w": jnp.zeros((256, 128)), "b": jnp.zeros((16,)), "extra": jnp.zeros((3,), jnp.bfloat16)}
    with pytest.raises(CheckpointMismatch) as err:
        ck.restore_good(wider, config={"model": {"width": 128, "bias": 16}, "trainer": {"steps": 9}})
    line = str(err.value)
    assert "\n" not in line and "damaged" not in line and "Nothing was moved" in line
    assert "checkpoint step 2 in" in line                                     # the newest, not tried step by step
    assert "extra: saved absent -> configured [3] bfloat16" in line
    assert "w: saved [256, 256] float32 -> configured [256, 128] float32" in line
    assert "model.width: 256 -> 128" in line and "trainer.steps" not in line  # a run length is not a model change
    with pytest.raises(CheckpointMismatch, match=r"b: saved \[16\] float32 -> configured \[16\] bfloat16"):
        ck.restore_good({**_tree(0.0), "b": jnp.zeros((16,), jnp.bfloat16)})  # a dtype alone differs
    assert _snapshot(tmp_path) == before and not (tmp_path / "checkpoints_set_aside").exists()
    state, _, step = ck.restore_good(_tree(0.0))                              # the right model still resumes
    assert step == 2 and float(state["b"][0]) == 2.0
    ck.close()


def test_a_resume_with_a_changed_model_stops_in_one_line_and_moves_nothing(tmp_path):
    """The trainer's own path (issue 46's report: model.num_layers changed on resume called both intact
    checkpoints damaged and set them aside): one line naming the new layer and the key, every file in place."""
    from omnijax.train.checkpoint import CheckpointMismatch
    from test_runtime import _trainer  # the suite's tiny trainer

    _trainer(tmp_path, 2, ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=5"]).fit()
    before = _snapshot(tmp_path)
    changed = _trainer(tmp_path, 4, ["trainer.checkpoint_every=1", "model.num_layers=3"])
    with pytest.raises(CheckpointMismatch) as err:
        changed.fit()
    line = str(err.value)
    assert "\n" not in line and "damaged" not in line
    assert "params.blocks.2." in line and "saved absent -> configured [" in line
    assert "model.num_layers: 2 -> 3" in line
    changed.checkpointer.close()
    assert _snapshot(tmp_path) == before and not list(tmp_path.glob("checkpoints_*"))


def test_an_io_error_on_restore_is_retried_then_named_and_nothing_moves(tmp_path, monkeypatch):
    import errno

    from omnijax.train import checkpoint
    from omnijax.train.checkpoint import CheckpointReadError

    waits = []
    monkeypatch.setattr(checkpoint, "_sleep", waits.append)
    ck = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2):
        ck.save(step, _tree(float(step)), {"step": step})
    ck.wait()
    before = _snapshot(tmp_path)
    real, failures = ck._manager.restore, []
    victim = str(_files(tmp_path / "checkpoints" / "2")[-1])

    def flaky(step, args=None):  # the read fails like a flaky mount: EIO on the largest file, `left` more times
        if failures:
            failures.pop()
            raise OSError(errno.EIO, os.strerror(errno.EIO), victim)
        return real(step, args=args)

    monkeypatch.setattr(ck._manager, "restore", flaky)
    failures.extend([1, 1])  # two failures, then it reads
    lines = []
    state, _, step = ck.restore_good(_tree(0.0), log=lines.append)
    assert step == 2 and float(state["b"][0]) == 2.0 and waits == list(checkpoint.READ_RETRY_S)
    assert len(lines) == 2 and all("retrying" in l and victim in l for l in lines)
    failures.extend([1] * 10)  # it keeps failing: one line naming the file, no step set aside
    with pytest.raises(CheckpointReadError) as err:
        ck.restore_good(_tree(0.0), log=lines.append)
    assert victim in str(err.value) and "Input/output error" in str(err.value) and "\n" not in str(err.value)
    assert "damaged" not in str(err.value)
    # the same while the checksums are read
    monkeypatch.setattr(ck._manager, "restore", real)
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(CheckpointReadError, match="Input/output error"):
        ck.restore_good(_tree(0.0), log=lines.append)
    assert _snapshot(tmp_path) == before and not (tmp_path / "checkpoints_set_aside").exists()
    ck.close()


def test_readers_of_a_run_take_its_newest_good_checkpoint_and_say_so(tmp_path, capsys):
    """init.checkpoint, export and generate read a run folder through warmstart.params_from_run: a damaged
    newest step is skipped with one line naming it and the step read, and left where it is."""
    from omnijax.train import warmstart

    run = tmp_path / "stage1"
    ck = Checkpointer(run / "checkpoints", keep=5)
    for step in (1, 2, 3):
        ck.save(step, {"params": _tree(float(step))}, {"step": step})
    ck.close()
    big = _files(run / "checkpoints" / "3")[-1]
    with open(big, "r+b") as f:
        f.seek(big.stat().st_size // 2)
        f.write(b"\x00\xff" * 64)
    before = _snapshot(run)
    params, step = warmstart.params_from_run(run, _tree(0.0))
    assert step == 2 and float(params["b"][0]) == 2.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "init.checkpoint=" in err[0] and "step 3" in err[0] and "reading step 2" in err[0]
    assert _snapshot(run) == before


# ------------------------------------------------------------ what launch restarts (issue 46: exit codes)
_ATTEMPT = """
import json, os, sys
from pathlib import Path
run, codes, i = Path(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3])
n = len(list(run.glob("attempt.*"))) if i == 0 else 0
if i == 0:
    (run / f"attempt.{n}").write_text("")
    with open(run / "metrics.jsonl", "a") as f:   # where the attempt got to: step 12 each time unless it resumes
        f.write(json.dumps({"step": 12 + (n if codes[min(n, len(codes) - 1)] == -1 else 0)}) + "\\n")
code = codes[min(n, len(codes) - 1)] if i == 0 else 0
sys.exit(1 if code == -1 else code)
"""


def _launch(tmp_path: Path, codes: str, max_restarts: int = 5) -> tuple[int, int, str]:
    """recipes.launch.run_local over a stand-in recipe whose process 0 exits codes[attempt] (-1: exit 1 at a
    new step each attempt); returns (launch's code, attempts, its stderr)."""
    import argparse

    run = tmp_path / codes.replace(",", "_")
    run.mkdir()
    args = argparse.Namespace(processes=2, cpu_devices_per_process=0, max_restarts=max_restarts, recipe="x",
                              overrides=[f"trainer.run_name={run.name}"])
    # in a process of its own (run_local takes over SIGTERM/SIGINT), as `python -m recipes launch` runs it
    out = subprocess.run([sys.executable, "-c", "import sys, argparse\nfrom recipes import launch\n"
                          f"cmd = lambda i, port: [sys.executable, '-c', {_ATTEMPT!r}, {str(run)!r}, {codes!r}, str(i)]\n"
                          f"sys.exit(launch.run_local(argparse.Namespace(**{vars(args)!r}), command=cmd))"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO), OMNIJAX_RUNS=str(tmp_path)))
    return out.returncode, len(list(run.glob("attempt.*"))), out.stderr


def test_launch_restarts_a_preemption_but_not_a_divergence_or_the_same_crash_twice(tmp_path):
    from omnijax.train.distributed import EXIT_DIVERGED, EXIT_PREEMPTED
    from omnijax.train.supervisor import same_failure

    rc, attempts, err = _launch(tmp_path, f"{EXIT_PREEMPTED},0")             # preempted (saved): restarted
    assert (rc, attempts) == (0, 2) and f"process 0 was preempted: it saved and stopped (exit {EXIT_PREEMPTED})" in err
    rc, attempts, err = _launch(tmp_path, f"{EXIT_DIVERGED}")                # diverged: a rerun diverges again
    assert (rc, attempts) == (EXIT_DIVERGED, 1) and "the run diverged" in err and "not restarting" in err
    rc, attempts, err = _launch(tmp_path, "1")                               # exit 1 after step 12, twice: stop
    assert (rc, attempts) == (1, 2) and "again after step 12 as in the attempt before" in err
    rc, attempts, err = _launch(tmp_path, "-1,-1,0")                         # a crash that moves on: restarted
    assert (rc, attempts) == (0, 3)
    assert not same_failure((0, EXIT_PREEMPTED, 12), (0, EXIT_PREEMPTED, 12)) and not same_failure(None, (0, 1, 3))
    assert same_failure((1, 1, 12), (0, 1, 12))  # whichever process launch saw fail first
    assert not same_failure((0, 1, 12), (0, 75, 12)) and not same_failure((0, 1, 12), (0, 1, 13))


def test_slurm_requeue_does_not_depend_on_task_0(tmp_path):
    """Task 1 (task 0 may be the one that died) fails restartably: it asks Slurm to requeue the job itself."""
    import argparse

    from omnijax.train.distributed import EXIT_PEER_LOST
    from recipes.launch import run_slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    scontrol.chmod(0o755)
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURM_RESTART_COUNT": "0",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    args = argparse.Namespace(recipe="x", overrides=[], max_restarts=2)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert run_slurm(args, [sys.executable, "-c", f"raise SystemExit({EXIT_PEER_LOST})"]) == EXIT_PEER_LOST
        assert run_slurm(args, [sys.executable, "-c", "raise SystemExit(2)"]) == 2       # a user error: no requeue
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert (tmp_path / "calls").read_text().splitlines() == ["requeue 4242"]


def test_the_peer_watch_judges_beats_by_its_clock():
    """PeerWatch's judgement with an injected clock and coordination client: no wall time, no load."""
    from omnijax.train.distributed import PeerWatch

    class Client:
        def __init__(self):
            self.kv = {}

        def key_value_set(self, key, value, allow_overwrite=False):
            self.kv[key] = value

        def key_value_try_get(self, key):
            return self.kv[key]

    client, now, reports = Client(), [100.0], []
    watch = PeerWatch(5, lambda: "step 4 in runs/x/checkpoints", client=client, me=0, n=2, clock=lambda: now[0])
    watch._report = lambda j, why: reports.append((j, why))
    client.kv["omnijax_beat/1"] = "1"
    watch.beat_round()
    now[0] = 1000.0
    watch.beat_round()                                  # not armed (no trainer yet): a silent peer is not judged
    assert reports == [] and client.kv["omnijax_beat/0"] == "2"
    watch.arm(5, lambda: "x")                           # judged from now on
    now[0] = 1004.0
    client.kv["omnijax_beat/1"] = "2"
    watch.beat_round()                                  # it beat: seen at 1004
    now[0] = 1009.0
    watch.beat_round()
    watch.check_coordinator()
    assert reports == []                                # 5 s without a beat: exactly the limit, not past it
    now[0] = 1009.5
    watch.beat_round()
    assert reports == [(1, "sent no heartbeat for 6 s")]
    watch._last_round = 1009.5
    now[0] = 1014.6
    watch.check_coordinator()                           # no round of beats completed for 5.1 s
    assert reports[-1] == (0, "(the coordinator) did not answer for 5 s")
    watch.disarm()
    now[0] = 5000.0
    watch.beat_round()
    watch.check_coordinator()
    assert len(reports) == 2
