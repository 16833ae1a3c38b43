"""Model FLOPs on the real segment lengths (the MFU numerator)."""
from __future__ import annotations

import numpy as np

from omnijax.config import LLMConfig
from omnijax.train.metrics import FlopCounter, llm_flops_per_token, llm_param_counts


class _Enc:
    num_layers, embed_dim, merge = 3, 32, 2


def _counter(cfg: LLMConfig) -> FlopCounter:
    return FlopCounter.for_model(cfg, {"vision": _Enc()}, {"vision": 1000}, {"vision": 500})


def test_one_segment_matches_the_per_token_convention():
    cfg = LLMConfig(vocab_size=300, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    T = 48
    batch = {"segment_ids": np.ones((1, T), np.int32)}
    assert np.isclose(_counter(cfg)(batch), T * llm_flops_per_token(cfg, T))


def test_packed_segments_count_their_own_lengths_and_padding_nothing():
    cfg = LLMConfig(vocab_size=300, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    _, active = llm_param_counts(cfg)
    ids = np.array([[1] * 10 + [2] * 6 + [0] * 4, [1] * 20], np.int32)
    vis = np.array([1] * 8 + [2] * 4 + [0] * 4, np.int32)
    got = _counter(cfg)({"segment_ids": ids, "vision_segment_ids": vis})
    llm = 6 * active * 36 + 12 * 2 * 64 * (10 ** 2 + 6 ** 2 + 20 ** 2)
    enc = 6 * 1000 * 12 + 12 * 3 * 32 * (8 ** 2 + 4 ** 2) + 6 * 500 * (12 // 4)
    assert np.isclose(got, llm + enc)
