"""Every way a source can be wrong at open (missing files, sidecars out of step with their shards, a Parquet file
without the column, JSON lists that do not close) is one UserError naming the file; a bad record is a BadSample."""
from __future__ import annotations

import json

import numpy as np
import pytest

from omnijax.data import records
from omnijax.data.sample import BadSample, Sample, Segment
from omnijax.data.sources import (JsonlSource, ParquetSource, SourceSpec, index_json_list, open_sources,
                                  shard_paths)
from omnijax.errors import UserError


def _text(i: int) -> Sample:
    return Sample((Segment("text", np.arange(3 + i, dtype=np.int32), True),), "t", i)


def test_arrayrecord_shards_and_sidecars(tmp_path):
    with pytest.raises(UserError, match="no ArrayRecord shards match"):
        shard_paths(str(tmp_path))                                   # an empty folder
    with pytest.raises(UserError, match="missing ArrayRecord shard: .*nope.arrayrecord"):
        shard_paths(str(tmp_path / "nope.arrayrecord"))
    records.write_shard(tmp_path / "a.arrayrecord", [_text(i) for i in range(3)])
    records.write_shard(tmp_path / "b.arrayrecord", [_text(i) for i in range(5)])
    assert shard_paths(str(tmp_path)) == [str(tmp_path / "a.arrayrecord"), str(tmp_path / "b.arrayrecord")]
    (tmp_path / "b.arrayrecord.meta.npz").unlink()
    with pytest.raises(UserError, match="missing metadata sidecar .*b.arrayrecord.meta.npz"):
        shard_paths(str(tmp_path))
    # a sidecar that describes another shard's records: the counts disagree at open
    (tmp_path / "b.arrayrecord.meta.npz").write_bytes((tmp_path / "a.arrayrecord.meta.npz").read_bytes())
    with pytest.raises(UserError, match="hold 8 records but their sidecars describe 6"):
        open_sources([SourceSpec(path=str(tmp_path), kind="arrayrecord")])


def test_parquet_file_column_and_null_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    with pytest.raises(UserError, match="missing Parquet file"):
        ParquetSource("p", str(tmp_path / "x.parquet"))
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "wrong.parquet")
    with pytest.raises(UserError, match="no column 'text'; columns: body"):
        ParquetSource("p", str(tmp_path / "wrong.parquet"))
    pq.write_table(pa.table({"text": ["hello", None]}), tmp_path / "t.parquet")
    src = ParquetSource("p", str(tmp_path / "t.parquet"))
    assert list(src.get(0).segments[1].data[:5]) == list(b"hello")
    with pytest.raises(BadSample, match="null text"):
        src.get(1)


def test_json_lists_that_do_not_close_and_bad_lines(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"text": "a"}]]')
    with pytest.raises(UserError, match="malformed JSON list"):
        index_json_list(str(bad))
    cut = tmp_path / "cut.json"
    cut.write_text('[{"text": "a"}, {"text": "b')
    with pytest.raises(UserError, match="not closed"):
        index_json_list(str(cut))
    with pytest.raises(UserError, match="missing JSONL file"):
        JsonlSource("j", str(tmp_path / "none.jsonl"))
    lines = tmp_path / "l.jsonl"
    lines.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    src = JsonlSource("j", str(lines))
    assert len(src) == 2 and src.get(0).segments
    with pytest.raises(records.BadRecord, match=r"record 1 \(line 2\) of .*l.jsonl is not valid JSON"):
        src.get(1)


def test_mixes_of_sources(tmp_path):
    with pytest.raises(UserError, match="unknown source kind 'csv'"):
        open_sources([SourceSpec(path="x.csv", kind="csv")])
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "same.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match="source names must be unique"):
        open_sources([SourceSpec(path=str(a / "same.jsonl")), SourceSpec(path=str(b / "same.jsonl"))])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="source empty .* is empty"):
        open_sources([SourceSpec(path=str(tmp_path / "empty.jsonl"))])
