"""The data-plane loader feeds the Trainer: its state rides in the checkpoint, and a preempted run
resumes to the identical loss curve."""
import json
import os
import signal

from flax import nnx

from omnijax.config import Config, from_dict
from omnijax.data.loader import Loader, LoaderConfig, TrainerBatches
from omnijax.models import mllm
from omnijax.mm_config import MMConfig
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
