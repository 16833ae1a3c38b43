"""Qwen2.5-VL / Qwen2-VL as a starting point: the `qwen_vit` tower, M-RoPE and the folder reader, against
transformers run in-process on tiny random models saved with save_pretrained (weights widened so a wrong
load cannot hide behind near-zero values).

Checks: the vision tower (window + full layers, merger) equals Qwen2_5_VisionTransformerPretrainedModel on
three aspect ratios and a video in one packed buffer (and Qwen2-VL's tower); window attention matters (all
layers full attention is measurably different); M-RoPE positions equal `get_rope_index`; LLM logits and
the loss equal Qwen2_5_VLForConditionalGeneration on image, video and text-only prompts; a packed row of
three samples equals each sample run alone.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from omnijax.data import features  # noqa: E402
from omnijax.errors import UserError  # noqa: E402
from omnijax.interop import qwen_vl  # noqa: E402
from omnijax.data import qwen_processor as qp  # noqa: E402
from omnijax.mm_config import encoder_config  # noqa: E402
from omnijax.models.mllm import MultimodalModel, mm_loss  # noqa: E402

IMAGE, VIDEO, V_START, V_END = 120, 121, 122, 123
PATCH, TP, MERGE = 2, 2, 2


def _widen(model):
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.2)
    return model


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _text_cfg():
    return dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    root = tmp_path_factory.mktemp("qwen_vl")
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)
    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(text_config=_text_cfg(), vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH, temporal_patch_size=TP,
        spatial_merge_size=MERGE, window_size=8, out_hidden_size=32, fullatt_block_indexes=[1],
        tokens_per_second=2), tie_word_embeddings=False, **ids)
    cfg._attn_implementation = "eager"
    q25 = _widen(Qwen2_5_VLForConditionalGeneration(cfg)).eval()
    q25.save_pretrained(root / "qwen2_5_vl")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    processor = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=40 * 40, patch_size=PATCH,
                                         temporal_patch_size=TP, merge_size=MERGE)
    processor.save_pretrained(root / "qwen2_5_vl")
    cfg2 = Qwen2VLConfig(text_config=_text_cfg(), vision_config=dict(
        depth=2, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=PATCH, temporal_patch_size=TP,
        spatial_merge_size=MERGE), tie_word_embeddings=False, **ids)
    cfg2._attn_implementation = "eager"
    q2 = _widen(Qwen2VLForConditionalGeneration(cfg2)).eval()
    q2.save_pretrained(root / "qwen2_vl")
    return {"root": root, "qwen2_5_vl": q25, "qwen2_vl": q2, "processor": processor}


def _omni(folder):
    cfg, info = qwen_vl.config_from_folder(folder)
    model = nnx.eval_shape(lambda: MultimodalModel(cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, qwen_vl.load_params(folder, nnx.state(model, nnx.Param)))
    return model, cfg, info


GRIDS = [(1, 6, 10), (1, 8, 8), (1, 12, 4), (3, 6, 6)]  # three aspect ratios and a 6-frame video (t=3)


def _pixels(grid, seed):
    """HF's pixel rows [n, C*tp*p*p] (its processor's layout) and the same rows in omnijax's (tp, p, p, C)."""
    n = int(np.prod(grid))
    hf_rows = np.random.RandomState(seed).randn(n, 3 * TP * PATCH * PATCH).astype(np.float32)
    ours = hf_rows.reshape(n, 3, TP, PATCH, PATCH).transpose(0, 2, 3, 4, 1).reshape(n, -1)
    return hf_rows, ours


def _buffer(grids, pad=8):
    hf_rows, rows, pos, seg = [], [], [], []
    for i, g in enumerate(grids):
        h, o = _pixels(g, i)
        hf_rows.append(h), rows.append(o), pos.append(features.patch_positions(g, MERGE))
        seg.append(np.full(len(o), i + 1, np.int32))
    rows.append(np.zeros((pad, rows[0].shape[1]), np.float32))  # padding rows (segment 0) at the end
    pos.append(np.zeros((pad, 3), np.int32)), seg.append(np.zeros(pad, np.int32))
    return np.concatenate(hf_rows), *(np.concatenate(x) for x in (rows, pos, seg))


def _tower(model, rows, pos, seg):
    enc, merger = model.encoders["vision"], model.projectors["vision"]
    return jax.jit(lambda r, s, p: merger(enc(r, s, p)))(jnp.asarray(rows), jnp.asarray(seg), jnp.asarray(pos))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_vision_tower_matches_transformers(folders, family):
    model, cfg, _ = _omni(folders["root"] / family)
    hf_rows, rows, pos, seg = _buffer(GRIDS)
    with torch.no_grad():
        ref = folders[family].model.visual(torch.tensor(hf_rows), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    out = np.asarray(_tower(model, rows, pos, seg))
    n = len(ref)
    assert out.shape[0] == n + 2 and _rel(out[:n], ref) < 1e-4
    if family == "qwen2_5_vl":  # the windows are real: the same weights with every layer full differ
        full = dataclasses.replace(encoder_config("vision", cfg.encoders["vision"]), window_size=0)
        alt = nnx.eval_shape(lambda: MultimodalModel(dataclasses.replace(
            cfg, encoders={"vision": dataclasses.asdict(full)}), rngs=nnx.Rngs(0)))
        nnx.update(alt, nnx.state(model, nnx.Param))
        assert _rel(np.asarray(_tower(alt, rows, pos, seg))[:n], ref) > 1e-3


def test_window_and_frame_ids():
    from omnijax.models.qwen_vision import attention_ids

    pos = features.patch_positions((2, 4, 8), MERGE)
    seg = np.ones(len(pos), np.int32)
    frame, window = map(np.asarray, attention_ids(jnp.asarray(seg), jnp.asarray(pos), 4))
    assert len(set(frame.tolist())) == 2 and len(set(window.tolist())) == 4
    for i in range(len(pos)):  # same window <=> same (t, h // 4, w // 4)
        same = (pos[:, 0] == pos[i, 0]) & (pos[:, 1] // 4 == pos[i, 1] // 4) & (pos[:, 2] // 4 == pos[i, 2] // 4)
        assert np.array_equal(window == window[i], same)


# ------------------------------------------------------------------------------ LLM + M-RoPE
def _sample(kind, grid=None, before=3, after=4, seed=0):
    """(tokens, segments for rope_index, mm types, grid): text, <start> placeholders <end>, text."""
    rng = np.random.RandomState(seed)
    tok = list(rng.randint(0, 100, before))
    segs = []
    if kind == "text":
        tok += list(rng.randint(0, 100, after))
        return np.asarray(tok), [("text", len(tok))], np.zeros(len(tok), np.int32)
    n = int(np.prod(grid)) // (MERGE * MERGE)
    tok += [V_START] + [IMAGE if kind == "image" else VIDEO] * n + [V_END] + list(rng.randint(0, 100, after))
    segs = [("text", before + 1), (kind, grid), ("text", after + 1)]
    types = np.zeros(len(tok), np.int32)
    types[before + 1:before + 1 + n] = 1 if kind == "image" else 2
    return np.asarray(tok), segs, types


def _hf_forward(hf_model, tokens, types, grid, kind):
    kw = {}
    if kind == "image":
        kw = dict(pixel_values=torch.tensor(_pixels(grid, 7)[0]), image_grid_thw=torch.tensor([grid]))
    elif kind == "video":
        kw = dict(pixel_values_videos=torch.tensor(_pixels(grid, 7)[0]), video_grid_thw=torch.tensor([grid]))
    ids = torch.tensor(tokens[None])
    labels = ids.clone()
    with torch.no_grad():
        out = hf_model(input_ids=ids, mm_token_type_ids=torch.tensor(types[None]), labels=labels, **kw)
        pos = None
        if kind != "text":
            pos, _ = hf_model.model.get_rope_index(ids, torch.tensor(types[None]),
                                                   image_grid_thw=kw.get("image_grid_thw"),
                                                   video_grid_thw=kw.get("video_grid_thw"))
    return out.logits[0].numpy(), float(out.loss), pos


CASES = [("image", (1, 6, 10)), ("image", (1, 12, 4)), ("video", (3, 6, 6)), ("text", None)]


def _batch(samples, length, tokens_per_second=2.0):
    """One packed row of `samples` [(tokens, segs, types, grid, kind)] padded to `length`."""
    toks, seg, pos, rpos, targets, mask = [], [], [], [], [], []
    vis_rows, vis_pos, vis_seg, dest = [], [], [], []
    offset = 0
    for i, (tokens, segs, types, grid, kind) in enumerate(samples):
        n = len(tokens)
        toks.append(tokens), seg.append(np.full(n, i + 1)), pos.append(np.arange(n))
        rpos.append(qp.rope_index(segs, MERGE, tokens_per_second))
        targets.append(np.concatenate([tokens[1:], [0]])), mask.append(np.r_[np.ones(n - 1), 0.0])
        if kind != "text":
            rows = _pixels(grid, 7)[1]
            vis_rows.append(rows), vis_pos.append(features.patch_positions(grid, MERGE))
            vis_seg.append(np.full(len(rows), len(vis_seg) + 1))
            dest.append(offset + np.flatnonzero(types))
        offset += n
    pad = length - offset
    cat = lambda xs, fill, shape=(): np.concatenate(xs + [np.full((pad,) + shape, fill)])  # noqa: E731
    batch = {"tokens": cat(toks, 0)[None], "segment_ids": cat(seg, 0)[None], "positions": cat(pos, 0)[None],
             "rope_positions": cat(rpos, 0, (3,))[None], "targets": cat(targets, 0)[None],
             "loss_mask": cat(mask, 0.0)[None]}
    if vis_rows:
        batch.update(vision_inputs=np.concatenate(vis_rows), vision_positions=np.concatenate(vis_pos),
                     vision_segment_ids=np.concatenate(vis_seg), vision_dest=np.concatenate(dest))
    return {k: jnp.asarray(v.astype(np.float32 if k.endswith(("inputs", "loss_mask")) else np.int32))
            for k, v in batch.items()}


@pytest.fixture(scope="module")
def omni_models(folders):
    """family -> (model, jitted forward, jitted loss, tokens_per_second), built once."""
    out = {}
    for family in ("qwen2_5_vl", "qwen2_vl"):
        model, cfg, info = _omni(folders["root"] / family)
        tps = encoder_config("vision", cfg.encoders["vision"]).tokens_per_second
        out[family] = (model, jax.jit(lambda b, m=model: m(b)[0]), jax.jit(lambda b, m=model: mm_loss(m, b)[:2]), tps)
    return out


@pytest.fixture(scope="module")
def omni25(omni_models):
    return omni_models["qwen2_5_vl"][:3]


@pytest.mark.parametrize("family,kind,grid", [("qwen2_5_vl", *c) for c in CASES]
                         + [("qwen2_vl", "video", (3, 6, 6)), ("qwen2_vl", "image", (1, 8, 8))])
def test_llm_logits_loss_and_positions_match_transformers(folders, omni_models, family, kind, grid):
    _, forward, loss, tps = omni_models[family]
    tokens, segs, types = _sample(kind, grid)
    ref_logits, ref_loss, ref_pos = _hf_forward(folders[family], tokens, types, grid, kind)
    if ref_pos is not None:  # position ids equal get_rope_index's
        assert np.array_equal(qp.rope_index(segs, MERGE, tps), ref_pos[:, 0].numpy().T)
    batch = _batch([(tokens, segs, types, grid, kind)], len(tokens) + 5, tps)
    n = len(tokens)
    assert _rel(np.asarray(forward(batch))[0, :n], ref_logits) < 1e-4
    loss_sum, count = loss(batch)
    assert int(count) == n - 1 and abs(float(loss_sum) / float(count) - ref_loss) / ref_loss < 1e-4
    if (family, kind, grid) == ("qwen2_5_vl", *CASES[0]):  # M-RoPE is real: one position per token gives other logits
        plain = {k: v for k, v in batch.items() if k != "rope_positions"}
        assert _rel(np.asarray(forward(plain))[0, :n], ref_logits) > 1e-3


def test_packed_row_equals_samples_alone(folders, omni25):
    _, forward, loss = omni25
    samples = []
    for seed, (kind, grid) in enumerate([("image", (1, 6, 10)), ("text", None), ("video", (3, 6, 6))]):
        samples.append((*_sample(kind, grid, before=2 + seed, seed=seed), grid, kind))
    total = sum(len(s[0]) for s in samples)
    packed = np.asarray(forward(_batch(samples, total + 3)))[0]
    start, sums = 0, 0.0
    for s in samples:
        n = len(s[0])
        alone_batch = _batch([s], total + 3)  # one row length for all: one compiled program
        alone = np.asarray(forward(alone_batch))[0, :n]
        assert _rel(packed[start:start + n], alone) < 1e-5
        ref_logits, ref_loss, _ = _hf_forward(folders["qwen2_5_vl"], *s[:1], s[2], s[3], s[4])
        assert _rel(alone, ref_logits) < 1e-4
        sums += float(loss(alone_batch)[0])
        start += n
    assert abs(float(loss(_batch(samples, total + 3))[0]) - sums) / sums < 1e-5


def test_rope_index_rules():
    pos = qp.rope_index([("text", 2), ("image", (1, 4, 6)), ("text", 2)], merge=2)
    assert pos[:2].tolist() == [[0, 0, 0], [1, 1, 1]]
    grid = pos[2:8]  # 2 x 3 merged tokens starting at 2
    assert grid[:, 0].tolist() == [2] * 6 and grid[:, 1].tolist() == [2, 2, 2, 3, 3, 3]
    assert grid[:, 2].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[8:].tolist() == [[5, 5, 5], [6, 6, 6]]  # continues after max(h, w) / merge = 3
    video = qp.rope_index([("video", (3, 2, 2), 0.5)], merge=2, tokens_per_second=4)
    assert video[:, 0].tolist() == [0, 2, 4]


def test_bad_folder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UserError, match="not a Qwen2-VL"):
        qwen_vl.config_from_folder(tmp_path)


# ------------------------------------------------------------------------------ preprocessing
@pytest.mark.parametrize("hw", [(50, 23), (30, 90), (64, 64), (9, 12), (200, 150)])
def test_image_processor_matches_transformers(folders, hw):
    """preprocessor_config.json's min/max pixels and normalisation, read by the folder reader, give the rows
    and the grid Qwen2VLImageProcessor gives (smart resize: upscaled, downscaled and in between)."""
    cfg, _ = qwen_vl.config_from_folder(folders["root"] / "qwen2_5_vl")
    vcfg = encoder_config("vision", cfg.encoders["vision"])
    assert (vcfg.min_pixels, vcfg.max_pixels) == (16 * 16, 40 * 40)
    img = np.random.RandomState(sum(hw)).randint(0, 256, (*hw, 3)).astype(np.uint8)
    ref = folders["processor"](images=[img], return_tensors="np")
    grid = tuple(int(g) for g in ref["image_grid_thw"][0])
    n = int(np.prod(grid))
    ref_rows = ref["pixel_values"].reshape(n, 3, TP, PATCH, PATCH).transpose(0, 2, 3, 4, 1).reshape(n, -1)
    rows, pos = features.segment_inputs("image", img.astype(np.float32) / 255.0, cfg)  # decoded pixels in [0, 1]
    assert rows.shape == ref_rows.shape and np.max(np.abs(rows - ref_rows)) < 1e-5
    assert np.array_equal(pos, features.segment_positions("image", img.shape, cfg))
    from omnijax.mm_config import encoder_tokens
    assert encoder_tokens("image", img.shape, cfg) == (n, n // (MERGE * MERGE))


def test_video_frames_and_time_alignment():
    from omnijax.data import qwen_processor as qp

    # 10 s at 30 fps sampled at 2 fps: 20 frames, every 15th
    assert qp.sample_frames(300, 30.0, 2.0).tolist() == list(range(0, 300, 15))
    # short clip: at least min_frames (4), a multiple of temporal_patch, never more than the clip
    assert qp.sample_frames(6, 30.0, 2.0).tolist() == [0, 1, 3, 4]
    assert len(qp.sample_frames(10_000, 30.0, 2.0, max_frames=64)) == 64
    assert qp.seconds_per_grid(2, 2.0) == 1.0
    # 5 frames: the last is repeated to fill the third temporal patch, as the video processor pads
    cfg = dataclasses.replace(qwen_vl_tiny_vision(), min_pixels=16, max_pixels=8 * 8)
    video = np.random.RandomState(0).rand(5, 8, 8, 3).astype(np.float32)
    rows, grid = qp.patch_rows(video, cfg)
    assert grid == (3, 4, 4)
    last = rows.reshape(3, 16, TP, PATCH, PATCH, 3)[2]
    assert np.array_equal(last[:, 0], last[:, 1])


def qwen_vl_tiny_vision():
    from omnijax.mm_config import QwenVisionConfig
    return QwenVisionConfig(patch=PATCH, temporal_patch=TP, merge=MERGE, window_size=8, embed_dim=32, num_heads=2)


def test_export_loads_in_transformers_with_omnijax_logits(folders, tmp_path):
    """Changed parameters written back under the original names: transformers loads the folder and its
    logits equal omnijax's; names, shapes and dtypes are the source's."""
    from safetensors import safe_open
    from transformers import Qwen2_5_VLForConditionalGeneration

    src = folders["root"] / "qwen2_5_vl"
    model, _, _ = _omni(src)
    params = nnx.state(model, nnx.Param)
    moved = jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)), params)
    nnx.update(model, moved)
    qwen_vl.export(moved, tmp_path / "out", like=src)
    with safe_open(src / "model.safetensors", "np") as a, safe_open(tmp_path / "out" / "model.safetensors", "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    assert (tmp_path / "out" / "preprocessor_config.json").exists()
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens, segs, types = _sample("image", (1, 6, 10))
    ref_logits, _, _ = _hf_forward(hf_model, tokens, types, (1, 6, 10), "image")
    logits = np.asarray(jax.jit(lambda b: model(b)[0])(_batch([(tokens, segs, types, (1, 6, 10), "image")], 40)))
    assert _rel(logits[0, :len(tokens)], ref_logits) < 1e-4
    old_logits, _, _ = _hf_forward(folders["qwen2_5_vl"], tokens, types, (1, 6, 10), "image")
    assert _rel(old_logits, ref_logits) > 1e-3  # the export carries the changed weights


def test_sample_rope_positions_from_metadata_equal_get_rope_index(folders):
    """A sample's positions from its metadata alone (shapes -> smart-resized grids, videos timed at the rate
    their frames were kept) equal get_rope_index's with the processor's grids and second_per_grid_ts."""
    from omnijax.data import qwen_processor as qp
    from omnijax.data.sample import SegmentMeta

    cfg, _ = qwen_vl.config_from_folder(folders["root"] / "qwen2_5_vl")
    vcfg = encoder_config("vision", cfg.encoders["vision"])
    img = np.zeros((50, 23, 3), np.uint8)
    image_grid = folders["processor"](images=[img], return_tensors="np")["image_grid_thw"]
    metas = [SegmentMeta("text", (3,)), SegmentMeta("image", img.shape), SegmentMeta("text", (4,)),
             SegmentMeta("video", (6, 30, 40, 3)), SegmentMeta("text", (2,))]
    ours = qp.sample_rope_positions(metas, vcfg, video_fps=1.0)
    video_grid = np.asarray([qp.qwen_grid((6, 30, 40, 3), vcfg)])
    n_img, n_vid = int(np.prod(image_grid[0])) // 4, int(np.prod(video_grid[0])) // 4
    types = np.r_[np.zeros(3), np.ones(n_img), np.zeros(4), np.full(n_vid, 2), np.zeros(2)].astype(np.int64)
    ids = torch.zeros(1, len(types), dtype=torch.long)
    ref, _ = folders["qwen2_5_vl"].model.get_rope_index(
        ids, torch.tensor(types[None]), image_grid_thw=torch.tensor(image_grid), video_grid_thw=torch.tensor(video_grid),
        second_per_grid_ts=torch.tensor([TP / 1.0]))
    assert ours.shape == (len(types), 3) and np.array_equal(ours, ref[:, 0].numpy().T)
    assert ours[3 + n_img + 4:][:, 0].max() > ours[3 + n_img + 4, 0] + 2  # time steps of 2 * 2 s per patch


def test_stages_are_the_folders_parts_and_gradients_reach_the_tower(folders, omni_models):
    """trainer.trainable's parts of a Qwen2.5-VL model: `vision` is the tower, `projector` the merger, `llm` the
    language model (sizes equal to the folder's visual.* without/with merger and the rest); the loss's
    gradient reaches every tower weight through window and full attention."""
    from safetensors import safe_open
    from omnijax.train.parts import Partition

    model = omni_models["qwen2_5_vl"][0]
    params = nnx.state(model, nnx.Param)
    sizes = Partition(params, ["projector"]).sizes
    with safe_open(folders["root"] / "qwen2_5_vl" / "model.safetensors", "np") as f:
        count = lambda keep: sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys() if keep(k))  # noqa: E731
        merger = count(lambda k: k.startswith("visual.merger."))
        tower = count(lambda k: k.startswith("visual.")) - merger
        llm = count(lambda k: not k.startswith("visual."))
    assert sizes == {"llm": llm, "vision": tower, "projector": merger}
    assert Partition(params, ["vision", "merger"]).trainable == ["vision", "projector"]  # trainer.trainable's names
    tokens, segs, types = _sample("image", (1, 6, 10))
    batch = _batch([(tokens, segs, types, (1, 6, 10), "image")], len(tokens) + 5)
    graph, rest = nnx.split(model, nnx.Param)

    def loss(p):
        s, c, _ = mm_loss(nnx.merge(graph, p), batch)
        return s / c
    grads = jax.jit(jax.grad(loss))(rest)
    tower_grads = jax.tree.leaves(grads["encoders"]["vision"])
    assert all(bool(jnp.all(jnp.isfinite(g))) and float(jnp.max(jnp.abs(g))) > 0 for g in tower_grads)


def test_video_split_over_esp_keeps_windows(folders):
    """A video split over a sequence-parallel group (esp=2, Ulysses attention): every device labels the windows
    and frames alike, so the split tower equals the whole one."""
    from jax.sharding import Mesh, PartitionSpec as P

    from omnijax.layers import attention as attention_lib, sequence
    from omnijax.parallel.multiplex import ulysses_attention

    model, _, _ = _omni(folders["root"] / "qwen2_5_vl")
    grid = (2, 8, 8)  # 128 rows: 64 per device, whole 2x2 merge groups on each
    _, rows, pos, seg = _buffer([grid], pad=0)
    whole = np.asarray(_tower(model, rows, pos, seg))
    enc, merger = model.encoders["vision"], model.projectors["vision"]
    graph, state = nnx.split(enc)

    def split_run(st, x, s, p):
        with attention_lib.use_attention(ulysses_attention(("esp",))), sequence.use_sequence_group(("esp",)):
            return nnx.merge(graph, st)(x, s, p)

    mesh = Mesh(np.array(jax.devices()[:2]), ("esp",))
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, P()))
    hidden = jax.jit(jax.shard_map(split_run, mesh=mesh, in_specs=(P(),) + (P("esp"),) * 3, out_specs=P("esp"),
                                   check_vma=False))(state, jnp.asarray(rows), jnp.asarray(seg), jnp.asarray(pos))
    split = np.asarray(jax.jit(lambda h: merger(h))(jax.device_get(hidden)))
    assert _rel(split, whole) < 1e-5


def test_greedy_decode_of_an_image_prompt_equals_transformers_generate(folders, omni25):
    """The LLM's KV-cache path with M-RoPE (prefill over the prompt's rope_positions, each new token at its slot
    plus transformers' rope delta) gives the tokens and every step's logits (1e-4) of
    Qwen2_5_VLForConditionalGeneration.generate, greedy; without the delta the logits differ."""
    from omnijax.models.llm import init_cache

    model = omni25[0]
    grid, steps = (1, 6, 10), 4
    tokens, segs, types = _sample("image", grid)
    with torch.no_grad():
        gen = folders["qwen2_5_vl"].generate(
            input_ids=torch.tensor(tokens[None]), mm_token_type_ids=torch.tensor(types[None]),
            pixel_values=torch.tensor(_pixels(grid, 7)[0]), image_grid_thw=torch.tensor([grid]),
            max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_tokens = gen.sequences[0, len(tokens):].numpy().tolist()
    ref_logits = np.stack([x[0].numpy() for x in gen.logits])
    n, slots = len(tokens), len(tokens) + steps + 2
    batch = _batch([(tokens, segs, types, grid, "image")], slots)
    llm = model.llm
    prefill = jax.jit(lambda b, c: llm.prefill(model.embed(b), b["segment_ids"], b["positions"], jnp.array([n - 1]), c,
                                               rope_positions=b["rope_positions"]))
    decode = jax.jit(lambda t, p, d, c: llm.decode(t, p, c, rope_positions=jnp.repeat((p + d)[:, None], 3, axis=1)))

    def run(delta):
        logits, cache = prefill(batch, init_cache(llm.config, 1, slots))
        toks, steps_logits = [], [np.asarray(logits[0])]
        for i in range(steps - 1):
            tok = jnp.asarray([ref_tokens[i]], jnp.int32)  # teacher-forced on transformers' tokens
            toks.append(int(jnp.argmax(logits[0])))
            logits, cache = decode(tok, jnp.array([n + i], jnp.int32), jnp.int32(delta), cache)
            steps_logits.append(np.asarray(logits[0]))
        return toks + [int(np.argmax(steps_logits[-1]))], np.stack(steps_logits)

    delta = qp.decode_delta(np.asarray(batch["rope_positions"][0]), n)
    assert delta < 0  # the image's 15 tokens span 5 positions
    toks, logits = run(delta)
    assert toks == ref_tokens and _rel(logits, ref_logits) < 1e-4
    assert _rel(run(0)[1][1:], ref_logits[1:]) > 1e-4  # the delta matters for every generated token


def test_generator_answers_an_image_and_a_video_prompt_as_transformers_generate(folders, tmp_path):
    """serve.generate on a Qwen2.5-VL folder (qwen_vl.load_model): the prompt's M-RoPE positions from the packer,
    each new token at its slot plus its row's rope delta; two prompts decoded in one batch (an image, a video
    at 1 fps) give transformers' greedy tokens for each (with the delta left out, the video's answer departs
    from transformers' at its 9th token)."""
    from omnijax.data.sample import Sample, Segment
    from omnijax.mm_config import qwen_grid
    from omnijax.serve.generate import Generator, SamplingConfig

    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(1)  # weights at N(0, 0.05): the answers do not collapse onto one token (the delta shows)
    hf_model = Qwen2_5_VLForConditionalGeneration(folders["qwen2_5_vl"].config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else None
    folder = tmp_path / "qwen"
    hf_model.save_pretrained(folder)
    model = qwen_vl.load_model(folder)
    cfg, info = qwen_vl.config_from_folder(folder)
    vcfg = encoder_config("vision", cfg.encoders["vision"])
    rng = np.random.RandomState(3)
    media = [("image", rng.rand(20, 28, 3).astype(np.float32), 0.0), ("video", rng.rand(4, 12, 16, 3).astype(np.float32), 1.0)]
    prompts = [Sample((Segment("text", rng.randint(0, 100, 3).astype(np.int32)), Segment(kind, x, fps=fps),
                       Segment("text", rng.randint(0, 100, 4).astype(np.int32)))) for kind, x, fps in media]
    gen = Generator(model, placeholder={"image": IMAGE, "video": VIDEO})
    ours = gen.generate(prompts, SamplingConfig(max_new_tokens=16), batch_size=2)
    for prompt, got, (kind, x, fps) in zip(prompts, ours, media):
        rows, _ = features.segment_inputs(kind, x, cfg)
        n, grid = rows.shape[0], qwen_grid(x.shape, vcfg)
        hf_rows = rows.reshape(n, TP, PATCH, PATCH, 3).transpose(0, 4, 1, 2, 3).reshape(n, -1)
        ids = np.asarray(got.prompt_tokens)
        types = np.where(ids == (IMAGE if kind == "image" else VIDEO), 1 if kind == "image" else 2, 0)
        kw = ({"pixel_values": torch.tensor(hf_rows), "image_grid_thw": torch.tensor([grid])} if kind == "image" else
              {"pixel_values_videos": torch.tensor(hf_rows), "video_grid_thw": torch.tensor([grid]),
               "second_per_grid_ts": torch.tensor([TP / fps])})
        with torch.no_grad():
            ref = hf_model.generate(input_ids=torch.tensor(ids[None]), mm_token_type_ids=torch.tensor(types[None]),
                                                 max_new_tokens=16, do_sample=False, eos_token_id=None, **kw)
        assert got.tokens == ref[0, len(ids):].tolist(), (kind, got.tokens)


def test_init_model_resolves_the_whole_model_and_loads_its_weights(folders, tmp_path):
    """finetune's `init.model=DIR` (omnijax.train.warmstart): model.* and the tokenizer path are the folder's, the
    recipe's capacities for other encoders are dropped (an explicit one stays), an override that disagrees is one
    line, the parameters are the folder's, and export follows a later stage back to the folder."""
    import json

    from omnijax.errors import ConfigError
    from omnijax.train import warmstart
    from recipes.finetune import FinetuneConfig

    folder = str(folders["root"] / "qwen2_5_vl")
    cfg = FinetuneConfig()
    cfg.capacity = {"vision": 512, "audio": 1024}
    cfg.init.model = folder
    cfg = warmstart.resolve_init(cfg, [f"init.model={folder}"])
    want, _ = qwen_vl.config_from_folder(folder)
    assert cfg.model == want and cfg.tokenizer.path == folder and cfg.capacity == {}
    bad = FinetuneConfig()
    bad.init.model = folder
    with pytest.raises(ConfigError, match="model.llm.num_layers=3 disagrees"):
        warmstart.resolve_init(bad, [f"init.model={folder}", "model.llm.num_layers=3"])
    model = nnx.eval_shape(lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(0)))
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nnx.state(model, nnx.Param))
    params = warmstart.initial_params(cfg, zeros, "test")
    ref = folders["qwen2_5_vl"].state_dict()
    got = np.asarray(params["encoders"]["vision"]["patch_embed"][...])
    assert np.array_equal(got, ref["model.visual.patch_embed.proj.weight"].numpy())
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    for run, init in ((stage1, {"model": folder}), (stage2, {"checkpoint": str(stage1)})):
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"init": init, "tokenizer": {"path": folder}}))
    assert warmstart.origins(stage2)["model"] == folder
