"""metrics.jsonl read back under the resume rule, and mended before a resumed run appends to it."""
import json

import pytest

from omnijax.errors import UserError
from omnijax.train.metrics import mend_metrics, read_metrics


def _rows(path, *steps, attempt="a"):
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 1.0 / s, "attempt": attempt}) + "\n")


def test_a_resumed_runs_rows_supersede_the_abandoned_attempts(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    _rows(path, 1, 2, 3, 4, 5, 6)                  # killed after step 6, last checkpoint at 3
    _rows(path, 4, 5, attempt="b")                 # the resumed run, part way to where the first stopped
    got = read_metrics(path)
    assert [(r["step"], r["attempt"]) for r in got] == [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b")]
    _rows(path, 6, 7, attempt="b")                 # past it: each step's last row
    got = read_metrics(path)
    assert [(r["step"], r["attempt"]) for r in got] == [(1, "a"), (2, "a"), (3, "a")] + [(s, "b") for s in (4, 5, 6, 7)]
    _rows(path, 2, attempt="c")                    # log_every > 1 or an older checkpoint: the same rule
    assert [(r["step"], r["attempt"]) for r in read_metrics(path)] == [(1, "a"), (2, "c")]


def test_a_torn_last_row_is_not_read_and_mend_drops_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _rows(path, 1, 2, 3)
    whole = path.read_text()
    path.write_text(whole + '{"step": 4, "lo')     # being written, or cut short by a kill
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    mend_metrics(path)
    assert path.read_text() == whole                # every complete row stays
    mend_metrics(tmp_path / "none.jsonl")           # no file: nothing to mend
    assert not (tmp_path / "none.jsonl").exists()


def test_a_row_without_a_step_is_one_line_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n')
    with pytest.raises(UserError, match=r"row 2 has no step"):
        read_metrics(path)
