"""The tiny Qwen2.5-VL folder `recipes example_models model=qwen2_5_vl` writes, against transformers on that folder:

- conversations (LLaVA-style records: tagged and untagged images, a video, several turns, text only) become the
  token ids `AutoProcessor` + `apply_chat_template` give for the same conversation, for training (`convert`'s
  layout) and for generation prompts (`generate`'s), each image/video as `<|vision_start|>`, its pad tokens,
  `<|vision_end|>`; their M-RoPE positions equal `get_rope_index`'s on those ids, and the logits and loss on them
  equal Qwen2_5_VLForConditionalGeneration's;
- `export` of a LoRA run from `init.model` writes the LLM's adapters in PEFT's format beside the folder (the vision
  tower's merged into it): PeftModel over transformers' model gives omnijax's logits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from recipes.__main__ import main  # noqa: E402

TAGS = {"<image>": "image", "<video>": "video"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """example_data's media and tokenizer, the tiny Qwen2.5-VL folder over them, and a few records."""
    root = tmp_path_factory.mktemp("qwen_folder")
    assert main(["example_data", f"output={root}/data", "train=24", "eval=2", "llava=24"]) == 0
    assert main(["example_models", "model=qwen2_5_vl", f"output={root}/qwen", f"tokenizer={root}/data/tokenizer",
                 "llm_width=32", "encoder_width=32"]) == 0
    llava = json.loads((root / "data" / "train_llava.json").read_text())
    image = next(r for r in llava if "image" in r and "corrupt" not in r["image"])
    video = next(r for r in llava if "video" in r and "corrupt" not in r["video"])
    images = [r["image"] for r in llava if "image" in r and "corrupt" not in r["image"]][:3]
    records = [
        image,                                                   # "<image>\nQ: ...", one answer
        video,                                                   # "<video>\nQ: ..."
        {"image": images[1], "conversations": [                  # untagged: first in the first user turn
            {"from": "system", "value": "Answer briefly."}, {"from": "human", "value": "What shape?"},
            {"from": "gpt", "value": "A circle."}, {"from": "human", "value": "And its colour?"},
            {"from": "gpt", "value": "Red."}]},
        {"image": images[1:3], "conversations": [                # two tags inside the text
            {"from": "human", "value": "Is <image> the same as <image>?"}, {"from": "gpt", "value": "No."}]},
        {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]},
    ]
    return {"root": root, "folder": root / "qwen", "data": root / "data", "records": records}


def _hf_messages(rec: dict, markers: bool = True) -> list[dict]:
    """The record as transformers' list contents: each tag an image/video item, untagged media first in the first
    user turn (Qwen's own order: the media items, then the text)."""
    turns = [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
             for t in rec["conversations"]]
    out = []
    for k, t in enumerate(turns):
        items, text = [], t["content"]
        first_user = t["role"] == "user" and all(u["role"] != "user" for u in turns[:k])
        if first_user:
            for kind in ("image", "video"):
                files = rec.get(kind, [])
                files = [files] if isinstance(files, str) else files
                if files and not any(f"<{kind}>" in u["content"] for u in turns):
                    items += [{"type": kind}] * len(files)
        while text:
            cut = min([(text.find(tag), tag) for tag in TAGS if tag in text], default=None)
            if cut is None:
                items.append({"type": "text", "text": text})
                break
            if cut[0]:
                items.append({"type": "text", "text": text[:cut[0]]})
            items.append({"type": TAGS[cut[1]]})
            text = text[cut[0] + len(cut[1]):]
        out.append({"role": t["role"], "content": items})
    return out


def _media_of(rec: dict) -> list[tuple[str, str]]:
    """(kind, path) in the order the conversation uses them."""
    out = []
    for kind in ("image", "video"):
        files = rec.get(kind, [])
        out += [(kind, f) for f in ([files] if isinstance(files, str) else files)]
    return out


def _ours(qwen, rec: dict, prompt: bool):
    """(flat, samples' segments): omnijax's token run of a record, as convert lays it out for training, or as
    generate reads a prompt (the answer dropped)."""
    from omnijax.data import formats, media, packing
    from omnijax.data.sample import Sample, Segment
    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.interop import qwen_vl

    tok = load_tokenizer(str(qwen["folder"]))
    cfg, _ = qwen_vl.config_from_folder(qwen["folder"])
    resolve = lambda s: qwen["data"] / s  # noqa: E731
    load = media.rated(media.load_media)
    parts = (formats.prompt if prompt else formats.build)(rec, tok, load, resolve, "rec")
    segs = tuple(Segment(m, media.Rated.value_of(v), bool(loss), fps=media.Rated.fps_of(v))
                 for m, v, loss, *_ in parts if not (m == "text" and len(media.Rated.value_of(v)) == 0))
    return packing.flatten(Sample(segs, "rec", 0), cfg, packing.encoder_specs(cfg), tok.placeholder), segs, cfg


def _hf_inputs(processor, rec: dict, segs, prompt: bool) -> dict:
    """transformers' processor on the same conversation and the same decoded pixels (frames as omnijax kept them,
    not resampled)."""
    messages = _hf_messages(rec)
    if prompt:
        while messages[-1]["role"] == "assistant":
            messages.pop()
    text = processor.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
    images = [(s.data * 255).round().astype(np.uint8) for s in segs if s.modality == "image"]
    videos = [(s.data * 255).round().astype(np.uint8) for s in segs if s.modality == "video"]
    # each video's frames at the rate omnijax kept them (what its temporal positions step by)
    meta = [{"total_num_frames": len(v), "fps": s.fps, "frames_indices": list(range(len(v)))}
            for v, s in zip(videos, [s for s in segs if s.modality == "video"])]
    kw = dict(videos=videos, video_metadata=meta, do_sample_frames=False) if videos else {}
    return processor(text=[text], images=images or None, return_tensors="pt", **kw)


@pytest.fixture(scope="module")
def hf(qwen):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(qwen["folder"])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen["folder"], attn_implementation="eager").eval()
    return processor, model


def test_conversation_tokens_and_positions_equal_the_processors(qwen, hf):
    """Training and prompt token ids equal AutoProcessor + apply_chat_template's, media wrapped in vision
    start/end; the M-RoPE positions of those ids equal get_rope_index's."""
    processor, model = hf
    folder = qwen["folder"]
    cfg = json.loads((folder / "config.json").read_text())
    seen = set()
    for k, rec in enumerate(qwen["records"]):
        for prompt in (False, True):
            flat, segs, _ = _ours(qwen, rec, prompt)
            ref = _hf_inputs(processor, rec, segs, prompt)
            ids = ref["input_ids"][0].numpy()
            assert flat.tokens.tolist() == ids.tolist(), (k, prompt)
            kinds = {s.modality for s in segs}
            seen |= kinds
            if kinds - {"text"}:
                with torch.no_grad():
                    pos, _ = model.model.get_rope_index(
                        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref.get("image_grid_thw"),
                        video_grid_thw=ref.get("video_grid_thw"), second_per_grid_ts=ref.get("second_per_grid_ts"))
                assert np.array_equal(flat.rope, pos[:, 0].numpy().T), (k, prompt)
            for kind in kinds - {"text"}:  # <|vision_start|> pads <|vision_end|>, nothing else around them
                pad = cfg[f"{kind}_token_id"]
                runs = np.flatnonzero(np.diff(np.r_[0, ids == pad, 0]))
                for a, b in runs.reshape(-1, 2):
                    assert ids[a - 1] == cfg["vision_start_token_id"] and ids[b] == cfg["vision_end_token_id"]
    assert seen == {"text", "image", "video"}


def _omni_model(folder, lora=None):
    from flax import nnx

    from omnijax.interop import qwen_vl
    from omnijax.models import adapters
    from omnijax.models.mllm import MultimodalModel

    cfg, _ = qwen_vl.config_from_folder(folder)
    model = nnx.eval_shape(lambda: adapters.attach(MultimodalModel(cfg, rngs=nnx.Rngs(0)), lora))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    base, extra = adapters.split(params)
    base = qwen_vl.load_params(folder, base)
    return cfg, graph, adapters.join(base, extra) if extra else base, rest


def _hf_pixels(segs, cfg) -> dict:
    """omnijax's own pixel rows in transformers' (C, tp, p, p) order (one image or one video)."""
    from omnijax.data import features
    from omnijax.mm_config import encoder_config, qwen_grid

    vcfg = encoder_config("vision", cfg.encoders["vision"])
    (seg,) = [s for s in segs if s.modality != "text"]
    rows, _ = features.segment_inputs(seg.modality, seg.data, cfg)
    n, tp, p = rows.shape[0], vcfg.temporal_patch, vcfg.patch
    hf_rows = torch.tensor(rows.reshape(n, tp, p, p, 3).transpose(0, 4, 1, 2, 3).reshape(n, -1))
    grid = torch.tensor([qwen_grid(seg.data.shape, vcfg)])
    if seg.modality == "image":
        return {"pixel_values": hf_rows, "image_grid_thw": grid}
    return {"pixel_values_videos": hf_rows, "video_grid_thw": grid,
            "second_per_grid_ts": torch.tensor([tp / seg.fps])}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _batch_of(flats, cfg, row_len: int = 128) -> dict:
    """One row per sample, packed as the trainer packs (one compiled shape for every check here)."""
    import jax.numpy as jnp

    from omnijax.data import packing

    specs = packing.encoder_specs(cfg)
    layout = packing.Layout(len(flats), row_len, (("vision", 256),))
    batch = packing.pack([[(f, r) for r, f in enumerate(flats)]], layout, specs)
    return {k: jnp.asarray(v) for k, v in batch.items()}


@pytest.fixture(scope="module")
def cases(qwen):
    """The multi-turn image conversation and the video one, laid out for training."""
    return [_ours(qwen, qwen["records"][k], False) for k in (2, 1)]


def test_logits_and_loss_on_the_processors_tokens_equal_transformers(qwen, hf, cases):
    """With the vision start/end tokens in place, omnijax's logits (1e-4) and its loss over the assistant's tokens
    equal Qwen2_5_VLForConditionalGeneration's on the same ids and pixels."""
    import jax
    from flax import nnx

    from omnijax.models.mllm import mm_loss

    _, model = hf
    cfg, graph, params, rest = _omni_model(qwen["folder"])
    batch = _batch_of([c[0] for c in cases], cfg)
    logits, (loss_sum, count) = jax.jit(lambda p, b: (lambda m: (m(b)[0], mm_loss(m, b)[:2]))(
        nnx.merge(graph, p, rest)))(params, batch)
    ref_sum, ref_count = 0.0, 0
    for row, (flat, segs, _) in enumerate(cases):
        ids = torch.tensor(flat.tokens[None], dtype=torch.long)
        labels = torch.where(torch.tensor(np.r_[False, flat.loss[1:]][None]), ids, -100)
        video = any(s.modality == "video" for s in segs)
        types = torch.tensor(np.isin(flat.tokens, _pads(qwen)).astype(np.int64)[None]) * (2 if video else 1)
        with torch.no_grad():
            out = model(input_ids=ids, mm_token_type_ids=types, labels=labels, **_hf_pixels(segs, cfg))
        n = len(flat.tokens)
        assert _rel(np.asarray(logits[row, :n]), out.logits[0].numpy()) < 1e-4, row
        k = int((labels != -100).sum())
        ref_sum, ref_count = ref_sum + float(out.loss) * k, ref_count + k
    assert int(count) == ref_count and abs(float(loss_sum) - ref_sum) / ref_sum < 1e-4


def _pads(qwen) -> list[int]:
    cfg = json.loads((qwen["folder"] / "config.json").read_text())
    return [cfg["image_token_id"], cfg["video_token_id"]]


def test_lora_export_writes_a_peft_adapter_transformers_loads(qwen, hf, cases, tmp_path):
    """`export` of a LoRA run from `init.model` (adapters on every LLM projection, moved off zero): the folder
    holds the base, `llm_adapter/` the adapters under PEFT's names for Qwen2_5_VLForConditionalGeneration (the
    vision tower excluded); PeftModel over transformers' model gives omnijax's logits (1e-4), and reading the
    adapter back (`init.adapter`) gives the same tensors."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from omnijax.config import LoraConfig
    from omnijax.interop import peft as omni_peft
    from omnijax.models import adapters
    from omnijax.train.checkpoint import Checkpointer
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    lora = LoraConfig(rank=4, alpha=8.0)
    cfg, graph, params, rest = _omni_model(qwen["folder"], lora)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    moved = {jax.tree_util.keystr(p): 0.3 * jnp.sin(jnp.arange(v.size, dtype=v.dtype).reshape(v.shape) + k)
             for k, (p, v) in enumerate(leaves) if adapters.is_adapter([getattr(e, "key", e) for e in p])}
    assert len(moved) > 10
    params = jax.tree_util.tree_map_with_path(lambda p, v: moved.get(jax.tree_util.keystr(p), v), params)
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    ckpt.save(1, {"params": params})
    ckpt.wait(), ckpt.close()
    (run / "config.json").write_text(json.dumps({
        "model": dataclasses.asdict(cfg), "trainer": {"lora": dataclasses.asdict(lora)},
        "init": {"model": str(qwen["folder"])}, "tokenizer": {"path": str(qwen["folder"])}}))
    out = tmp_path / "out"
    assert main(["export", str(run), f"output={out}"]) == 0
    adapter = out / omni_peft.ADAPTER_DIR
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert written["exclude_modules"] == omni_peft.QWEN_VL_EXCLUDE and written["r"] == 4

    batch = _batch_of([c[0] for c in cases], cfg)
    logits = jax.jit(lambda p, b: nnx.merge(graph, p, rest)(b)[0])(params, batch)
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    model = PeftModel.from_pretrained(base, adapter).eval()
    loaded = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert loaded and all("language_model.layers." in n for n in loaded)  # none in the vision tower
    for row, (flat, segs, _) in enumerate(cases):
        video = any(s.modality == "video" for s in segs)
        types = np.isin(flat.tokens, _pads(qwen)).astype(np.int64) * (2 if video else 1)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor(flat.tokens[None], dtype=torch.long),
                        mm_token_type_ids=torch.tensor(types[None]), **_hf_pixels(segs, cfg)).logits[0].numpy()
            with model.disable_adapter():  # PEFT wrapped `base` in place: the base alone
                plain = model(input_ids=torch.tensor(flat.tokens[None], dtype=torch.long),
                              mm_token_type_ids=torch.tensor(types[None]), **_hf_pixels(segs, cfg)).logits[0].numpy()
        n = len(flat.tokens)
        err = _rel(np.asarray(logits[row, :n]), ref)
        print(f"PeftModel vs omnijax logits, row {row}: {err:.1e}")
        assert err < 1e-4, row
    assert _rel(plain, ref) > 1e-3  # the adapter carries the LLM's change
    back = dict(nnx.to_flat_state(omni_peft.load_adapter(adapter, jax.tree.map(jnp.zeros_like, params))))
    for path, var in nnx.to_flat_state(params):
        if adapters.is_adapter(path):
            assert np.allclose(np.asarray(back[path][...]), np.asarray(var[...]), atol=1e-6), path


def test_a_pipelined_layout_starts_from_the_folder_as_the_unpipelined_one(qwen, tmp_path):
    """`init.model` under pp2 (the finetune recipe's placement): the LLM's layers are read into the stages'
    stacks, sharded over pp, and unstacked they equal the unpipelined start, as do the tower and the merger;
    `export` of such a run (its checkpoint stacked) writes the folder's tensors back bit for bit."""
    import dataclasses

    from safetensors.numpy import load_file

    from omnijax.train.checkpoint import Checkpointer
    import jax
    from flax import nnx

    from omnijax.interop import qwen_vl
    from omnijax.models.mllm import MultimodalModel
    from omnijax.parallel.engine import unstack_params
    from omnijax.train import multimodal, warmstart
    from recipes.finetune import FinetuneConfig

    folder = str(qwen["folder"])
    cfg = FinetuneConfig()
    cfg.init.model = folder
    cfg = warmstart.resolve_init(cfg, [f"init.model={folder}"])
    cfg.parallel.llm, cfg.parallel.encoder = "pp2xfsdp2xdp2", "edp8"
    placement = multimodal.placement(cfg)
    warmstart.check_placement(cfg, placement)  # no longer refused
    abstract = nnx.state(nnx.eval_shape(lambda: placement.prepare(MultimodalModel(cfg.model, rngs=nnx.Rngs(0)))),
                         nnx.Param)
    shardings = placement.state_shardings(abstract)  # what the trainer's parameters are put in

    def placed(v, s):  # the trainer's structure: a pipelined stack is a Param holding a Param
        sds = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())
        inner = v.get_value()
        return v.replace(inner.replace(sds) if isinstance(inner, nnx.Variable) else sds)
    target = jax.tree.map(placed, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    got = warmstart.initial_params(cfg, target, "test")
    assert jax.tree.structure(got) == jax.tree.structure(target)  # what the optimizer state was built for
    stack = dict(nnx.to_flat_state(got))[("llm", "stages", "attn", "q")][...]
    assert stack.shape[:3] == (2, 1, 1) and "pp" in str(stack.sharding.spec)
    plain = nnx.eval_shape(lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(0)))
    ref = nnx.to_pure_dict(qwen_vl.load_params(folder, nnx.state(plain, nnx.Param)))
    ours = nnx.to_pure_dict(got)
    ours["llm"] = unstack_params(got["llm"], placement.engine.schedule)
    flat_ref, flat_ours = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (ref, ours))
    assert flat_ref.keys() == flat_ours.keys()
    assert all(np.array_equal(np.asarray(flat_ours[k]), np.asarray(flat_ref[k])) for k in flat_ref)
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    ckpt.save(1, {"params": got})
    ckpt.wait(), ckpt.close()
    (run / "config.json").write_text(json.dumps({
        "model": dataclasses.asdict(cfg.model), "parallel": dataclasses.asdict(cfg.parallel),
        "init": {"model": folder}, "tokenizer": {"path": folder}}))
    assert main(["export", str(run), f"output={tmp_path / 'out'}"]) == 0
    orig, back = load_file(f"{folder}/model.safetensors"), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(back) == sorted(orig) and all(np.array_equal(back[k], orig[k]) for k in orig)


def test_video_rows_equal_the_video_processor(qwen, hf):
    """Qwen2VLVideoProcessor (torchvision) on the same frames, not resampled: the grid always, the rows (<1e-5)
    where no resize happens (normalisation, temporal patches, the last frame repeated to fill a patch); where
    the frames are resized, omnijax's Pillow bicubic differs from torchvision's as transformers' own Pillow and
    torchvision image processors differ from each other (measured in docs/qwen_vl.md)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from omnijax.data import features
    from omnijax.interop import qwen_vl

    processor, _ = hf
    cfg, _ = qwen_vl.config_from_folder(qwen["folder"])
    pil = Qwen2VLImageProcessorPil.from_pretrained(qwen["folder"])
    rs = np.random.RandomState(0)

    def ours_and_ref(frames):
        out = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="np")
        ref = out["pixel_values_videos"]
        n = ref.shape[0]
        ref = ref.reshape(n, 3, 2, 14, 14).transpose(0, 2, 3, 4, 1).reshape(n, -1)
        rows, _ = features.segment_inputs("video", frames.astype(np.float32) / 255.0, cfg)
        return rows, ref, out["video_grid_thw"][0]

    for shape in ((5, 56, 84, 3), (4, 112, 112, 3)):  # sides multiples of 28 within min/max pixels
        rows, ref, grid = ours_and_ref((rs.rand(*shape) * 255).astype(np.uint8))
        assert rows.shape == ref.shape and np.abs(rows - ref).max() < 1e-5, shape
    frames = (rs.rand(4, 60, 80, 3) * 255).astype(np.uint8)  # resized to 56 x 84
    rows, ref, grid = ours_and_ref(frames)
    assert rows.shape == ref.shape and grid.tolist() == [2, 4, 6]
    # each frame pair as transformers' Pillow image processor resizes a frame
    for t in range(2):
        img = pil(images=[frames[2 * t]], return_tensors="np")["pixel_values"]
        img = img.reshape(-1, 3, 2, 14, 14)[:, :, 0].transpose(0, 2, 3, 1).reshape(len(img), -1)
        mine = rows[t * 24:(t + 1) * 24].reshape(24, 2, 14 * 14 * 3)[:, 0]
        assert np.abs(mine - img).max() < 1e-5


def test_a_qwen_folder_whose_media_ids_are_not_its_tokens_is_one_line(qwen, tmp_path):
    import shutil

    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.errors import UserError

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen["folder"] / name, tmp_path / name)
    cfg = json.loads((qwen["folder"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vision_end_token_id": 10 ** 6}))
    with pytest.raises(UserError, match="vision_end_token_id .1000000. is not a token"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))  # a text LLM: no markers
    tok = load_tokenizer(str(tmp_path))
    assert tok.media_markers == {} and tok.placeholder["image"] != cfg["image_token_id"]
