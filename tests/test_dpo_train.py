"""DPO end to end at tiny size: `recipes dpo` (LoRA, the reference precomputed once) on one converted pair, so
every step trains the same batch: the loss starts at ln 2 (policy = reference) and falls, rewards, margin and
accuracy are logged, and the pair's two answers sit on one device."""
import json
import math

import jax
import numpy as np
import pytest

from omnijax.errors import ConfigError

DPO_KEYS = ("dpo_reward_chosen", "dpo_reward_rejected", "dpo_reward_margin", "dpo_accuracy", "dpo_pairs")
ARGS = ["data.seq_len=64", "data.batch_size=8", "trainer.steps=4", "trainer.log_every=1", "trainer.lora.rank=8",
        "dpo.reference=precompute", "optimizer.lr=3e-2", "optimizer.warmup_steps=0", "dpo.beta=0.5",
        "trainer.progress=false", "trainer.run_name=dpo_t"]


@pytest.fixture(scope="module")
def one_pair(tmp_path_factory):
    """Shards holding one pair (a second record without a rejected answer is skipped by convert)."""
    from recipes import convert
    d = tmp_path_factory.mktemp("dpo")
    recs = [{"text": "3+4=", "chosen": "7", "rejected": "8"}, {"text": "1+1=", "chosen": "2"}]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert convert.main([f"input={d / 'pairs.jsonl'}", f"output={d / 'shards'}"]) == 0
    return d / "shards"


def test_dpo_recipe_on_a_fixed_pair(one_pair, tmp_path, monkeypatch):
    from omnijax.train import multimodal
    from omnijax.train.placement import DataParallel
    from recipes import dpo

    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path))
    common = [f"data.sources=[{one_pair}]"]
    for bad, why in ((["dpo.reference=adapters", "trainer.lora.rank=0"], "trainer.lora.rank > 0"),
                     (["trainer.grad_accum=2", "parallel.llm=fsdp2"], "per step, not per microbatch"),
                     (["trainer.staleness=stale1"], "staleness=sync"),
                     (["dpo.beta=0"], "beta must be > 0"), (["dpo.reference=frozen"], "adapters .* or precompute")):
        with pytest.raises(ConfigError, match=why):
            dpo.load(common + bad)
    batch = next(multimodal.train_loader(dpo.load(common + ARGS)))
    assert batch["pref_index"].max() >= 2 and jax.device_count() == 8
    for shard in DataParallel().put_batch(batch)["pref_index"].addressable_shards:  # a pair's answers: one device
        for row in np.asarray(shard.data):
            slots = set(row[row > 0].tolist())
            assert all((s + 1 if s % 2 else s - 1) in slots for s in slots)
    assert dpo.main(common + ARGS) == 0
    rows = [json.loads(line) for line in (tmp_path / "dpo_t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert all(np.isfinite(r[k]) for k in DPO_KEYS) and r["dpo_pairs"] == rows[0]["dpo_pairs"] > 0
        assert abs(r["dpo_reward_margin"] - (r["dpo_reward_chosen"] - r["dpo_reward_rejected"])) < 1e-5
    # step 1 trains the initial weights (adapters at zero), which are the reference: every reward 0, the loss ln 2
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-5 and abs(rows[0]["dpo_reward_margin"]) < 1e-6
    assert rows[-1]["loss"] < rows[0]["loss"] - 1e-3 and rows[-1]["dpo_reward_margin"] > 0  # the same batch each step
    assert (tmp_path / "dpo_t" / "tb").is_dir()
    report = json.loads((tmp_path / "dpo_t" / "eval.json").read_text())
    assert report["reference"] == "precompute" and report["data"]["skipped_bad_records"] == 0


@pytest.fixture(scope="module")
def arithmetic_pairs(tmp_path_factory):
    """18 distinct pairs: a different batch each step, so a misplaced row or pair shows in the losses."""
    from recipes import convert
    d = tmp_path_factory.mktemp("dpo18")
    recs = [{"text": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(1, 7)
            for b in range(2, 5)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert convert.main([f"input={d / 'pairs.jsonl'}", f"output={d / 'shards'}"]) == 0
    return d / "shards"


@pytest.mark.slow
def test_dpo_recipe_on_the_joint_step_and_with_grad_accum(arithmetic_pairs, tmp_path, monkeypatch):
    """`recipes dpo` on the joint step (fsdp2 x dp2 x tp2, encoders edp4 x esp2) with either reference, and plain
    data parallelism with trainer.grad_accum=2, give plain data parallelism's losses, gradient norms and DPO
    metrics at every step (the joint step's prefetcher reads a data-plane window ahead: the precomputed table
    covers it)."""
    from recipes import dpo

    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path))
    base = [f"data.sources=[{arithmetic_pairs}]", "data.seq_len=64", "data.batch_size=8", "trainer.steps=3",
            "trainer.log_every=1", "trainer.lora.rank=8", "optimizer.lr=1e-2", "optimizer.warmup_steps=0",
            "dpo.beta=0.5", "trainer.progress=false", "trainer.checkpoint_every=0"]
    joint = ["parallel.llm=fsdp2xdp2xtp2", "parallel.encoder=edp4xesp2"]
    runs = {"plain": [], "joint": joint, "joint_pre": joint + ["dpo.reference=precompute"],
            "accum2": ["trainer.grad_accum=2"]}
    got = {}
    for name, extra in runs.items():
        assert dpo.main(base + extra + [f"trainer.run_name={name}"]) == 0
        got[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    ref = got.pop("plain")
    assert len({r["loss"] for r in ref}) == 3 and ref[0]["dpo_pairs"] > 0
    for name, rows in got.items():
        assert [r["step"] for r in rows] == [1, 2, 3]
        for a, b in zip(ref, rows):
            for k in ("loss", "grad_norm", *DPO_KEYS):
                if k == "dpo_accuracy" and a["step"] == 1:  # step 1: policy = reference, rewards 0 up to rounding
                    continue
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (name, k, a["step"], a[k], b[k])
