"""`recipes dpo` on two real processes (jax.distributed over 127.0.0.1, gloo; 4 CPU devices each, as a user
launches two hosts): the joint step, each host reading its own rows and the reference precomputed per host
(`dpo.reference=precompute`), gives one device's DPO losses, gradient norms and metrics at every step."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnijax.train.supervisor import free_port

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["data.seq_len=64", "data.batch_size=8", "trainer.steps=3", "trainer.log_every=1", "trainer.lora.rank=8",
        "dpo.reference=precompute", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "dpo.beta=0.5",
        "trainer.progress=false", "trainer.checkpoint_every=0"]
KEYS = ("loss", "grad_norm", "dpo_reward_chosen", "dpo_reward_rejected", "dpo_accuracy", "dpo_pairs")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """18 distinct arithmetic pairs (a wrong row or pair on a host moves every step's figures)."""
    from recipes import convert
    d = tmp_path_factory.mktemp("dpo_mh")
    recs = [{"text": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(1, 7)
            for b in range(2, 5)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert convert.main([f"input={d / 'pairs.jsonl'}", f"output={d / 'shards'}"]) == 0
    return d / "shards"


def _env(runs: Path) -> dict:
    """The suite's environment less its 8-device flag: each run names its devices (parallel.cpu_devices)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    return {**os.environ, "OMNIJAX_RUNS": str(runs), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dpo_two_processes_match_one_device(pairs, tmp_path):
    args = [sys.executable, "-m", "recipes", "dpo", *ARGS, f"data.sources=[{pairs}]"]
    port = free_port()
    two = [subprocess.Popen(args + ["trainer.run_name=two", "parallel.cpu_devices=4", f"--coordinator=127.0.0.1:{port}",
                                    "--num-processes=2", f"--process-id={i}"], cwd=ROOT, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    one = subprocess.run(args + ["trainer.run_name=one", "parallel.cpu_devices=1"], cwd=ROOT, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    outs = [p.communicate(timeout=900)[0] for p in two]
    for i, (p, out) in enumerate(zip(two, outs)):
        assert p.returncode == 0, out[-3000:]
        assert f"process {i} of 2, 4 of 8 devices" in out, out[-2000:]  # one job of two processes
    ref, got = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in ref] == [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        for k in KEYS:
            if k == "dpo_accuracy" and a["step"] == 1:  # step 1: policy = reference, rewards 0 up to rounding
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a["step"], a[k], b[k])
    assert ref[0]["dpo_pairs"] > 0 and len({r["loss"] for r in ref}) == 3  # real pairs, a different batch each step
