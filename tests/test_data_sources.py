"""Sources and conversion: JSONL with media (npy/images/audio) -> ArrayRecord, Parquet, metadata without payloads."""
import json

import numpy as np
import pytest

from omnijax.data import media, records, sources
from omnijax.data.sample import BadSample, Sample, text
from omnijax.errors import UserError


def test_media_readers_through_load_media(tmp_path):
    """The sources' view of media: PNG and 8 kHz WAV load to the sample format (details: test_data_media.py)."""
    rng = np.random.default_rng(0)
    px = rng.integers(0, 256, (10, 7, 3), dtype=np.uint8)
    media.write_image(tmp_path / "a.png", px / 255.0)
    img = media.load_media(tmp_path / "a.png", "image")
    assert media.media_shape(tmp_path / "a.png", "image") == img.shape == (10, 7, 3)
    assert np.array_equal(np.round(img * 255).astype(np.uint8), px)
    wave = np.sin(np.arange(8000) / 8000 * 2 * np.pi * 440).astype(np.float32) * 0.5
    media.write_audio(tmp_path / "a.wav", wave, rate=8000)  # resampled to 16 kHz on load
    x = media.load_media(tmp_path / "a.wav", "audio")
    assert x.shape == media.media_shape(tmp_path / "a.wav", "audio") == (16000,)
    assert abs(np.abs(x[100:-100]).max() - 0.5) < 0.01
    (tmp_path / "bad.png").write_bytes(b"nope")
    with pytest.raises(BadSample, match="bad.png: corrupt"):
        media.load_media(tmp_path / "bad.png", "image")


@pytest.fixture()
def jsonl(tmp_path):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "clip.npy", rng.random((3, 16, 16, 3), dtype=np.float32))
    media.write_image(tmp_path / "img.png", rng.random((16, 24, 3)))
    media.write_audio(tmp_path / "tone.wav", np.sin(np.arange(4000) / 10).astype(np.float32) * 0.3)
    np.save(tmp_path / "empty.npy", np.zeros((0, 8, 3), np.float32))
    lines = [
        {"text": "plain text document"},
        {"segments": [{"text": "look: "}, {"image": "img.png"}, {"text": "a picture", "loss": True}]},
        {"segments": [{"video": "clip.npy"}, {"text": "moving", "loss": True}]},
        {"segments": [{"audio": "tone.wav"}, {"text": "7", "loss": True}]},
        "not json at all",
        {"segments": [{"image": "missing.png"}, {"text": "x", "loss": True}]},
        {"segments": [{"image": "empty.npy"}, {"text": "x", "loss": True}]},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n\n")
    return path


def _parts_match_get(src, i):
    """text() and media(k) (what a host reads of a sample it does not wholly own) equal get()'s segments."""
    s = src.get(i)
    text_ids = src.text(i)
    assert sorted(text_ids) == [k for k, seg in enumerate(s.segments) if seg.modality == "text"]
    for k, seg in enumerate(s.segments):
        got = text_ids[k] if seg.modality == "text" else src.media(i, k)
        assert got.dtype == seg.data.dtype and np.array_equal(got, seg.data), (i, k)


def test_jsonl_meta_matches_payload_and_bad_lines(jsonl):
    src = sources.JsonlSource("d", str(jsonl))
    assert len(src) == 7
    for i in range(4):
        s = src.get(i).validate()
        assert s.meta() == src.meta(i)
        _parts_match_get(src, i)
    assert list(src.text(5)) == [1] and src.text(5)[1].size == 1  # its text reads without its (missing) image
    with pytest.raises(BadSample, match="not found"):
        src.media(5, 0)
    assert src.meta(1).modalities == ("text", "image", "text") and src.meta(1).segments[1].shape == (16, 24, 3)
    with pytest.raises(records.BadRecord, match="not valid JSON"):
        src.meta(4)
    with pytest.raises(BadSample, match="not found"):
        src.get(5)
    with pytest.raises(BadSample, match="empty image"):
        src.get(6).validate()


def test_convert_to_arrayrecord_and_read_back(jsonl, tmp_path, capsys):
    from recipes import convert
    out = tmp_path / "shards"
    assert convert.main([f"input={jsonl}", f"output={out}", "shards=2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["records"] == 4 and summary["skipped_bad"] == 3
    ref = sources.JsonlSource("d", str(jsonl))
    (ar,) = sources.open_sources([sources.SourceSpec("d", path=str(out))])
    assert len(ar) == 4
    for i in range(len(ar)):  # metadata from the sidecar equals the decoded payload's
        assert ar.meta(i) == ar.get(i).meta()
        _parts_match_get(ar, i)
    originals = {records.encode(ref.get(i).with_origin("d", 0)) for i in range(4)}
    assert {records.encode(ar.get(i).with_origin("d", 0)) for i in range(4)} == originals  # payloads intact


def test_record_header_is_enough_for_metadata():
    s = Sample((text("hello"), text("!", loss=True)), "x", 3)
    raw = records.encode(s)
    assert records.read_meta(raw, "x", 3) == s.meta()
    with pytest.raises(records.BadRecord, match="truncated"):
        records.decode(raw[:-2])
    with pytest.raises(records.BadRecord, match="magic"):
        records.decode(b"garbage!")


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["abc", "héllo wörld", None]}), tmp_path / "t.parquet", row_group_size=2)
    (src,) = sources.open_sources([sources.SourceSpec("p", path=str(tmp_path / "t.parquet"))])
    assert len(src) == 3
    assert src.get(1).meta() == src.meta(1) and src.meta(1).loss_tokens == len("héllo wörld".encode()) + 1
    with pytest.raises(BadSample, match="null"):
        src.get(2)
    with pytest.raises(UserError, match="no column"):
        sources.ParquetSource("p", str(tmp_path / "t.parquet"), column="body")


def test_missing_inputs_fail_at_open(tmp_path):
    with pytest.raises(UserError, match="missing JSONL file"):
        sources.open_sources([sources.SourceSpec("j", path=str(tmp_path / "x.jsonl"))])
    records.write_shard(tmp_path / "a.arrayrecord", [Sample((text("a"),))])
    (tmp_path / "a.arrayrecord.meta.npz").unlink()
    with pytest.raises(UserError, match="missing metadata sidecar"):
        sources.open_sources([sources.SourceSpec("a", path=str(tmp_path / "a.arrayrecord"))])


def test_loader_mixes_jsonl_parquet_and_world(jsonl, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omnijax.data.loader import Loader, LoaderConfig
    pq.write_table(pa.table({"text": [f"document {i} " * 3 for i in range(20)]}), tmp_path / "t.parquet")
    cfg = LoaderConfig(sources=[sources.SourceSpec("j", path=str(jsonl)), sources.SourceSpec("p", path=str(tmp_path / "t.parquet")),
                                sources.SourceSpec("world")],
                       mix=[{"step": 0, "weights": {"j": 1, "p": 1}}, {"step": 3, "weights": {"j": 1, "p": 1}},
                            {"step": 4, "weights": {"world": 1}}],
                       samples_per_step=6, dp=2, window=2, row_len=128, max_rows=4)
    loader = Loader(cfg)
    names = [{loader.names[e.source] for e in loader.window_plan(w).entries} for w in (0, 2)]
    assert names[0] <= {"j", "p"} and names[1] == {"world"}
    for s in range(5):
        batch = loader.host_batch(s)
        assert batch["microbatches"][0]["tokens"].shape[1] == batch["layout"].row_len
    m = loader.metrics(0)
    assert m["skipped_bad_records"] > 0 or m["dropped_total"] > 0  # the JSONL file's bad lines were counted
