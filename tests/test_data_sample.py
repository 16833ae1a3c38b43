"""Tokenizer round-trips and sample validation (the contract shared with the encoders)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnijax.data import sample as S
from omnijax.data import tokenizer as T
from omnijax.errors import UserError


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_tokenizer_roundtrip(s):
    ids = T.encode(s, bos=True, eos=True)
    assert ids.dtype == np.int32 and ids[0] == T.BOS and ids[-1] == T.EOS
    assert T.decode(ids) == s


def test_specials_and_placeholders():
    ids = np.array([T.BOS, 104, 105, T.IMAGE, T.AUDIO, T.EOS])
    assert T.decode(ids) == "hi"
    assert T.decode(ids, specials=True) == "<bos>hi<image><audio><eos>"
    assert max(T.SPECIALS.values()) < T.MIN_VOCAB_SIZE <= T.VOCAB_SIZE
    assert T.decode([0xFF, 0xFE]) == "\ufffd\ufffd"  # invalid UTF-8 from a model never raises


def test_meta_is_shapes_only():
    s = S.Sample((S.text("q: "), S.Segment("video", np.zeros((3, 8, 6, 3), np.float32)), S.text("a", loss=True)),
                 "world", 7)
    m = s.validate().meta()
    assert m.modalities == ("text", "video", "text") and m.segments[1].shape == (3, 8, 6, 3)
    assert m.text_tokens == 4 and m.loss_tokens == 1 and (m.source, m.index) == ("world", 7)


@pytest.mark.parametrize("seg, msg", [
    (S.Segment("image", np.zeros((0, 4, 3), np.float32)), "empty image"),
    (S.Segment("audio", np.zeros((0,), np.float32)), "zero-length audio"),
    (S.Segment("video", np.zeros((0, 4, 4, 3), np.float32)), "zero frames"),
    (S.Segment("image", np.zeros((4, 4), np.float32)), "rank"),
    (S.Segment("image", np.full((2, 2, 3), np.nan, np.float32)), "NaN"),
    (S.Segment("text", np.array([1, 9999], np.int32)), "outside"),
    (S.Segment("audio", np.ones(5, np.float32), loss=True), "only allowed on text"),
])
def test_bad_segments_raise_badsample(seg, msg):
    with pytest.raises(S.BadSample, match=msg):
        S.Sample((seg,), "src", 3).validate()
    assert issubclass(S.BadSample, UserError)
