"""`recipes convert`: LLaVA .json / JSONL with media -> ArrayRecord shards in parallel, resumable, tied to
their tokenizer."""
import json
import os

import numpy as np
import pytest
from test_tokenizer import make_hf

from omnijax.data import records, sources
from omnijax.data import tokenizer as T
from omnijax.errors import UserError

GOOD = [
    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                         {"from": "gpt", "value": "A cat."}]},
    {"audio": "t.wav", "conversations": [{"from": "human", "value": "Listen."}, {"from": "gpt", "value": "A tone."},
                                         {"from": "human", "value": "And?"}, {"from": "gpt", "value": "Nothing."}]},
    {"image": ["a.png", "b.png"], "conversations": [{"from": "human", "value": "<image> or <image>?"},
                                                    {"from": "gpt", "value": "the first"}]},
    {"text": "a plain \"document\" with [brackets], {braces} and a \\ backslash"},
    {"segments": [{"text": "caption: "}, {"image": "b.png"}, {"text": "a dog", "loss": True}]},
]
CORRUPT = [  # a media file that is not an image, and a record with more tags than images
    {"image": "bad.jpg", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]},
    {"image": "a.png", "conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]},
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from PIL import Image
    import soundfile as sf
    d = tmp_path_factory.mktemp("convert")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(d / "a.png")
    Image.fromarray(rng.integers(0, 256, (10, 8, 3), dtype=np.uint8)).save(d / "b.png")
    sf.write(d / "t.wav", (0.3 * np.sin(np.arange(3200) / 7)).astype(np.float32), 16000)
    (d / "bad.jpg").write_bytes(b"\xff\xd8 this is not a jpeg")
    recs = GOOD[:2] + CORRUPT[:1] + GOOD[2:4] + CORRUPT[1:] + GOOD[4:]  # 7 records, 2 bad (indices 2 and 5)
    (d / "d.json").write_text(json.dumps(recs, indent=2))
    (d / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok_dir = make_hf(tmp_path_factory.mktemp("tok") / "hf")
    return d, tok_dir


def _convert(capsys, *args):
    from recipes import convert
    assert convert.main(list(args)) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def _same(a, b) -> bool:
    return records.encode(a.with_origin("x", 0)) == records.encode(b.with_origin("x", 0))


def test_convert_parallel_resume_and_tokenizer_check(data, tmp_path, capsys):
    d, tok_dir = data
    tok = T.load_tokenizer(str(tok_dir))
    out = tmp_path / "shards"
    summary, err = _convert(capsys, f"input={d / 'd.json'}", f"output={out}", f"tokenizer.path={tok_dir}",
                            "workers=2", "shards=3")
    assert summary["records"] == 5 and summary["skipped_bad"] == 2 and summary["reused_shards"] == 0
    bad_lines = [line for line in err.splitlines() if line.startswith("skipped record")]
    assert len(bad_lines) == 2 and all(str(d / "d.json") in line for line in bad_lines)
    assert any("record 2 " in line and "bad.jpg" in line for line in bad_lines)
    assert any("record 5 " in line and "2 <image> tag" in line for line in bad_lines)
    info = sources.dataset_info(out)
    assert info["tokenizer"]["fingerprint"] == tok.fingerprint and info["tokenizer"]["vocab_size"] == tok.vocab_size
    assert info["tokenizer"]["placeholder"] == tok.placeholder and info["records"] == 5

    # readable through open_sources with the same tokenizer, equal to reading the JSONL directly
    ref = sources.JsonlSource("d", str(d / "d.jsonl"), tok)
    good = [0, 1, 3, 4, 6]

    def check():
        (ar,) = sources.open_sources([sources.SourceSpec("d", path=str(out))], tokenizer=tok)
        assert len(ar) == 5
        for k, i in enumerate(good):
            s = ar.get(k)
            assert _same(s, ref.get(i)) and ar.meta(k).segments == s.meta().segments == ref.meta(i).segments
        return ar

    ar = check()
    loss_ids = np.concatenate([g.data for g in ar.get(0).segments if g.loss])
    assert loss_ids.tolist() == tok.encode("A cat.").tolist() + [tok.eos]  # LLaVA answer + end of turn only
    assert any(g.modality == "audio" for g in ar.get(1).segments)

    # rerun: complete shards are kept untouched, a truncated one is redone
    shards = sorted(str(p) for p in out.glob("*.arrayrecord"))
    assert len(shards) == 3
    mtimes = [os.stat(p).st_mtime_ns for p in shards]
    with open(shards[1], "r+b") as f:
        f.truncate(os.path.getsize(shards[1]) - 7)
    summary, _ = _convert(capsys, f"input={d / 'd.json'}", f"output={out}", f"tokenizer.path={tok_dir}",
                          "workers=2", "shards=3")
    assert summary["reused_shards"] == 2 and summary["records"] == 5 and summary["skipped_bad"] == 2
    now = [os.stat(p).st_mtime_ns for p in shards]
    assert now[0] == mtimes[0] and now[2] == mtimes[2] and now[1] != mtimes[1]
    check()

    # shards of another tokenizer are refused, naming the folder and both tokenizers
    with pytest.raises(UserError, match=rf"{out}.*{tok_dir}.*byte-level"):
        sources.open_sources([sources.SourceSpec("d", path=str(out))])
    (out / records.DATASET_JSON).unlink()  # shards from before the dataset json: byte-level
    with pytest.raises(UserError, match="no omnijax_dataset.json"):
        sources.open_sources([sources.SourceSpec("d", path=str(out))], tokenizer=tok)


def test_jsonl_and_json_list_read_the_same_records(data, monkeypatch):
    d, _ = data
    monkeypatch.setattr(sources, "_SCAN", 5)  # the indexers cross a chunk border inside strings and escapes
    a = sources.JsonlSource("d", str(d / "d.json"))
    b = sources.JsonlSource("d", str(d / "d.jsonl"))
    full = json.loads((d / "d.json").read_text())
    assert len(a) == len(b) == len(full) == 7
    for i in range(7):
        assert a._record(i) == b._record(i) == full[i]
    import pickle
    tok = T.load_tokenizer(str(data[1]))
    c = pickle.loads(pickle.dumps(sources.JsonlSource("d", str(d / "d.json"), tok)))  # e.g. into loader workers
    assert _same(c.get(0), sources.JsonlSource("d", str(d / "d.jsonl"), tok).get(0))
    tricky = d / "tricky.json"
    items = [{"text": 'q\\"}]['}, {"text": "\\\\"}, {"text": "[{,\"}"}, {"text": "é ok"}]
    tricky.write_text(" \n[" + ",".join(json.dumps(x, ensure_ascii=False) for x in items) + "]\n")
    t = sources.JsonlSource("t", str(tricky))
    assert [t._record(i) for i in range(len(t))] == items
    (d / "empty.json").write_text("[ ]")
    assert len(sources.JsonlSource("e", str(d / "empty.json"))) == 0
    (d / "cut.json").write_text('[{"text": "a"}, {"text": "b')
    with pytest.raises(UserError, match="not closed"):
        sources.JsonlSource("c", str(d / "cut.json"))


def test_convert_world_in_process_and_stale_shards(tmp_path, capsys):
    out = tmp_path / "w"
    summary, _ = _convert(capsys, "input=world", "samples=12", f"output={out}", "shards=3")
    assert summary["records"] == 12 and summary["skipped_bad"] == 0
    summary, err = _convert(capsys, "input=world", "samples=12", f"output={out}", "shards=2")
    assert len(list(out.glob("*.arrayrecord"))) == 2 and "removed stale shard" in err
    (ar,) = sources.open_sources([sources.SourceSpec("w", path=str(out))])
    assert [ar.get(i).index for i in range(12)] == list(range(12))
    from omnijax.errors import ConfigError
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="already holds the shards of world"):
        _convert(capsys, f"input={tmp_path / 'x.jsonl'}", f"output={out}")


def test_8bit_pixels_are_stored_as_uint8_and_decode_to_the_same_floats():
    from omnijax.data.sample import Sample, Segment
    rng = np.random.default_rng(0)
    px = rng.integers(0, 256, (6, 5, 3)).astype(np.float32) / 255.0  # what an 8-bit image file decodes to
    other = rng.random((6, 5, 3), dtype=np.float32)                   # e.g. resized: not k/255
    for x, dtype in ((px, "uint8"), (other, "float32")):
        raw = records.encode(Sample((Segment("image", x),)))
        assert f'"dtype": "{dtype}"' in raw[8:200].decode(errors="ignore")
        back = records.decode(raw).segments[0].data
        assert back.dtype == np.float32 and np.array_equal(back.view(np.uint32), x.view(np.uint32))


def test_video_conversation_follows_media_settings(tmp_path, capsys):
    from omnijax.data import media
    media.write_video(tmp_path / "v.mp4", np.random.default_rng(0).random((8, 16, 16, 3)), fps=4)  # 2 seconds
    rec = {"video": "v.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                               {"from": "gpt", "value": "Noise."}]}
    (tmp_path / "v.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    frames = {}
    for fps in (1, 2):
        out = tmp_path / f"fps{fps}"
        summary, _ = _convert(capsys, f"input={tmp_path / 'v.jsonl'}", f"output={out}", f"media.video_fps={fps}",
                              "workers=2", "shards=2")
        assert summary["records"] == 2 and summary["skipped_bad"] == 0
        (ar,) = sources.open_sources([sources.SourceSpec("v", path=str(out))])
        (seg,) = [s for s in ar.get(1).segments if s.modality == "video"]
        frames[fps] = seg.data.shape[0]
        assert sources.dataset_info(out)["media"]["video_fps"] == fps
    assert frames == {1: 2, 2: 4}
