"""Encoders: preprocessing rules, packed attention isolation, costs, bad input."""
import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from omnijax.data import features
from omnijax.data.sample import BadSample
from omnijax.models.audio import AudioEncoder
from omnijax.mm_config import AudioConfig, VisionConfig
from omnijax.models.vision import VisionEncoder, relative_coordinate_features

VCFG = VisionConfig(patch=4, temporal_patch=2, merge=2, max_side=64, abs_position=True, embed_dim=32, num_layers=2, num_heads=4, mlp_dim=64)
ACFG = AudioConfig(n_mels=16, reduction=4, embed_dim=32, num_layers=2, num_heads=4, mlp_dim=64)


def pack(segments, cfg, modality):
    rows, segs, poss = [], [], []
    for i, data in enumerate(segments):
        x, p = features.segment_inputs(modality, data, cfg)
        rows.append(x), poss.append(p), segs.append(np.full(len(x), i + 1, np.int32))
    return np.concatenate(rows), np.concatenate(segs), np.concatenate(poss)


@pytest.fixture(scope="module")
def vit():
    model = VisionEncoder(VCFG, rngs=nnx.Rngs(0))
    return model, jax.jit(lambda m, x, s, p: m(x, s, p))


@pytest.fixture(scope="module")
def audio():
    model = AudioEncoder(ACFG, rngs=nnx.Rngs(1))
    return model, jax.jit(lambda m, x, s, p: m(x, s, p))


# ------------------------------------------------------------------------------ preprocessing
def test_patch_order_groups_merge_windows():
    img = np.random.default_rng(0).random((16, 24, 3)).astype(np.float32)
    patches, grid = features.image_patches(img, patch=4, temporal_patch=1, merge=2)
    assert grid == (1, 4, 6) and patches.shape == (24, 48)
    pos = features.patch_positions(grid, merge=2)
    for row, (t, h, w) in enumerate(pos):  # each row is the pixel block at its (h, w)
        np.testing.assert_array_equal(patches[row].reshape(4, 4, 3), img[h * 4:h * 4 + 4, w * 4:w * 4 + 4])
    # rows 4k..4k+3 form one 2x2 window
    windows = pos.reshape(-1, 4, 3)
    assert np.all(windows[:, :, 1] // 2 == windows[:, :1, 1] // 2) and np.all(windows[:, :, 2] // 2 == windows[:, :1, 2] // 2)


@settings(max_examples=40, deadline=None)
@given(h=st.integers(4, 150), w=st.integers(4, 150), frames=st.integers(0, 5), kind=st.sampled_from(["image", "video"]))
def test_token_counts_match_payload(h, w, frames, kind):
    shape = (h, w, 3) if kind == "image" else (frames, h, w, 3)
    try:
        n_in, n_llm = features.encoder_tokens(kind, shape, VCFG)
    except BadSample:
        with pytest.raises(BadSample):
            features.image_patches(np.zeros(shape, np.float32), VCFG.patch, VCFG.temporal_patch, VCFG.merge, VCFG.max_side)
        assert min(h, w) * 2 < VCFG.patch * VCFG.merge or kind == "video" and frames == 0
        return
    patches, (t, gh, gw) = features.image_patches(np.zeros(shape, np.float32), VCFG.patch, VCFG.temporal_patch,
                                                  VCFG.merge, VCFG.max_side)
    assert patches.shape == (n_in, 2 * 4 * 4 * 3) and n_llm * 4 == n_in
    assert gh % 2 == 0 and gw % 2 == 0 and gh * 4 <= VCFG.max_side and gw * 4 <= VCFG.max_side
    scale = min(1.0, VCFG.max_side / max(h, w))  # aspect kept up to half a unit per side, no crop
    assert abs(gh * 4 - h * scale) <= 4 or gh == 2 and h * scale < 8
    assert abs(gw * 4 - w * scale) <= 4 or gw == 2 and w * scale < 8
    assert t == (1 if kind == "image" else -(-frames // 2))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 8000))
def test_audio_frames_match_log_mel(n):
    wave = np.sin(np.arange(n) * 0.3).astype(np.float32)
    feats = features.log_mel(wave, n_mels=16, pad_to_multiple=4)
    n_in, n_llm = features.encoder_tokens("audio", (n,), ACFG)
    assert feats.shape == (n_in, 16) and n_in == 4 * n_llm and np.all(np.isfinite(feats))


def test_resize_keeps_content():
    img = np.zeros((48, 96, 3), np.float32)
    img[:24, :48] = 1.0  # top-left quadrant lit
    patches, grid = features.image_patches(img, patch=4, temporal_patch=1, merge=2, max_side=32)
    assert grid == (1, 4, 8)  # 48x96 -> 16x32: aspect kept, nothing cropped
    pos = features.patch_positions(grid, 2)
    lit = patches.reshape(len(patches), -1).mean(1)
    np.testing.assert_allclose(lit[(pos[:, 1] < 2) & (pos[:, 2] < 4)], 1.0)
    np.testing.assert_allclose(lit[(pos[:, 1] >= 2) | (pos[:, 2] >= 4)], 0.0)


def test_log_mel_resolves_pitch():
    t = np.arange(4000) / 16000
    low, high = (features.log_mel(np.sin(2 * np.pi * f * t), n_mels=32) for f in (300.0, 3000.0))
    assert low.mean(0).argmax() < high.mean(0).argmax()


def test_bad_inputs_are_clear_errors():
    with pytest.raises(BadSample, match="empty image"):
        features.encoder_tokens("image", (0, 32, 3), VCFG)
    with pytest.raises(BadSample, match="empty image"):
        features.image_patches(np.zeros((16, 0, 3), np.float32), 4)
    with pytest.raises(BadSample, match="zero frames"):
        features.image_patches(np.zeros((0, 16, 16, 3), np.float32), 4, 2)
    with pytest.raises(BadSample, match="zero-length audio"):
        features.log_mel(np.zeros(0, np.float32))
    with pytest.raises(BadSample, match="zero-length audio"):
        features.encoder_tokens("audio", (0,), ACFG)
    with pytest.raises(BadSample, match="too small"):
        features.image_patches(np.zeros((3, 32, 3), np.float32), 4, merge=2)


# ------------------------------------------------------------------------------- attention
def test_packed_images_never_attend_across_images(vit):
    model, fwd = vit
    rng = np.random.default_rng(0)
    a, b = rng.random((16, 24, 3)).astype(np.float32), rng.random((3, 8, 8, 3)).astype(np.float32)
    xa, pa = features.segment_inputs("image", a, VCFG)
    xb, pb = features.segment_inputs("video", b, VCFG)
    na = len(xa)
    x = np.concatenate([xa, xb, np.zeros((8, xa.shape[1]), np.float32)])  # + padding rows
    s = np.concatenate([np.full(na, 1), np.full(len(xb), 2), np.zeros(8)]).astype(np.int32)
    p = np.concatenate([pa, pb, np.zeros((8, 3), np.int32)])
    out = np.asarray(fwd(model, x, s, p))
    x2 = x.copy()
    x2[na:na + len(xb)] = rng.random(xb.shape)  # change the second image only
    out2 = np.asarray(fwd(model, x2, s, p))
    np.testing.assert_allclose(out[: na // 4], out2[: na // 4], atol=1e-6)
    assert np.abs(out[na // 4:(na + len(xb)) // 4] - out2[na // 4:(na + len(xb)) // 4]).max() > 1e-3
    # the first image alone (other buffer size, other offset) gives the same features
    alone = np.asarray(jax.jit(lambda m, x, s, p: m(x, s, p))(model, xa, np.ones(na, np.int32), pa))
    np.testing.assert_allclose(out[: na // 4], alone, atol=1e-5)
    assert np.all(np.isfinite(out))  # padding rows attend to nothing and stay finite


def test_audio_clips_are_isolated(audio):
    model, fwd = audio
    rng = np.random.default_rng(1)
    clips = [rng.standard_normal(n).astype(np.float32) for n in (1600, 3000)]
    x, s, p = pack(clips, ACFG, "audio")
    n0 = int((s == 1).sum())
    out = np.asarray(fwd(model, x, s, p))
    x2 = x.copy()
    x2[n0:] += 1.0
    out2 = np.asarray(fwd(model, x2, s, p))
    np.testing.assert_allclose(out[: n0 // 4], out2[: n0 // 4], atol=1e-6)
    n1 = int((s == 2).sum())
    assert np.abs(out[n0 // 4:(n0 + n1) // 4] - out2[n0 // 4:(n0 + n1) // 4]).max() > 1e-3  # the changed clip did change
    assert out.shape == (len(x) // 4, ACFG.embed_dim)


def test_rope_handles_any_grid(vit):
    model, fwd = vit
    for shape in [(16, 64, 3), (64, 16, 3), (40, 40, 3)]:
        x, p = features.segment_inputs("image", np.random.default_rng(2).random(shape).astype(np.float32), VCFG)
        out = np.asarray(fwd(model, x, np.ones(len(x), np.int32), p))
        assert out.shape == (len(x) // 4, 4 * VCFG.embed_dim) and np.all(np.isfinite(out))
        # the positions reach the output: the same patches at transposed grid positions give other features
        swapped = np.asarray(fwd(model, x, np.ones(len(x), np.int32), p[:, [0, 2, 1]]))
        assert np.abs(swapped - out).max() > 1e-4


def test_costs_grow_with_size(vit, audio):
    v, _ = vit
    a, _ = audio
    assert v.cost((8, 32, 32, 3)) > 1.9 * v.cost((4, 32, 32, 3))  # frames x patches
    assert v.cost((64, 64, 3)) > 4 * v.cost((32, 32, 3))
    assert a.cost((32000,)) > 2 * a.cost((16000,))


def test_relative_coordinates_are_per_image():
    """Each patch's absolute-position features depend on (index + 0.5) / its own image's extent."""
    small, big = features.patch_positions((1, 2, 4), 2), features.patch_positions((2, 8, 16), 2)
    pos = np.concatenate([small, big, np.zeros((3, 3), np.int32)])
    seg = np.concatenate([np.full(len(small), 1), np.full(len(big), 2), np.zeros(3)]).astype(np.int32)
    f = np.asarray(relative_coordinate_features(pos, seg, 4)).reshape(len(pos), 3, 8)
    expect = np.sin(np.pi * (pos + 0.5) / np.concatenate([np.tile([1, 2, 4], (len(small), 1)),
                                                           np.tile([2, 8, 16], (len(big), 1)),
                                                           np.ones((3, 3))]))
    np.testing.assert_allclose(f[:, :, 0], expect, atol=1e-5)
    # so the centre-most cells of a 2x4 and an 8x16 grid agree, whatever their packed offsets
    assert np.isfinite(f).all()
