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
def reference_run(tmp_path_factory):
    """The undisturbed 8-step run (its last step is saved): its trainer and folder."""
    run = tmp_path_factory.mktemp("ref")
    trainer = _trainer(run, 8)
    trainer.fit()
    return trainer, run


@pytest.fixture(scope="module")
def reference(reference_run):
    return _losses(reference_run[1])


def test_preemption_then_resume_reproduces_the_loss_curve(tmp_path, reference):
    def preempt_at_6(trainer, step, row):
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled between steps

    # SIGTERM arrives on a step that is also a periodic checkpoint (6): saved once, then stop
    first = _trainer(tmp_path, 8, ["trainer.checkpoint_every=3"], hooks=(preempt_at_6,)).fit()
    assert first.status == "preempted" and int(first.state.step) == 6
    from omnijax.train.distributed import EXIT_PREEMPTED
    assert first.exit_code == EXIT_PREEMPTED != 0  # saved but not finished: a scheduler must not mark it done
    ckpt = Checkpointer(tmp_path / "checkpoints")
    assert ckpt.latest_step() == 6 and 3 in ckpt.all_steps()
    ckpt.close()
    seen = []
    second = _trainer(tmp_path, 8, ["trainer.checkpoint_every=3"], hooks=(lambda t, step, row: seen.append(step),)).fit()
    assert second.status == "finished" and int(second.state.step) == 8 and second.exit_code == 0
    assert seen[0] == 7  # it really resumed after step 6 (a restart from 0 would log step 1 first)
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):  # same topology: bit-identical losses
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])


def test_restore_onto_a_different_device_count(tmp_path, reference_run):
    """The reference run's last checkpoint (8 devices) restored into a 4-device trainer's state."""
    trainer, run = reference_run
    small = _trainer(tmp_path / "other", 8, placement=DataParallel(jax.devices()[:4]))
    ckpt = Checkpointer(run / "checkpoints")
    restored, loader_state, step = ckpt.restore(small.state)
    ckpt.close()
    assert step == 8 and loader_state == {"step": 8, "seed": 0}
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(trainer.state.params)):
        assert len(a.sharding.device_set) == 4
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nonfinite_guard_stops_with_a_clear_message(tmp_path):
    trainer = _trainer(tmp_path, 6, ["trainer.max_nonfinite_in_row=2", "optimizer.grad_clip=0"])
    trainer.state = trainer.state.replace(params=jax.tree.map(lambda p: p * np.nan, trainer.state.params))
    with pytest.raises(NonFiniteError, match="2 non-finite losses/gradients in a row"):
        trainer.fit()


def test_a_stuck_loop_is_stopped_with_its_stacks_and_one_line(tmp_path, monkeypatch, capfd):
    """Alive but stuck (here a hook that never returns, like a collective whose peer never comes): the hang
    watch writes every thread's stack and one line, then exits 124. The exit is replaced by one that records
    its code and lets the hook go, so the run finishes and the test sees what a user would. The watch judges
    by an injected clock that moves only when the hook is stuck: a slow step on a loaded machine cannot fire
    it, and it fires exactly once."""
    import threading

    from omnijax.train import watchdog

    blocked, released, codes, now = threading.Event(), threading.Event(), [], [0.0]

    def exit_(code):
        codes.append(code)
        released.set()

    def stuck_at_3(trainer, step, row):
        if step == 3:
            blocked.set()
            now[0] += 2.0  # 2 s pass on the watch's clock (trainer.hang_timeout_s=1) while no step finishes
            assert released.wait(60), "the hang watch never fired"

    monkeypatch.setattr(watchdog, "_exit", exit_)
    trainer = _trainer(tmp_path, 5, ["trainer.hang_timeout_s=1", "trainer.checkpoint_every=2"], hooks=(stuck_at_3,))
    trainer.clock = lambda: now[0]
    result = trainer.fit()
    assert result.status == "finished" and released.is_set() and codes == [124]
    err = capfd.readouterr().err
    line = [l for l in err.splitlines() if "no training step finished for" in l and "at step 3" in l][-1]
    assert "trainer.hang_timeout_s=1;" in line and "exit 124" in line and "Last checkpoint: " in line
    assert "in stuck_at_3" in err  # the stack names the frame it was stuck in


def test_the_hang_watch_judges_only_an_unpaused_loop_past_its_timeout():
    from omnijax.train.watchdog import HangWatch, overdue

    now = [100.0]
    watch = HangWatch(30.0, where=lambda: "step 4 in runs/x/checkpoints", clock=lambda: now[0], process=1)
    watch.beat(7)
    assert watch.check(129.0) is None and watch.check(130.0) is None    # exactly the timeout: not yet
    line = watch.check(131.5)
    assert line.strip().startswith("error: no training step finished for 32 s") and "process 1 stops" in line
    assert "the loop was at step 7" in line and "step 4 in runs/x/checkpoints" in line
    watch.pause(True)
    assert watch.check(1000.0) is None                                   # a mid-run evaluation
    now[0] = 1000.0
    watch.pause(False)                                                   # counts from the end of the pause
    assert watch.check(1029.0) is None and watch.check(1031.0) is not None
    assert not overdue(1e9, 0.0, 0.0)                                    # 0 turns it off
    with pytest.raises(Exception, match="hang_timeout_s=-1"):
        build(yaml_path=CONFIGS / "tiny_lm.yaml", overrides=TINY + ["trainer.hang_timeout_s=-1"])


def test_a_nan_gradient_streak_stops_naming_the_last_good_checkpoint(tmp_path):
    """NaN gradients from step 5 on (a poison value the loader adds to each batch, multiplied into the loss):
    updates 5, 6 are skipped, the run stops with EXIT_DIVERGED, the line names checkpoint 4 (saved before the
    streak) and the command with a lower optimizer.lr; step 6, saved inside the streak, is set aside, so the
    same command with that lr resumes from 4."""
    import jax.numpy as jnp

    from omnijax.train.distributed import EXIT_DIVERGED

    class Poisoned(IndexedLoader):
        def __next__(self):
            batch = super().__next__()
            bad = self.step > 4  # (the loader's step counts the batches handed out)
            return {**batch, "poison": np.full(len(batch["tokens"]), np.nan if bad else 0.0, np.float32)}

    def loss(model, batch):
        loss_sum, count, aux = lm_loss(model, {k: v for k, v in batch.items() if k != "poison"})
        return loss_sum + jnp.sum(batch["poison"]) * loss_sum, count, aux  # NaN gradients, poisoned steps only

    cfg = build(yaml_path=CONFIGS / "tiny_lm.yaml", overrides=TINY + [
        "trainer.steps=8", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=5", "trainer.max_nonfinite_in_row=2",
        "optimizer.lr=0.003"])
    loader = Poisoned(stdlib_text.packed("train", cfg.data.seq_len, seed=0), cfg.data.batch_size)
    trainer = Trainer(cfg, LLM(cfg.model, rngs=nnx.Rngs(0)), loss, loader, run_dir=tmp_path)
    with pytest.raises(NonFiniteError) as err:
        trainer.fit()
    line = str(err.value)
    assert err.value.exit_code == EXIT_DIVERGED != 2 and "\n" not in line
    assert "at steps 5..6" in line and f"Last good checkpoint: step 4 in {tmp_path / 'checkpoints'}" in line
    assert "optimizer.lr=0.0003" in line and "step 6, saved during the streak, was set aside" in line
    assert sorted(p.name for p in (tmp_path / "checkpoints_set_aside").iterdir()) == ["6"]
    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.all_steps() == [2, 4]
    ck.close()
