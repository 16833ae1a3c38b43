"""`recipes finetune` and `recipes export` end to end on tiny random HF folders saved by transformers: stage 1
(projector only, from HF Llama + SigLIP + Whisper), stage 2 (LLM + projector, from stage 1), both exported and
loaded back by transformers; bad input is one line each."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from recipes.__main__ import main  # noqa: E402



def _make_folders(root: Path, tok_dir: Path, llm_vocab: int = 0) -> Path:
    """Tiny random Llama (+ the tokenizer), SigLIP and Whisper folders, through `recipes example_models`."""
    assert main(["example_models", f"output={root}", f"tokenizer={tok_dir}", f"llm_vocab={llm_vocab}", "llm_width=32",
                 "encoder_width=32", "encoder_layers=1"]) == 0
    return root / "llm"


def _run(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _one_line_error(capsys, *argv) -> str:
    rc, err = _run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Example data (LLaVA JSON + media + a tokenizer), HF folders, shards converted with the LLM's tokenizer."""
    root = tmp_path_factory.mktemp("ft")
    assert main(["example_data", f"output={root}/data", "train=24", "eval=8", "llava=24"]) == 0
    llm = _make_folders(root / "hf", root / "data" / "tokenizer")
    assert main(["convert", f"input={root}/data/train_llava.json", f"output={root}/shards_train",
                 f"tokenizer.path={llm}"]) == 0
    return root


def _common(root: Path, name: str) -> list[str]:
    return [f"data.sources=[{root}/shards_train]", "trainer.steps=2", "trainer.log_every=1", "trainer.checkpoint_every=2", "trainer.progress=false",
            "optimizer.warmup_steps=0", f"trainer.run_name={name}",
            # room for every window's audio rows: one training program per stage instead of one per capacity bucket
            # (a window planned at a larger bucket is tested in test_data_plane.py)
            "capacity.audio=2048"]


def _flat(params) -> dict:
    """path -> host array of a parameter tree (an nnx.State as the trainer or read_bundle holds it)."""
    import jax

    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _hf_state(folder: Path, cls) -> dict:
    return {k: v.detach().numpy() for k, v in cls.from_pretrained(folder, dtype=torch.float32).state_dict().items()}


@pytest.mark.slow
def test_two_stages_export_and_transformers_load(world, capsys, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, SiglipVisionModel
    from safetensors.numpy import load_file

    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path / "runs"))
    root = world
    rc, err = _run(capsys, "finetune", f"init.llm={root}/hf/llm", f"init.encoders.vision={root}/hf/vision",
                   f"init.encoders.audio={root}/hf/audio", "trainer.trainable=[projector]", *_common(root, "s1"))
    assert rc == 0, err[-2000:]
    assert "projector" in err and "trainable" in err and "frozen" in err  # per-part counts at start
    s1 = tmp_path / "runs" / "s1"
    assert _run(capsys, "export", s1, f"output={tmp_path}/e1")[0] == 0
    from omnijax.train.loop import Trainer

    started = {}
    fit = Trainer.fit

    def recording_fit(self):  # the parameters stage 2's first step starts from
        started.update(_flat(self.state.params))
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", recording_fit)
    rc, err = _run(capsys, "finetune", f"init.checkpoint={s1}", "trainer.trainable=[llm,projector]",
                   *_common(root, "s2"))
    assert rc == 0, err[-2000:]
    monkeypatch.setattr(Trainer, "fit", fit)
    s2 = tmp_path / "runs" / "s2"
    assert _run(capsys, "export", s2, f"output={tmp_path}/e2")[0] == 0

    orig = _hf_state(root / "hf" / "llm", AutoModelForCausalLM)
    e1, e2 = _hf_state(tmp_path / "e1" / "llm", AutoModelForCausalLM), _hf_state(tmp_path / "e2" / "llm", AutoModelForCausalLM)
    assert sorted(e1) == sorted(orig) and all(e1[k].shape == orig[k].shape for k in orig)
    assert all(np.array_equal(e1[k], orig[k]) for k in orig)          # stage 1 froze the LLM: bitwise
    assert any(not np.array_equal(e2[k], orig[k]) for k in orig)      # stage 2 trained it
    vis = _hf_state(root / "hf" / "vision", SiglipVisionModel)
    for e in ("e1", "e2"):
        ve = _hf_state(tmp_path / e / "encoders" / "vision", SiglipVisionModel)
        assert sorted(ve) == sorted(vis) and all(np.array_equal(ve[k], vis[k]) for k in vis)
        ao = {k: v for k, v in load_file(str(root / "hf" / "audio" / "model.safetensors")).items() if "encoder." in k}
        ae = load_file(str(tmp_path / e / "encoders" / "audio" / "model.safetensors"))
        assert set(ao) <= set(ae) and all(np.array_equal(ao[k], ae[k]) for k in ao)
        assert (tmp_path / e / "llm" / "tokenizer.json").is_file()
    # stage 2 starts from stage 1's projector, and the export reads back as the run's last parameters
    import jax

    from omnijax.interop.bundle import read_bundle
    from omnijax.train import warmstart

    b1, b2 = read_bundle(tmp_path / "e1"), read_bundle(tmp_path / "e2")
    # stage 2 starts from exactly stage 1's exported parameters: every tensor, bit for bit
    exported = _flat(b1.params)
    assert sorted(started) == sorted(exported) and len(exported) > 10
    assert [k for k in exported if not np.array_equal(started[k], exported[k])] == []
    p2, _ = warmstart.params_from_run(s2, b2.params)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(b2.params), jax.tree.leaves(p2)))
    assert b2.config == b1.config and b2.tokenizer.endswith("llm")

    # bad input: one line each, nothing written
    line = _one_line_error(capsys, "export", s2, f"output={tmp_path}/e2")
    assert "exists" in line
    line = _one_line_error(capsys, "finetune", f"init.checkpoint={s1}", "trainer.trainable=[visoin]",
                           *_common(root, "bad1"))
    assert "no part 'visoin'" in line and "projector" in line
    line = _one_line_error(capsys, "finetune", f"init.llm={root}/hf/llm", "model.llm.num_layers=3",
                           *_common(root, "bad2"))
    assert "model.llm.num_layers=3 disagrees" in line
    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "runs" / "empty" / "config.json").write_text("{}")
    line = _one_line_error(capsys, "finetune", f"init.checkpoint={tmp_path}/runs/empty", *_common(root, "bad3"))
    assert "has no checkpoint" in line


def test_bad_pretrained_folders_and_tokenizers_are_one_line(world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path / "runs"))
    root = world
    gpt = tmp_path / "gpt2"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    line = _one_line_error(capsys, "finetune", f"init.llm={gpt}", *_common(root, "b1"))
    assert "gpt2" in line
    small = _make_folders(tmp_path / "small", root / "data" / "tokenizer", llm_vocab=300)
    line = _one_line_error(capsys, "finetune", f"init.llm={small}", *_common(root, "b2"))
    assert "vocab_size=300" in line and "tokenizer" in line
    other = tmp_path / "other_tok"
    other.mkdir()
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["a b c d e f g"] * 10, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    tok.save(str(other / "tokenizer.json"))
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    line = _one_line_error(capsys, "finetune", f"init.llm={root}/hf/llm", f"tokenizer.path={other}", *_common(root, "b3"))
    assert "is not the tokenizer of init.llm" in line
    # a tensor missing from the LLM's safetensors: named
    broken = tmp_path / "broken_llm"
    shutil.copytree(root / "hf" / "llm", broken)
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(broken / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    line = _one_line_error(capsys, "finetune", f"init.llm={broken}", f"init.encoders.vision={root}/hf/vision",
                           f"init.encoders.audio={root}/hf/audio", *_common(root, "b4"))
    assert "model.layers.1.mlp.up_proj.weight" in line
