"""The standard-library text source: held-out split, packing with document separation, resume."""
import numpy as np
import pytest

from omnijax.data import stdlib_text as st
from omnijax.data import tokenizer as T
from omnijax.errors import UserError


@pytest.fixture(scope="module")
def train():
    return st.packed("train", 64, seed=1)


def test_split_is_disjoint_and_nonempty():
    tr, ev = set(st.train_files()), set(st.eval_files())
    assert tr and ev and not (tr & ev) and len(ev) < len(tr) / 5


def test_rows_follow_documents(train):
    L = train.seq_len
    seen_boundary = False
    _, starts = train._epoch(0)
    rows = sorted({int(b) // L for b in starts[1:12]} | set(range(5)))  # rows holding document boundaries
    for r in rows:
        row = train.row(r)
        assert all(row[k].shape == (L,) for k in row)
        assert np.array_equal(row["tokens"][1:], row["targets"][:-1])
        seg, pos, mask = row["segment_ids"], row["positions"], row["loss_mask"]
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
        for b in np.flatnonzero(np.diff(seg)) + 1:  # a new document starts at b
            seen_boundary = True
            assert row["tokens"][b - 1] == T.EOS and pos[b] == 0 and mask[b - 1] == 0
        assert mask.sum() >= L - (seg.max() - 1) - 1
    assert seen_boundary


def test_deterministic_resume_and_dp_split(train):
    again = st.packed("train", 64, seed=1)
    it = train.batches(4, start_step=0)
    batches = [next(it) for _ in range(3)]
    resumed = next(again.batches(4, start_step=2))
    assert all(np.array_equal(batches[2][k], resumed[k]) for k in resumed)
    halves = [train.batch(2, 4, rank=r, num_ranks=2) for r in range(2)]
    assert np.array_equal(np.concatenate([h["tokens"] for h in halves]), batches[2]["tokens"])
    other = st.packed("train", 64, seed=2).batch(0, 4)
    assert not np.array_equal(other["tokens"], batches[0]["tokens"])


def test_epochs_repermute(train):
    a = train.row(0)["tokens"]
    b = train.row(train.rows_per_epoch)["tokens"]
    assert not np.array_equal(a, b)


def test_bad_arguments():
    with pytest.raises(UserError, match="split"):
        st.packed("valid", 64)
    with pytest.raises(UserError, match="divisible"):
        st.packed("eval", 64).batch(0, 3, num_ranks=2)
