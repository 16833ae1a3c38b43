"""Multi-host: which rows each host loads (pure, property-tested) and real two-process runs that must
match one process with the same 8 devices, as the user launches them (`--coordinator ...`)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from omnijax.parallel import hosts
from omnijax.parallel.mesh import MESH_AXES
from omnijax.train.supervisor import free_port

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- the pure row assignment
@st.composite
def layouts(draw, max_devices: int = 16):
    """(mesh shape over MESH_AXES, ordered batch axes, mesh-shaped device -> process map)."""
    shape = [1] * len(MESH_AXES)
    for i in draw(st.lists(st.integers(0, len(MESH_AXES) - 1), max_size=4)):
        if np.prod(shape) * 2 <= max_devices:
            shape[i] *= 2
    n = int(np.prod(shape))
    procs = draw(st.sampled_from([p for p in (1, 2, 4, 8) if n % p == 0]))
    owner = np.repeat(np.arange(procs), n // procs)
    owner = owner[draw(st.permutations(range(n)))]          # any device order, not contiguous per host
    axes = draw(st.permutations(MESH_AXES))[:draw(st.integers(0, 3))]
    return tuple(shape), tuple(axes), owner.reshape(shape)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(1, 3))
def test_host_rows_cover_the_batch_and_only_held_shards(layout, per):
    shape, axes, owner = layout
    shards = hosts.num_shards(MESH_AXES, shape, axes)
    g = shards * per
    grid = hosts.shard_grid(MESH_AXES, shape, axes)
    assert sorted(np.unique(grid)) == list(range(shards))
    rows = {p: hosts.host_rows(owner, MESH_AXES, axes, g, p) for p in np.unique(owner)}
    assert set(np.concatenate(list(rows.values())).tolist()) == set(range(g))     # every row loaded
    for p, r in rows.items():
        assert list(r) == sorted(set(r.tolist()))                                 # increasing, no repeats
        held = set(grid[owner == p].tolist())
        assert {int(x) // per for x in r} == held         # exactly the rows of shards its devices hold
    for p in rows:                                        # hosts sharing a shard load identical rows of it
        for q in rows:
            for s in set(grid[owner == p].tolist()) & set(grid[owner == q].tolist()):
                want = set(range(s * per, (s + 1) * per))
                assert want <= set(rows[p].tolist()) and want <= set(rows[q].tolist())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(MESH_AXES) - 1), min_size=3, max_size=3), st.permutations(MESH_AXES),
       st.integers(1, 4), st.permutations(range(8)))
def test_shard_numbering_matches_named_sharding(doubled, axis_order, k, perm):
    """The pure grid numbers shards as jax does, for any device order and batch-axis order (8 devices)."""
    shape = [1] * len(MESH_AXES)
    for i in doubled:
        shape[i] *= 2
    axes = tuple(axis_order[:k])
    devices = np.asarray(jax.devices(), dtype=object)[list(perm)].reshape(shape)
    sharding = NamedSharding(Mesh(devices, MESH_AXES), P(axes, None))
    per, n = 2, hosts.num_shards(MESH_AXES, shape, axes)
    index = sharding.devices_indices_map((n * per, 3))
    grid = hosts.shard_grid(MESH_AXES, shape, axes)
    for pos in np.ndindex(*shape):
        rows = index[devices[pos]][0]
        assert (rows.start or 0) == grid[pos] * per and (rows.stop or n * per) == (grid[pos] + 1) * per


def test_put_host_rows_places_every_block_and_rejects_missing_rows():
    devices = np.asarray(jax.devices(), dtype=object)[[5, 2, 7, 0, 1, 6, 3, 4]].reshape(1, 1, 2, 1, 2, 2)
    sharding = NamedSharding(Mesh(devices, MESH_AXES), P("fsdp", "cp"))
    full = np.arange(8 * 6).reshape(8, 6)
    rows = hosts.sharding_rows(sharding, 8)
    np.testing.assert_array_equal(rows, np.arange(8))
    arr = hosts.put_local(sharding, full)
    assert arr.shape == (8, 6) and arr.sharding == sharding
    np.testing.assert_array_equal(np.asarray(arr), full)
    with pytest.raises(Exception, match="was not given global batch rows"):
        hosts.put_host_rows(sharding, full[:4], np.arange(4), (8, 6))


# ---------------------------------------------------------------------------- real processes
def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _env(runs: Path) -> dict:
    """The suite's environment (compilation cache, XLA flags) less its 8-device flag: each run sets its devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    return {**os.environ, "OMNIJAX_RUNS": str(runs), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}


def _two_processes(recipe: str, args: list[str], runs: Path, name: str) -> list[subprocess.Popen]:
    """The command on two processes with 4 CPU devices each, as a user launches it on two hosts."""
    base = [sys.executable, "-m", "recipes", recipe, *args, f"trainer.run_name={name}", "parallel.cpu_devices=4"]
    port = free_port()
    return [subprocess.Popen(base + [f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"],
                             cwd=ROOT, env=_env(runs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def _wait_two(two: list[subprocess.Popen], timeout: float = 900) -> list[str]:
    outs = [p.communicate(timeout=timeout)[0] for p in two]
    for i, (p, out) in enumerate(zip(two, outs)):
        assert p.returncode == 0, out[-3000:]
        # each child saw one job of 2 processes x 4 devices, not an independent 4-device run
        assert re.search(rf"process {i} of 2, 4 of 8 devices", out), out[-2000:]
    return outs


def _one_device(recipe: str, args: list[str], runs: Path, name: str, timeout: float = 900) -> None:
    """The single-device reference: one process, one device, no layout."""
    one = subprocess.run([sys.executable, "-m", "recipes", recipe, *args, f"trainer.run_name={name}",
                          "parallel.cpu_devices=1"], cwd=ROOT, env=_env(runs), capture_output=True, text=True,
                         timeout=timeout)
    assert one.returncode == 0, one.stderr[-3000:]


def _assert_same(ref: list[dict], got: list[dict]) -> None:
    """Every step's loss and gradient norm equal the reference's to fp32 reduction-order noise (measured
    <= 6e-7 relative; a wrong row, shard or sample moves them by percents)."""
    assert [r["step"] for r in ref] == [r["step"] for r in got] and ref
    for a, b in zip(ref, got):
        for k in ("loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (k, a["step"], a[k], b[k])


TINY_LM = ["model.embed_dim=64", "model.num_layers=2", "model.head_dim=16", "model.mlp_dim=128", "data.seq_len=32",
           "data.batch_size=8", "data.eval_batches=1", "trainer.log_every=1", "trainer.progress=false",
           "optimizer.warmup_steps=2", "trainer.steps=4", "trainer.eval_every=0", "trainer.checkpoint_every=0"]


@pytest.mark.slow
def test_tiny_lm_two_processes_match_one_device(tmp_path):
    """Both host-row paths against one reference run (one test, so the reference runs once):
    pp2xfsdp2xtp2 (pp outermost: each host holds every batch shard of its stage and loads the whole batch)
    and fsdp4xtp2 (fsdp across hosts: each loads its half, the path plain data parallelism takes). Losses,
    gradient norms and the held-out loss match one device."""
    _one_device("tiny_lm", TINY_LM, tmp_path, "lm_ref")
    ref = tmp_path / "lm_ref"
    for layout in ("pp2xfsdp2xtp2", "fsdp4xtp2"):
        _wait_two(_two_processes("tiny_lm", TINY_LM + [f"parallel.llm={layout}"], tmp_path, f"lm_{layout}"))
        got = tmp_path / f"lm_{layout}"
        _assert_same(_metrics(ref), _metrics(got))
        ev = [json.loads((d / "eval.json").read_text())["metrics"]["eval_loss"] for d in (ref, got)]
        assert ev[1] == pytest.approx(ev[0], rel=1e-5), layout


TINY_OMNI = ["model.encoders.vision.num_layers=1", "model.encoders.audio.num_layers=1", "trainer.steps=2",
             "trainer.log_every=1", "trainer.progress=false", "trainer.checkpoint_every=0", "eval.items=0",
             "eval.ablation_items=0"]
OMNI_LAYOUT = ["parallel.microbatches=2", "parallel.llm=pp2xdp2xtp2", "parallel.encoder=edp4xesp2"]


def _host_rows(run_dir: Path, process: int) -> list[dict]:
    name = "metrics.jsonl" if process == 0 else f"host{process}.metrics.jsonl"
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


@pytest.mark.slow
def test_tiny_omni_two_processes_match_one_device(tmp_path):
    """The decentralized data path: every host plans its own planning groups from metadata, reads the token
    rows of its own devices and decodes only the media its devices encode, then places its own blocks; the
    multiplexer routes per host group (issue 47: on by default with several processes, capacities agreed
    through the coordination service). Two layouts: pp2 x dp2 x tp2 (a stage per process: one host group of
    both) and dp2 x fsdp2 x tp2 (a dp rank per process: two host groups, each placing and routing only its
    own rows' segments). Losses and gradient norms equal one device at every step (so the sample stream
    does not depend on the layout: the bug was 8 devices dropping samples with more than a device's share
    of the encoder rows), nothing is dropped; each host decodes at most 60% of the step's payload bytes
    (counted by the loader's lazy buffers), together at least all of them. In dp2 x fsdp2 x tp2 each host lays
    out only its own rows (`Loader(layout_local=True)`): the step's samples, model FLOPs and payload bytes are
    still the whole step's on both processes (from the exchanged step totals), equal to the one-device run's.
    The one-device run starts beside the first pair. (The slowest test: the multiplexed step compiles per
    capacity growth.)"""
    two = _two_processes("tiny_omni", TINY_OMNI + OMNI_LAYOUT, tmp_path, "omni_two")
    _one_device("tiny_omni", TINY_OMNI + ["parallel.llm=dp1", "parallel.encoder=edp1", "parallel.microbatches=1"],
                tmp_path, "omni_one", timeout=1800)
    outs = {"omni_two": _wait_two(two, timeout=1800)}
    outs["omni_groups"] = _wait_two(_two_processes("tiny_omni", TINY_OMNI + ["parallel.llm=dp2xfsdp2xtp2",
                                                                             "parallel.encoder=edp4xesp2"],
                                                   tmp_path, "omni_groups"), timeout=1800)
    # the per-host path is on: each process lays out only its own rows (every rank in pp2, half of them in dp2)
    said = {k: re.search(r"each of 2 processes lays out only its own rows \((\d+) of (\d+) dp ranks", o[0])
            for k, o in outs.items()}
    assert said["omni_two"] and said["omni_groups"], outs["omni_groups"][0][-2000:]
    assert int(said["omni_two"][1]) == int(said["omni_two"][2]) == 2 * int(said["omni_groups"][1])
    one = _metrics(tmp_path / "omni_one")
    for name in ("omni_two", "omni_groups"):
        two = _metrics(tmp_path / name)
        _assert_same(one, two)
        assert all(r["dropped_total"] == 0 for r in one + two)
        for r in one:  # one process holds every device: it decodes the whole step
            assert r["payload_bytes_decoded"] == r["payload_bytes_step"] > 0
        per_host = [_host_rows(tmp_path / name, p) for p in range(2)]
        for step, (a, b) in enumerate(zip(*per_host), start=1):
            total = one[step - 1]["payload_bytes_step"]
            assert a["payload_bytes_step"] == b["payload_bytes_step"] == total
            assert 0 < a["payload_bytes_decoded"] <= 0.6 * total and 0 < b["payload_bytes_decoded"] <= 0.6 * total, name
            assert a["payload_bytes_decoded"] + b["payload_bytes_decoded"] >= total
            for k in ("samples", "model_tflops"):  # the step's totals on every process, whatever it laid out
                assert a[k] == pytest.approx(one[step - 1][k], rel=1e-9) and b[k] == pytest.approx(a[k], rel=1e-9), (
                    name, k, one[step - 1][k], a[k], b[k])
            assert one[step - 1]["samples"] > 0 and one[step - 1]["model_tflops"] > 0


# ------------------------------------------------------------------- finishing together (issue 46, bug 1)
_LONGER = """
import os, sys, time
from pathlib import Path
from omnijax.train import distributed as launch
launch.SHUTDOWN_TIMEOUT_S = 5    # jax's shutdown barrier (300 s by default), lowered so the race shows in seconds
launch._BACKSTOP_S = 10          # jax's heartbeat limit = peer timeout + this: 15 s here, not 35 s
argv = launch.pop_launch_flags(sys.argv[1:])
extra, die = float(os.environ["EXTRA_WORK_S"]), os.environ.get("DIE_IN_EXTRA_WORK") == "1"
if not die:                      # a finished tiny_lm run
    from recipes.__main__ import main
    code = main(argv)
else:                            # no training: the job, its peer watch, native stderr in the run folder
    launch.maybe_initialize_distributed()
    launch.peer_watch().arm(3, lambda: "none", armed=False)
    import jax
    launch.redirect_native_stderr(launch.native_log(Path(os.environ["OMNIJAX_RUNS"]) / "lost", jax.process_index()))
    code = 0
import jax
if jax.process_index() == 0:     # process 0's lone work after the last step (an evaluation, an export)
    time.sleep(extra)
    if die:
        os._exit(1)
launch.exit_process(code)        # as python -m recipes ends
"""
_SUPERVISED = ("import sys; from recipes.launch import supervise; "
               "sys.exit(supervise(sys.argv[1:], command=[sys.executable, '-c', {script!r}, *sys.argv[1:]]))")


def _pair(args: list[str], runs: Path, log: Path, env: dict) -> list[subprocess.Popen]:
    """Two processes of `_LONGER`, each under the supervisor `python -m recipes --coordinator ...` puts above it."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-c", _SUPERVISED.format(script=_LONGER), *args,
                              f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"], cwd=ROOT,
                             env={**_env(runs), "PYTHONPATH": str(ROOT), **env},
                             stdout=subprocess.DEVNULL, stderr=open(f"{log}.p{i}", "w"))
            for i in range(2)]


@pytest.mark.slow
def test_a_finished_pair_exits_0_when_process_0_works_longer_than_every_timeout(tmp_path):
    """Bug 1 of issue 46: process 0 evaluated alone after the last step; process 1, done, entered jax's
    shutdown barrier, which failed ("Shutdown barrier has failed", SIGABRT) before process 0 came.
    Here process 0 of a finished tiny_lm pair works 30 s longer (a sleep: wall time, no CPU) against a
    shutdown barrier lowered to 5 s, a peer timeout of 5 s and jax's heartbeat limit lowered to 15 s (the
    300 s and 90 s of a real run scaled down; the work outlasts the longest twice over): without the agreed
    finishing point both abort within seconds (checked); with it both exit 0. Beside it, a pair whose process
    0 dies in its lone work: process 1 neither waits for ever nor dies unexplained, it ends with the peer-lost
    line and exit 75."""
    fast = {"OMNIJAX_PEER_TIMEOUT_S": "5", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    args = ["tiny_lm", *TINY_LM, "trainer.steps=2", "trainer.run_name=longer", "parallel.cpu_devices=2",
            "trainer.peer_timeout_s=5"]
    finished = _pair(args, tmp_path, tmp_path / "finished", {**fast, "EXTRA_WORK_S": "30"})
    lost = _pair(["tiny_lm", "trainer.run_name=lost"], tmp_path, tmp_path / "lost",
                 {**fast, "EXTRA_WORK_S": "10", "DIE_IN_EXTRA_WORK": "1"})
    codes = [p.wait(timeout=900) for p in finished]
    logs = [Path(f"{tmp_path / 'finished'}.p{i}").read_text() for i in range(2)]
    assert codes == [0, 0], (codes, logs[0][-2000:], logs[1][-2000:])
    assert (tmp_path / "longer" / "eval.json").exists()
    assert "Shutdown barrier" not in "".join(logs) + "".join(
        p.read_text() for p in (tmp_path / "longer").glob("native_stderr.p*.log"))
    assert [p.wait(timeout=300) for p in lost] == [1, 75]
    line = [l for l in Path(f"{tmp_path / 'lost'}.p1").read_text().splitlines() if l.strip()][-1]
    assert line.startswith("error: process 1 of 2 stopped: ") or line.startswith("error: process 0 of 2 stopped"), line
    assert "peer process was lost" in line or "stopped answering" in line, line


@pytest.mark.slow
def test_a_preempted_pair_stops_at_one_step_and_exits_143(tmp_path):
    """SIGTERM reaches only process 1 of a tiny_lm pair (a scheduler signals hosts at different moments):
    both processes stop after the same step, save it together, say so and exit 143 (preempted, not
    finished). Before the agreed step, process 1 stopped alone to save while process 0 went on into the
    next step's collectives: the pair hung."""
    import signal
    import time

    from omnijax.train.distributed import EXIT_PREEMPTED

    args = [*TINY_LM, "trainer.steps=400", "trainer.checkpoint_every=100", "trainer.hang_timeout_s=120"]
    two = _two_processes("tiny_lm", args, tmp_path, "preempted")
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in two), "the pair did not start stepping"
        time.sleep(0.2)
    two[1].send_signal(signal.SIGTERM)  # the supervisor `python -m recipes` passes it to the recipe process
    outs = [p.communicate(timeout=300)[0] for p in two]
    assert [p.returncode for p in two] == [EXIT_PREEMPTED] * 2, (outs[0][-2000:], outs[1][-2000:])
    saved = [re.search(r"preempted: saved step (\d+)", out) for out in outs]
    assert all(saved), outs
    step = int(saved[0].group(1))
    assert int(saved[1].group(1)) == step < 400
    assert (tmp_path / "preempted" / "checkpoints" / str(step) / "omnijax_checksums.json").exists()
