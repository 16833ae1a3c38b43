"""Pretrained HF folders in and out (omnijax/interop/pretrained.py), against transformers + torch.

Tiny random models (width <= 64, 2 layers) saved by transformers; their weights widened so that a
wrong load cannot hide behind near-zero values. Checks: LLM/SigLIP/Whisper loads into sharded targets
equal the one-device load bitwise; forwards match transformers; exports load in transformers with the
original names, shapes and dtypes, bit-exact; preprocessing matches SiglipImageProcessor and
WhisperFeatureExtractor on the same files; bad folders give one line naming the problem.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from omnijax.data import features, media  # noqa: E402
from omnijax.errors import UserError  # noqa: E402
from omnijax.interop import pretrained as pt  # noqa: E402
from omnijax.interop.tensors import TensorIndex, read_header  # noqa: E402
from omnijax.models.llm import LLM  # noqa: E402
from omnijax.models.vision import VisionEncoder  # noqa: E402
from omnijax.models.whisper import WhisperEncoder  # noqa: E402
from omnijax.parallel import rules as rules_lib  # noqa: E402
from omnijax.parallel.engine import LLMParallel  # noqa: E402
from omnijax.parallel.mesh import make_mesh  # noqa: E402


def _widen(model, skip=()):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(s in name for s in skip):
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, SiglipConfig, SiglipModel,
                              SiglipVisionConfig, SiglipVisionModel, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperModel)

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = _widen(LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5)))
    llama.save_pretrained(root / "llama", max_shard_size="60KB")  # several files + index.json
    (root / "llama" / "tokenizer_config.json").write_text("{}")
    qwen = _widen(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)))
    qwen.to(torch.bfloat16).save_pretrained(root / "qwen2")
    siglip = _widen(SiglipVisionModel(SiglipVisionConfig(
        image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)))
    siglip.save_pretrained(root / "siglip")
    full = _widen(SiglipModel(SiglipConfig(
        vision_config=dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4),
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16))))
    full.save_pretrained(root / "siglip_full")  # SiglipModel: the vision tower is read, the text tower ignored
    (root / "siglip" / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SiglipImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    wcfg = WhisperConfig(num_mel_bins=80, d_model=48, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
                         decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=96, max_source_positions=16,
                         vocab_size=128, pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=2)
    whisper = _widen(WhisperModel(wcfg), skip=("embed_positions",))
    whisper.save_pretrained(root / "whisper")
    WhisperFeatureExtractor(feature_size=80).save_pretrained(root / "whisper")
    gen = WhisperForConditionalGeneration(wcfg)
    gen.model.load_state_dict(whisper.state_dict())
    gen.save_pretrained(root / "whisper_gen")
    return {"root": root, "llama": llama.eval(), "qwen2": qwen.eval(), "siglip": siglip.eval(), "siglip_full": full.eval(),
            "whisper": whisper.eval()}


def _sharded_target(abstract_params, shardings):
    return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
                        abstract_params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _llm_target(cfg, layout=None):
    params = nnx.state(nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    if layout is None:
        return params
    return _sharded_target(params, LLMParallel(layout, cfg).state_shardings(params))


def _encoder_target(module):
    """The encoder's params as the multiplexed trainer shards them under encoder_fsdp on an fsdp8 mesh."""
    params = nnx.state(module, nnx.Param)
    mesh = make_mesh("fsdp8", jax.devices())
    return _sharded_target(params, rules_lib.state_shardings(params, rules_lib.load_rules("encoder_fsdp"), mesh))


def _pure(state):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state))


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(_pure(a)), jax.tree.leaves(_pure(b))))


def _jitted(module, method: str = "__call__"):
    """module.method(x, segment_ids, positions) compiled (eager encoder forwards dispatch op by op: slow)."""
    graph, state = nnx.split(module)
    fn = jax.jit(lambda st, *a: getattr(nnx.merge(graph, st), method)(*a))
    return lambda *a: np.asarray(fn(state, *(jnp.asarray(x) for x in a)))


def _rel(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def test_llm_layouts_equal_one_device_and_transformers(folders):
    path = folders["root"] / "llama"
    assert pt.folder_kind(path) == "llama" and len(TensorIndex(path).files) > 1
    cfg = pt.llm_config_from_folder(path)
    one = pt.load_llm_params(path, _llm_target(cfg))
    for layout in ("fsdp8", "tp2xdp4", "tp2xfsdp4"):
        got = pt.load_llm_params(path, _llm_target(cfg, layout))
        assert _same(one, got), layout
        leaf = nnx.to_flat_state(got)[0][1].get_value()
        assert len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
    model = nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, one)
    tokens = (np.arange(24) * 7 % 96)[None]
    with torch.no_grad():
        ref = folders["llama"](torch.tensor(tokens)).logits.numpy()
    assert _rel(model(jnp.asarray(tokens)), ref) < 1e-4


def test_pipelined_llm_loads_stage_by_stage_and_exports(folders):
    """pp2: blocks stacked [stage, repeat, layer, ...] and sharded over pp; each stage's layers read into it."""
    from omnijax.parallel.engine import unstack_params
    from safetensors.numpy import load_file

    root = folders["root"]
    path = root / "llama"
    cfg = pt.llm_config_from_folder(path)
    engine = LLMParallel("pp2xfsdp2xtp2", cfg)
    piped = nnx.state(nnx.eval_shape(lambda: engine.prepare(LLM(cfg, rngs=nnx.Rngs(0)))), nnx.Param)
    got = pt.load_llm_params(path, _sharded_target(piped, engine.state_shardings(piped)))
    stack = dict(nnx.to_flat_state(got))[("stages", "attn", "q")].get_value()
    assert stack.shape[:3] == (2, 1, 1) and "pp" in str(stack.sharding.spec)
    one = _pure(pt.load_llm_params(path, _llm_target(cfg)))
    unstacked = jax.tree.map(np.asarray, unstack_params(got, engine.schedule))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(unstacked)))
    pt.export_llm(got, cfg, root / "out_piped", like=path)
    orig = {}
    for f in path.glob("*.safetensors"):
        orig.update(load_file(str(f)))
    back = load_file(str(root / "out_piped" / "model.safetensors"))
    assert sorted(back) == sorted(orig) and all(np.array_equal(back[k], orig[k]) for k in orig)


def test_llm_export_round_trips_bitwise(folders):
    from transformers import AutoModelForCausalLM

    root = folders["root"]
    cfg = pt.llm_config_from_folder(root / "llama")
    params = pt.load_llm_params(root / "llama", _llm_target(cfg, "tp2xfsdp4"))
    pt.export_llm(params, cfg, root / "out_llama", like=root / "llama", tokenizer_dir=root / "llama")
    back = AutoModelForCausalLM.from_pretrained(root / "out_llama", dtype=torch.float32).state_dict()
    orig = folders["llama"].state_dict()
    assert sorted(back) == sorted(orig) and all(torch.equal(back[k], orig[k]) for k in orig)
    assert (root / "out_llama" / "tokenizer_config.json").exists()
    assert not list(root.glob(".out_llama.tmp-*"))
    with pytest.raises(UserError, match="exists"):
        pt.export_llm(params, cfg, root / "out_llama", like=root / "llama")
    # bf16 Qwen2 (tied): fp32 masters out as bf16 again, bit-exact; a config of its own when no `like`
    qcfg = pt.llm_config_from_folder(root / "qwen2")
    qparams = pt.load_llm_params(root / "qwen2", _llm_target(qcfg, "fsdp8"))
    pt.export_llm(qparams, qcfg, root / "out_qwen2", like=root / "qwen2")
    a, b = read_header(next((root / "qwen2").glob("*.safetensors")))[0], read_header(root / "out_qwen2" / "model.safetensors")[0]
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    back = AutoModelForCausalLM.from_pretrained(root / "out_qwen2", dtype=torch.bfloat16).state_dict()
    orig = folders["qwen2"].state_dict()
    assert all(torch.equal(back[k], orig[k]) for k in orig)
    # a model trained from scratch: Llama format from its config alone, same logits in transformers
    scratch = LLM(dataclasses.replace(cfg, tie_embeddings=True), rngs=nnx.Rngs(3))
    pt.export_llm(nnx.state(scratch, nnx.Param), scratch.config, root / "out_scratch")
    hf_scratch = AutoModelForCausalLM.from_pretrained(root / "out_scratch", dtype=torch.float32).eval()
    tokens = (np.arange(16) * 5 % 96)[None]
    with torch.no_grad():
        ref = hf_scratch(torch.tensor(tokens)).logits.numpy()
    assert _rel(scratch(jnp.asarray(tokens)), ref) < 1e-4


def test_siglip_parity_load_and_export(folders):
    from transformers import SiglipVisionModel

    root = folders["root"]
    cfg = pt.encoder_config_from_folder(root / "siglip")
    assert (cfg.image_size, cfg.resample, cfg.learned_grid, cfg.merge) == (32, "bilinear", 4, 1)
    abstract = nnx.eval_shape(lambda: VisionEncoder(cfg, rngs=nnx.Rngs(0)))
    one = pt.load_encoder_params(root / "siglip", nnx.state(abstract, nnx.Param))
    assert _same(one, pt.load_encoder_params(root / "siglip", _encoder_target(abstract)))
    enc = nnx.eval_shape(lambda: VisionEncoder(cfg, rngs=nnx.Rngs(0)))
    nnx.update(enc, one)
    pixels = np.random.RandomState(0).rand(2, 32, 32, 3).astype(np.float32)
    rows, poss, segs = zip(*[(*features.segment_inputs("image", img, cfg), np.full(16, i + 1)) for i, img in enumerate(pixels)])
    rows, poss, segs = np.concatenate(rows), np.concatenate(poss), np.concatenate(segs)
    hidden_of = _jitted(enc, "hidden")
    hidden = hidden_of(rows, segs, poss).reshape(2, 16, -1)
    with torch.no_grad():
        ref = folders["siglip"](pixel_values=torch.tensor(pixels * 2 - 1).permute(0, 3, 1, 2)).last_hidden_state.numpy()
    assert _rel(hidden, ref) < 1e-4
    # video through the image tower frame by frame (LLaVA-Video): each frame's tokens = that frame as an image
    video = np.random.RandomState(1).rand(3, 32, 32, 3).astype(np.float32)
    vrows, vpos = features.segment_inputs("video", video, cfg)
    vh = hidden_of(vrows, np.ones(len(vrows), np.int32), vpos)
    frame = features.segment_inputs("image", video[2], cfg)
    fh = hidden_of(frame[0], np.ones(16, np.int32), frame[1])
    assert np.abs(vh[32:] - fh).max() < 1e-5
    pt.export_encoder(one, cfg, root / "out_siglip", like=root / "siglip")
    back = SiglipVisionModel.from_pretrained(root / "out_siglip").state_dict()
    orig = folders["siglip"].state_dict()
    assert sorted(back) == sorted(orig) and all(torch.equal(back[k], orig[k]) for k in orig)
    assert json.loads((root / "out_siglip" / "preprocessor_config.json").read_text())["resample"] == 2
    # a SiglipModel folder: its vision tower in, out as a SiglipVisionModel with the same tensors
    fcfg = pt.encoder_config_from_folder(root / "siglip_full")
    assert pt.folder_kind(root / "siglip_full") == "siglip" and fcfg.resample == "bicubic"  # processor default
    fabs = nnx.eval_shape(lambda: VisionEncoder(fcfg, rngs=nnx.Rngs(0)))
    fparams = pt.load_encoder_params(root / "siglip_full", nnx.state(fabs, nnx.Param))
    nnx.update(fabs, fparams)
    fh = _jitted(fabs, "hidden")(rows, segs, poss).reshape(2, 16, -1)
    with torch.no_grad():
        fref = folders["siglip_full"].vision_model(
            pixel_values=torch.tensor(pixels * 2 - 1).permute(0, 3, 1, 2)).last_hidden_state.numpy()
    assert _rel(fh, fref) < 1e-4
    pt.export_encoder(fparams, fcfg, root / "out_siglip_full", like=root / "siglip_full")
    back = SiglipVisionModel.from_pretrained(root / "out_siglip_full").state_dict()
    orig = {k.removeprefix("vision_model."): v for k, v in folders["siglip_full"].state_dict().items()
            if k.startswith("vision_model.")}
    back = {k.removeprefix("vision_model."): v for k, v in back.items()}  # transformers 5 keeps the tower bare
    assert sorted(back) == sorted(orig) and all(torch.equal(back[k], orig[k]) for k in orig)


@pytest.mark.slow
def test_whisper_parity_packing_and_export(folders):
    from safetensors.numpy import load_file

    root = folders["root"]
    cfg = pt.encoder_config_from_folder(root / "whisper")
    assert (cfg.kind, cfg.n_mels, cfg.max_source_positions, cfg.chunk_frames) == ("whisper", 80, 16, 3000)
    abstract = nnx.eval_shape(lambda: WhisperEncoder(cfg, rngs=nnx.Rngs(0)))
    one = pt.load_encoder_params(root / "whisper", nnx.state(abstract, nnx.Param))
    assert _same(one, pt.load_encoder_params(root / "whisper", _encoder_target(abstract)))
    assert _same(one, pt.load_encoder_params(root / "whisper_gen", nnx.state(abstract, nnx.Param)))
    enc = nnx.eval_shape(lambda: WhisperEncoder(cfg, rngs=nnx.Rngs(0)))
    nnx.update(enc, one)
    feats = np.random.RandomState(2).randn(2, 80, 32).astype(np.float32)
    with torch.no_grad():
        ref = folders["whisper"].encoder(torch.tensor(feats)).last_hidden_state.numpy()
    short = feats[0].T[:10]  # a shorter clip between them: no convolution tap may cross a clip boundary
    rows = np.concatenate([feats[0].T, short, feats[1].T])
    segs = np.concatenate([np.full(32, 1), np.full(10, 2), np.full(32, 3)])
    pos = np.zeros((len(rows), 3), np.int32)
    pos[:, 0] = np.concatenate([np.arange(32), np.arange(10), np.arange(32)])
    forward = _jitted(enc)
    out = forward(rows, segs, pos)
    assert _rel(out[:16], ref[0]) < 1e-4 and _rel(out[21:], ref[1]) < 1e-4
    alone = forward(short, np.ones(10, np.int32), pos[32:42])
    assert np.abs(alone - out[16:21]).max() < 1e-5
    # a clip split over a sequence-parallel group (esp=2, Ulysses attention): the stem's edge rows come from the
    # neighbouring device, so the split buffer equals the whole one
    from jax.sharding import Mesh, PartitionSpec as P

    from omnijax.layers import attention as attention_lib, sequence
    from omnijax.parallel.multiplex import ulysses_attention

    rows2 = np.concatenate([feats[0].T[:20], feats[1].T[:12]])
    segs2 = np.concatenate([np.full(20, 1), np.full(12, 2)]).astype(np.int32)
    pos2 = np.zeros((32, 3), np.int32)
    pos2[:, 0] = np.concatenate([np.arange(20), np.arange(12)])
    whole = forward(rows2, segs2, pos2)
    graph, state = nnx.split(enc)

    def split_run(st, x, seg, p):
        with attention_lib.use_attention(ulysses_attention(("esp",))), sequence.use_sequence_group(("esp",)):
            return nnx.merge(graph, st)(x, seg, p)

    mesh = Mesh(np.array(jax.devices()[:2]), ("esp",))
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, P()))
    split = jax.jit(jax.shard_map(split_run, mesh=mesh, in_specs=(P(),) + (P("esp"),) * 3, out_specs=P("esp"),
                                  check_vma=False))(state, jnp.asarray(rows2), jnp.asarray(segs2), jnp.asarray(pos2))
    assert np.abs(np.asarray(split) - whole).max() < 1e-5 * np.abs(whole).max()
    for src, name in ((root / "whisper", "out_whisper"), (root / "whisper_gen", "out_whisper_gen")):
        pt.export_encoder(one, cfg, root / name, like=src)
        orig = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if "encoder." in k}
        back = load_file(str(root / name / "model.safetensors"))
        assert sorted(back) == sorted(orig) and all(np.array_equal(back[k], orig[k]) for k in orig)


def test_features_match_hf_processors(folders, tmp_path):
    from PIL import Image
    from transformers import SiglipImageProcessorPil, WhisperFeatureExtractor

    root = folders["root"]
    vcfg = pt.encoder_config_from_folder(root / "siglip")
    # the Pillow backend, which omnijax's resize follows (with torchvision installed, transformers 5's
    # SiglipImageProcessor resizes with torchvision instead)
    proc = SiglipImageProcessorPil.from_pretrained(root / "siglip")
    rs = np.random.RandomState(0)
    for h, w in ((45, 70), (20, 13), (96, 64)):
        Image.fromarray((rs.rand(h, w, 3) * 255).astype(np.uint8)).save(tmp_path / "img.png")
        ref = proc(images=Image.open(tmp_path / "img.png"), return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
        rows, _ = features.segment_inputs("image", media.load_image(tmp_path / "img.png"), vcfg)
        ours = rows.reshape(4, 4, 8, 8, 3).transpose(0, 2, 1, 3, 4).reshape(32, 32, 3)
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), (h, w)
    wcfg = dataclasses.replace(pt.encoder_config_from_folder(root / "whisper"), max_source_positions=1500)
    fe = WhisperFeatureExtractor.from_pretrained(root / "whisper")
    for n, rate in ((16000, 16000), (30000, 44100), (500000, 16000)):  # 44.1 kHz: soxr to 16 kHz first
        wave = (rs.randn(n) * 0.2 * np.sin(np.arange(n) / 300)).astype(np.float32)
        media.write_audio(tmp_path / "a.wav", wave, rate)
        audio = media.load_audio(tmp_path / "a.wav")
        ref = fe(audio, sampling_rate=16000, return_tensors="np")["input_features"][0].T
        ours, pos = features.segment_inputs("audio", audio, wcfg)
        assert ours.shape[0] == features.encoder_tokens("audio", audio.shape, wcfg)[0] == len(pos)
        assert np.abs(ours - ref[:len(ours)]).max() <= 1e-4 * np.abs(ref).max(), n


def test_bad_folders_one_line(folders, tmp_path):
    root = folders["root"]
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="model_type 'bert' is not supported"):
        pt.folder_kind(bert)
    cfg = pt.llm_config_from_folder(root / "llama")
    broken = tmp_path / "llama_missing"
    shutil.copytree(root / "llama", broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    from safetensors.numpy import load_file, save_file

    for f in broken.glob("*.safetensors"):
        tensors = load_file(str(f))
        if tensors.pop("model.layers.1.mlp.up_proj.weight", None) is not None:
            save_file(tensors, str(f))
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight") as err:
        pt.load_llm_params(broken, _llm_target(cfg))
    assert "\n" not in str(err.value)
    wrong = tmp_path / "llama_shape"
    shutil.copytree(root / "llama", wrong)
    hf_cfg = json.loads((wrong / "config.json").read_text())
    hf_cfg["intermediate_size"] = 128
    (wrong / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(UserError, match=r"tensor 'model.layers.0.mlp.\w+_proj.weight' in \S+ has shape \[\d+, \d+\], config.json implies"):
        pt.load_llm_params(wrong, _llm_target(pt.llm_config_from_folder(wrong)))
    with pytest.raises(UserError, match="not an LLM"):
        pt.llm_config_from_folder(root / "siglip")
    with pytest.raises(UserError, match="target parameter extra has no tensor"):
        pt.load_llm_params(root / "llama", {**nnx.to_pure_dict(_llm_target(cfg)), "extra": np.zeros(3)})
    from omnijax.errors import ConfigError
    from omnijax.mm_config import encoder_config

    with pytest.raises(ConfigError, match="reduction=4: Whisper"):
        encoder_config("audio", {"kind": "whisper", "reduction": 4})


@pytest.mark.slow
def test_two_processes_load_their_halves_and_export_exactly():
    """A real 2-process job (jax.distributed, gloo): each process builds only its devices' shards of an fsdp8
    layout (half the parameter bytes), the values equal the file's, and the export of the sharded state
    (gathered tensor by tensor, written by process 0) equals the source files bit for bit."""
    import tempfile

    from recipes.bench import load as bench_load

    b = bench_load.BenchConfig(embed_dim=64, num_layers=2, mlp_dim=128, vocab_size=512, num_heads=4, num_kv_heads=2,
                               file_mb=1, repeats=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        total = bench_load.write_folder(b, folder)
        rows = bench_load.launch(folder, b, 2)
    assert [r["process"] for r in rows] == [0, 1] and all(r["processes"] == 2 for r in rows)
    assert all(r["values_ok"] for r in rows) and rows[0]["export_bit_exact"] is True
    assert all(r["local_param_bytes"] == total // 2 for r in rows)
