"""bench omni's `model=qwen2_5_vl`: the world's batches as the Qwen2.5-VL model takes them (no step compiled)."""
import numpy as np
import pytest

from omnijax.errors import ConfigError
from recipes.bench import omni


def test_qwen_batches_carry_rope_positions_and_native_resolution_patch_counts():
    cfg = omni.model_config("qwen2_5_vl")
    assert cfg.encoders["vision"]["kind"] == "qwen_vit" and "audio" not in cfg.encoders
    assert all("audio" not in p and abs(sum(p.values()) - 1.0) < 1e-9 for p in omni._phases(cfg))
    loader = omni.make_loader(cfg, steps=3, batch_size=8, seq_len=128, lookahead=16, devices=8, window=1)
    b = loader.host_batch(0)["microbatches"][0]   # the first mix phase: half images, a fifth videos
    assert b["rope_positions"].shape == b["segment_ids"].shape + (3,)
    assert not any(k.startswith("audio") for k in b)
    seg = np.asarray(b["vision_segment_ids"]).ravel()
    sizes = np.bincount(seg[seg > 0])
    assert len(set(sizes[sizes > 0].tolist())) > 1   # patch counts vary per item: no fixed resize
    with pytest.raises(ConfigError, match="model="):
        omni.model_config("/nonexistent/qwen")
