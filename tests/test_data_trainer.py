"""The data-plane loader feeds the Trainer: its state rides in the checkpoint, and a preempted run
resumes to the identical loss curve."""
import json
import os
import shutil
import signal

import pytest

from flax import nnx

from omnijax.config import Config, from_dict
from omnijax.data.loader import Loader, LoaderConfig, TrainerBatches
from omnijax.models import mllm
from omnijax.mm_config import MMConfig
from omnijax.train.checkpoint import Checkpointer
from omnijax.train.loop import Trainer
from test_mllm import MM, WORLD  # the tiny multimodal config shared by these tests

LOADER = dict(samples_per_step=16, dp=8, microbatches=1, window=2, row_len=64, max_rows=1, fixed_shapes=True,
              max_encoder_rows={"vision": 256, "audio": 128}, threads=1)


def _fit(run_dir, hooks=()):
    mm = from_dict(MMConfig, MM)
    cfg = from_dict(Config, {"model": {}, "trainer": {"steps": 4, "log_every": 1, "checkpoint_every": 2,
                                                      "progress": False}, "optimizer": {"warmup_steps": 1}})
    loader = TrainerBatches(Loader(LoaderConfig(**LOADER), mm_cfg=mm, world_cfg=WORLD))
    trainer = Trainer(cfg, mllm.MultimodalModel(mm, rngs=nnx.Rngs(0)), mllm.mm_loss, loader, hooks=hooks,
                      run_dir=run_dir)
    return trainer, trainer.fit()


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_loader_state_checkpointed_and_resumed_exactly(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    trainer, _ = _fit(ref_dir)
    assert trainer.compiled_programs() == 1  # fixed shapes: one program for every step
    row = json.loads((ref_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert "padded_fraction" in row and "skipped_bad_records" in row

    def preempt(trainer, step, row):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    _, first = _fit(run_dir, hooks=(preempt,))
    assert first.status == "preempted"
    seen = []
    _, second = _fit(run_dir, hooks=(lambda t, step, row: seen.append(step),))
    assert second.status == "finished" and seen[0] == 3  # resumed after step 2, not from 0
    assert _losses(run_dir) == _losses(ref_dir)


def _fit_multiplexed(run_dir, window: int):
    """The joint step (dp8 LLM, edp8 encoders) fed by the data plane, as `tiny_omni` wires it."""
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer

    mm = from_dict(MMConfig, MM)
    cfg = from_dict(Config, {"model": {}, "trainer": {"steps": 4, "log_every": 1, "checkpoint_every": 2,
                                                      "progress": False}, "optimizer": {"warmup_steps": 1}})
    placement = Multiplexer(LLMParallel("dp8", mm.llm), mm, encoder_layout="edp8", balance_rows=False)
    loader = TrainerBatches(Loader(LoaderConfig(**{**LOADER, "window": window, "fixed_shapes": False}),
                                   mm_cfg=mm, world_cfg=WORLD))
    trainer = Trainer(cfg, lambda: placement.prepare(mllm.MultimodalModel(mm, rngs=nnx.Rngs(0))), placement.loss_fn,
                      loader, placement=placement, run_dir=run_dir)
    return trainer, trainer.fit(), placement


@pytest.mark.slow
def test_multiplexed_run_one_program_per_window_and_exact_resume_mid_window(tmp_path):
    """The trainer reserves the encoder buffers of a whole data-plane window before placing its first
    step (one compiled program for the window), and checkpoints the capacities it reached: a run
    resumed in the middle of a window places its steps in the same buffers, so its losses are
    bit-identical to the uninterrupted run's."""
    ref_dir = tmp_path / "ref"
    trainer, result, placement = _fit_multiplexed(ref_dir, window=4)
    assert result.status == "finished" and trainer.compiled_programs() == 1
    saved = Checkpointer(ref_dir / "checkpoints")
    caps = saved.placement_state(4)["capacities"]  # the window's (the prefetcher may have sized the next)
    assert saved.placement_state(2)["capacities"] == caps  # reserved for the window before step 1
    saved.close()
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "4")  # as if preempted after step 2, mid-window
    trainer, result, placement = _fit_multiplexed(run_dir, window=4)
    assert result.status == "finished" and [r["step"] for r in result.history] == [3, 4]
    resumed = Checkpointer(run_dir / "checkpoints")
    assert resumed.placement_state(4)["capacities"] == caps
    resumed.close()
    assert _losses(run_dir) == _losses(ref_dir)
