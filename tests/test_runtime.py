"""Runtime: preemption + exact resume, restore onto another mesh (two-process runs: test_multihost.py)."""
import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from omnijax.config import build
from omnijax.data import stdlib_text
from omnijax.models.llm import LLM
from omnijax.train.checkpoint import Checkpointer
from omnijax.train.loop import NonFiniteError, Trainer
from omnijax.models.losses import lm_loss
from omnijax.train.placement import DataParallel
from recipes.common import CONFIGS, IndexedLoader

TINY = ["model.embed_dim=64", "model.num_layers=2", "model.head_dim=16", "model.mlp_dim=128",
        "data.seq_len=32", "data.batch_size=8", "data.eval_batches=1", "trainer.log_every=1",
        "trainer.progress=false", "optimizer.warmup_steps=2"]


def _trainer(run_dir: Path, steps: int, extra=(), placement=None, hooks=()):
    cfg = build(yaml_path=CONFIGS / "tiny_lm.yaml", overrides=TINY + [f"trainer.steps={steps}", *extra])
    loader = IndexedLoader(stdlib_text.packed("train", cfg.data.seq_len, seed=0), cfg.data.batch_size)
    return Trainer(cfg, LLM(cfg.model, rngs=nnx.Rngs(0)), lm_loss, loader, placement=placement,
                   hooks=hooks, run_dir=run_dir)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    _trainer(run, 8).fit()
    return _losses(run)


def test_preemption_then_resume_reproduces_the_loss_curve(tmp_path, reference):
    def preempt_at_6(trainer, step, row):
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled between steps

    # SIGTERM arrives on a step that is also a periodic checkpoint (6): saved once, then stop
    first = _trainer(tmp_path, 8, ["trainer.checkpoint_every=3"], hooks=(preempt_at_6,)).fit()
    assert first.status == "preempted" and int(first.state.step) == 6
    ckpt = Checkpointer(tmp_path / "checkpoints")
    assert ckpt.latest_step() == 6 and 3 in ckpt.all_steps()
    ckpt.close()
    seen = []
    second = _trainer(tmp_path, 8, ["trainer.checkpoint_every=3"], hooks=(lambda t, step, row: seen.append(step),)).fit()
    assert second.status == "finished" and int(second.state.step) == 8
    assert seen[0] == 7  # it really resumed after step 6 (a restart from 0 would log step 1 first)
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):  # same topology: bit-identical losses
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])


def test_restore_onto_a_different_device_count(tmp_path):
    trainer = _trainer(tmp_path, 2, ["trainer.checkpoint_every=2"])
    trainer.fit()
    small = _trainer(tmp_path / "other", 2, placement=DataParallel(jax.devices()[:4]))
    ckpt = Checkpointer(tmp_path / "checkpoints")
    restored, loader_state, step = ckpt.restore(small.state)
    ckpt.close()
    assert step == 2 and loader_state == {"step": 2, "seed": 0}
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(trainer.state.params)):
        assert len(a.sharding.device_set) == 4
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nonfinite_guard_stops_with_a_clear_message(tmp_path):
    trainer = _trainer(tmp_path, 6, ["trainer.max_nonfinite_in_row=2", "optimizer.grad_clip=0"])
    trainer.state = trainer.state.replace(params=jax.tree.map(lambda p: p * np.nan, trainer.state.params))
    with pytest.raises(NonFiniteError, match="2 non-finite losses/gradients in a row"):
        trainer.fit()
