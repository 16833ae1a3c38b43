"""The user's path, as typed: media files + JSONL/LLaVA -> `recipes convert` -> `tiny_omni data.sources=[...]`.

One dataset (JPEG/PNG images, mp4 videos, WAV/FLAC audio, two corrupt entries, a tiny Hugging Face tokenizer)
is written by `recipes example_data`, converted once, and trained on for a few dozen steps.
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from omnijax.errors import ConfigError, UserError

pytestmark = pytest.mark.xdist_group("user_data")


def _run(module, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from recipes import convert, example_data

    root = tmp_path_factory.mktemp("user_data")
    raw = root / "raw"
    made = json.loads(_run(example_data, [f"output={raw}", "train=48", "eval=16", "llava=16"]))
    tok = made["tokenizer"]
    summaries = {}
    for name, src, extra in (("train", made["train"], ["workers=2", "shards=2"]),
                             ("llava", made["llava"], ["shards=1"]),
                             ("eval", made["eval"], ["shards=1"])):
        line = _run(convert, [f"input={src}", f"output={root / 'shards' / name}", f"tokenizer.path={tok}", *extra])
        summaries[name] = json.loads(line.strip().splitlines()[-1])
    return {"root": root, "raw": raw, "tokenizer": tok, "convert": summaries}


def test_convert_counts_the_corrupt_entries(dataset):
    train = dataset["convert"]["train"]
    assert train["skipped_bad"] == 2          # the truncated JPEG and the zero-length WAV
    assert train["records"] == 48             # every good record written, none lost
    assert dataset["convert"]["eval"]["skipped_bad"] == 0
    assert dataset["convert"]["llava"]["records"] > 0


@pytest.mark.slow
def test_train_on_user_data_with_held_out_loss(dataset, tmp_path, monkeypatch):
    from recipes import tiny_omni

    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path))
    shards = dataset["root"] / "shards"
    argv = [f"data.sources=[{shards / 'train'},{shards / 'llava'}]", f"data.eval_sources=[{shards / 'eval'}]",
            f"tokenizer.path={dataset['tokenizer']}", "data.eval_batches=2",
            "trainer.steps=16", "trainer.log_every=4", "trainer.eval_every=6", "trainer.checkpoint_every=0",
            "trainer.run_name=user_data", "trainer.progress=false", "optimizer.warmup_steps=5",
            # room for every window's encoder rows: one training program instead of one per capacity bucket
            # (a window planned at a larger bucket is tested in test_data_plane.py)
            "capacity.vision=960", "capacity.audio=2048"]
    assert tiny_omni.main(argv) == 0
    run = tmp_path / "user_data"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert all(map(lambda x: x == x, losses))                      # no NaN
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2       # it learns
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [6, 12]                                 # every trainer.eval_every steps
    report = json.loads((run / "eval.json").read_text())
    assert report["metrics"]["eval_loss"] < evals[6]               # held-out loss falls too
    assert report["metrics"]["eval_tokens"] > 0
    events = list((run / "tb").glob("events.out.tfevents.*"))  # TensorBoard's events, written without torch
    assert events and all(e.stat().st_size > 100 for e in events)


def test_config_errors_name_the_path(dataset, tmp_path):
    from recipes import tiny_omni

    with pytest.raises(ConfigError, match="data.source"):
        tiny_omni.load(["data.source=world"])
    with pytest.raises(ConfigError, match="no such folder"):
        tiny_omni.load([f"data.sources=[{tmp_path / 'missing'}]"])
    with pytest.raises(ConfigError, match="matches no files"):
        tiny_omni.load([f"data.eval_sources=[{tmp_path}/*.arrayrecord]"])
    with pytest.raises(ConfigError, match="byte-level"):
        tiny_omni.load([f"tokenizer.path={dataset['tokenizer']}"])
    with pytest.raises(ConfigError, match="eval_sources"):  # eval.* would be read by nobody here
        tiny_omni.load([f"data.sources=[{dataset['root'] / 'shards' / 'train'}]", "eval.items=10"])


def test_shards_of_another_tokenizer_are_refused(dataset, monkeypatch, tmp_path):
    """Training shards written with the HF tokenizer, read as byte-level: one line naming the folder."""
    from recipes import tiny_omni

    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path))
    folder = dataset["root"] / "shards" / "train"
    with pytest.raises(UserError, match=str(folder)):
        tiny_omni.main([f"data.sources=[{folder}]", "trainer.steps=1", "trainer.progress=false"])
