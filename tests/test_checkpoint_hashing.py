"""Save-time hashing (docs/reliability.md): each process of a multi-process save hashes only the files it wrote,
after the commit, and the parts merge into one listing that covers every file of the step exactly once."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omnijax.errors import UserError
from omnijax.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]

# one process of a pair: saves step 1 of a sharded state and records every file its own _sha256 read
_SAVE = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
jax.config.update("jax_platforms", "cpu")
pid, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from omnijax.train import checkpoint as ckpt
hashed = []
real = ckpt._sha256
ckpt._sha256 = lambda p: (hashed.append(str(p)), real(p))[1]
sh = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
state = {k: jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + i, sh) for i, k in enumerate("ab")}
ck = ckpt.Checkpointer(folder, keep=2)
ck.save(1, state, {"pos": 1})
ck.close()
json.dump({"hashed": hashed, "checksum_s": ck.checksum_s}, open(f"{folder}.p{pid}.json", "w"))
"""


def _save_with_two_processes(folder: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _SAVE, str(i), str(port), str(folder)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return [json.loads(Path(f"{folder}.p{i}.json").read_text()) for i in range(2)]


def _step_files(step: Path) -> set[str]:
    return {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()
            and p.relative_to(step).as_posix() not in ckpt._MUTABLE}


def test_two_processes_hash_only_their_own_files_and_the_listing_covers_the_step_once(tmp_path):
    runs = _save_with_two_processes(tmp_path / "ck")
    step = tmp_path / "ck" / "1"
    listing = json.loads((step / ckpt.CHECKSUMS).read_text())
    files = _step_files(step)
    assert not list(step.glob("omnijax_checksums.*of*")) and not (step / ckpt._MERGING).exists()
    assert set(listing["files"]) == files                                  # every file of the step ...
    by = listing["hashed_by"]
    assert sorted(by["0"] + by["1"]) == sorted(files)                      # ... exactly once
    for i, run in enumerate(runs):
        read = sorted(Path(p).relative_to(step).as_posix() for p in run["hashed"])
        assert read == sorted(by[str(i)]), f"process {i} read other files than its part lists"
        assert read and all(ckpt.writer_of(rel) == i for rel in read)     # only what it wrote
        assert len(run["checksum_s"]) == 1
    assert any("ocdbt.process_1/" in rel for rel in by["1"])               # process 1 hashed its data files
    assert ckpt.verify_tree(step) is None

    # a corrupted byte in process 1's data is still detected, from the merged listing and from the parts
    victim = step / next(rel for rel in by["1"] if "ocdbt.process_1/d/" in rel)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert "checksum mismatch" in ckpt.verify_tree(step)
    (step / ckpt.CHECKSUMS).unlink()
    for i in range(2):
        part = {"format": 1, "process": i, "processes": 2,
                "files": {rel: listing["files"][rel] for rel in by[str(i)]}}
        (step / f"omnijax_checksums.part{i}of2.json").write_text(json.dumps(part))
    assert ckpt.has_listing(step) and "checksum mismatch" in ckpt.verify_tree(step)
    with pytest.raises(UserError, match="every checkpoint .* is damaged"):  # readers of another run, too
        ckpt.newest_good_step(tmp_path / "ck", [1], "init.checkpoint")

    # a missing part makes the step unchecked, never good
    (step / "omnijax_checksums.part1of2.json").unlink()
    assert not ckpt.has_listing(step)
    problem = ckpt.verify_tree(step)
    assert problem is not None and "parts of processes [0] of 2" in problem
    assert not ckpt.merge_into_listing(step) and not (step / ckpt.CHECKSUMS).exists()


def test_one_process_merges_its_own_part(tmp_path):
    import jax.numpy as jnp

    ck = ckpt.Checkpointer(tmp_path / "ck", keep=2)
    ck.save(1, {"w": jnp.ones((4, 4))}, {"pos": 1})
    ck.close()
    step = tmp_path / "ck" / "1"
    assert ck.has_checksums(1) and ck.verify(1) is None and len(ck.checksum_s) == 1
    assert set(json.loads((step / ckpt.CHECKSUMS).read_text())["hashed_by"]) == {"0"}
    assert not list(step.glob("omnijax_checksums.part*"))


def test_a_cpu_save_of_replicated_arrays_compiles_nothing_and_restores_them(tmp_path):
    """orbax's replica-parallel save has each replica write a slice, one jitted program per device and shape
    (86 compiles for this state's two saves, ~1.6 CPU-s); on CPU the first replica writes it all. Whatever
    the save does, the restore onto the same shardings gives back every value."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    shardings = [NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("data"))]
    state = {f"w{i}": jax.device_put(np.arange(64 * (64 + 8 * i), dtype=np.float32).reshape(64, -1) + i,
                                     shardings[i % 3]) for i in range(6)}
    compiled = []
    listener = lambda name, *_, **__: compiled.append(name) if name.endswith("backend_compile_duration") else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        ck = ckpt.Checkpointer(tmp_path / "ck", keep=2)
        for step in (1, 2):
            ck.save(step, state, {"pos": step})
        ck.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == []
    restored, loader, step = ck.restore(ckpt.abstract_like(state))
    ck.close()
    assert step == 2 and loader == {"pos": 2}
    for k, v in state.items():
        assert restored[k].sharding == v.sharding and np.array_equal(np.asarray(restored[k]), np.asarray(v))
