"""Two real processes (jax.distributed on 127.0.0.1, gloo): `python -m recipes export` on every process of the job
writes the folder one process writes, byte for byte; and the compilation-cache guard really keeps a
two-process job's programs out of the cache where it is on."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optax
import pytest
from flax import nnx

from omnijax.config import from_dict
from omnijax.mm_config import MMConfig
from omnijax.train.supervisor import free_port

ROOT = Path(__file__).resolve().parents[1]
MM = {"llm": {"vocab_size": 256, "embed_dim": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16,
              "mlp_dim": 64, "max_seq_len": 64},
      "encoders": {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 16,
                              "embed_dim": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64},
                   "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 32, "num_layers": 1,
                             "num_heads": 2, "mlp_dim": 64}}}


def _env(**extra) -> dict:
    """The suite's environment less its 8-device flag (each process sets its own devices)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), **extra}


def _pair(argv: list[str], env: dict, timeout: float = 600) -> list[str]:
    """`argv` as processes 0 and 1 of one job; both must exit 0; their outputs."""
    port = free_port()
    procs = [subprocess.Popen([*argv, f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_export_runs_on_every_process_and_writes_what_one_process_writes(tmp_path):
    from omnijax.models.mllm import MultimodalModel
    from omnijax.train.checkpoint import Checkpointer
    from omnijax.train.state import init_state
    from recipes.__main__ import main

    cfg = from_dict(MMConfig, MM)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg), "tokenizer": {"path": ""}}))
    ck = Checkpointer(run / "checkpoints", async_save=False)
    params = nnx.state(MultimodalModel(cfg, rngs=nnx.Rngs(3)), nnx.Param)
    ck.save(4, init_state(params, optax.adam(1e-3)), {"step": 4})
    ck.close()

    assert main(["export", str(run), f"output={tmp_path / 'one'}"]) == 0   # one process, 8 devices
    outs = _pair([sys.executable, "-m", "recipes", "export", str(run), f"output={tmp_path / 'two'}",
                  "parallel.cpu_devices=4"], _env())
    for i, out in enumerate(outs):  # one job of 2 processes x 4 devices, not two independent exports
        assert re.search(rf"process {i} of 2, 4 of 8 devices", out), out[-2000:]
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two) and "llm/model.safetensors" in one and "projector.safetensors" in one
    assert [k for k in one if one[k] != two[k]] == []
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temporary folder left behind


_CACHE_PROBE = """
import os, sys
import omnijax.train.distributed as launch
from jaxlib import version
if sys.argv[1] == "guarded":  # the guard as it acts where the installed jaxlib is one that hangs
    launch.CACHE_HANGS_GLOO = frozenset({version.__version__})
os.environ.update(launch.launch_flags(sys.argv[2:])[0])
launch.maybe_initialize_distributed()
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
x = multihost_utils.process_allgather(jax.jit(lambda a: jnp.sin(a) * 3)(jnp.arange(8.0)))
print("sum", float(x.sum()), flush=True)
"""


@pytest.mark.slow
def test_the_cache_guard_keeps_a_two_process_job_out_of_the_cache(tmp_path):
    """A 2-process CPU job where the guard applies compiles without the persistent cache (its folder stays
    empty); the same job with the guard not applying fills it, so the folder is a fair witness."""
    for mode in ("guarded", "plain"):
        cache = tmp_path / mode
        cache.mkdir()
        outs = _pair([sys.executable, "-c", _CACHE_PROBE, mode],
                     _env(JAX_COMPILATION_CACHE_DIR=str(cache), XLA_FLAGS="--xla_force_host_platform_device_count=2"))
        entries = [p for p in cache.rglob("*") if p.is_file()]
        if mode == "guarded":
            assert entries == [], entries
            assert "persistent compilation cache is off" in outs[0]
        else:
            assert entries and "cache is off" not in outs[0]
        assert all("sum" in o for o in outs)
