"""HF interop: tiny random Llama/Qwen2 from transformers -> omnijax logits parity, export round trip, through the
product path (the sharded reader, `pretrained.load_llm`, and the writer, `pretrained.export_llm`)."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

import omnijax  # noqa: F401
from omnijax.config import LLMConfig, MoEConfig
from omnijax.errors import UserError
from omnijax.interop import hf, pretrained
from omnijax.models.llm import LLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
B, L = 2, 24
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}
# name: (model class, config kwargs, first position, save_pretrained kwargs)
CASES = {
    "llama_untied": ("Llama", dict(tie_word_embeddings=False), 0, {}),
    "llama_tied_llama3rope": ("Llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3), 1000, {}),
    "qwen2_untied_sharded": ("Qwen2", dict(tie_word_embeddings=False), 0, dict(max_shard_size="60KB")),
    "qwen2_tied_yarnrope": ("Qwen2", dict(tie_word_embeddings=True, rope_parameters=YARN), 3000, {}),
}


def _hf_model(kind, kwargs, seed):
    cls_cfg = getattr(transformers, f"{kind}Config")
    cls_model = getattr(transformers, f"{kind}ForCausalLM")
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**COMMON, **kwargs)).float().eval()
    with torch.no_grad():  # randomise everything, biases and norm scales included
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return cls_model, model


@jax.jit
def _logits(model, tokens, positions):
    return model(tokens, positions=positions)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    kind, kwargs, start, save_kw = CASES[request.param]
    cls_model, ref = _hf_model(kind, kwargs, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, **save_kw)
    tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], (B, L))
    positions = np.broadcast_to(np.arange(start, start + L), (B, L))
    with torch.no_grad():
        ref_logits = ref(torch.tensor(tokens), position_ids=torch.tensor(positions.copy())).logits.numpy()
    return dict(name=request.param, path=path, cls=cls_model, tokens=tokens, positions=positions,
                ref_logits=ref_logits, save_kw=save_kw)


def test_import_matches_transformers_logits(case):
    if case["save_kw"]:
        assert (case["path"] / "model.safetensors.index.json").exists()
        assert len(list(case["path"].glob("*.safetensors"))) > 1
    model = pretrained.load_llm(case["path"])
    out = np.asarray(_logits(model, case["tokens"], case["positions"]))
    diff = float(np.abs(out - case["ref_logits"]).max())
    print(f"\nPARITY {case['name']}: max_abs_diff={diff:.3e} (|logits| max {np.abs(case['ref_logits']).max():.2f})")
    assert diff <= TOL


def test_export_roundtrip_bit_identical_and_loadable_by_transformers(case, tmp_path):
    model = pretrained.load_llm(case["path"])
    pretrained.export_llm(nnx.state(model, nnx.Param), model.config, tmp_path / "export")
    again = pretrained.load_llm(tmp_path / "export")
    a, b = nnx.state(model, nnx.Param), nnx.state(again, nnx.Param)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    np.testing.assert_array_equal(np.asarray(_logits(model, case["tokens"], case["positions"])),
                                  np.asarray(_logits(again, case["tokens"], case["positions"])))
    reloaded = case["cls"].from_pretrained(tmp_path / "export").float().eval()
    with torch.no_grad():
        out = reloaded(torch.tensor(case["tokens"]), position_ids=torch.tensor(case["positions"].copy())).logits.numpy()
    diff = float(np.abs(out - case["ref_logits"]).max())
    print(f"\nEXPORT {case['name']}: transformers(export) vs original max_abs_diff={diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("params", [LLAMA3, YARN, {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4},
                                    {**YARN, "beta_fast": 16.0, "attention_factor": 1.5}])
def test_rope_frequencies_match_transformers(params):
    """Scaled inverse frequencies and cos/sin scale equal transformers' own rope init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from omnijax.layers import rope
    hf_cfg = transformers.LlamaConfig(**COMMON, rope_parameters=dict(params))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    ours = hf.config_from_hf({"model_type": "llama", **COMMON, "rope_parameters": dict(params)})
    inv, scale = rope.inv_frequencies(ours.head_dim, ours.rope)
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=1e-6)
    assert np.isclose(scale, ref_scale, rtol=1e-6)
    plain = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    base, _ = rope.inv_frequencies(ours.head_dim, hf.config_from_hf({"model_type": "llama", **COMMON,
                                                                      "rope_parameters": plain}).rope)
    assert not np.allclose(inv, base)  # the scaling really changes frequencies


def test_config_translation(tmp_path):
    cfg = hf.config_from_hf({"model_type": "llama", **COMMON, "tie_word_embeddings": True,
                             "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5})
    assert cfg.rope.scaling == "linear" and cfg.rope.factor == 2.0 and cfg.rope.theta == 5e5
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and cfg.tie_embeddings and not cfg.qkv_bias
    q = hf.config_from_hf({"model_type": "qwen2", **COMMON})
    assert q.qkv_bias and q.rope.scaling == "none"
    model = LLM(LLMConfig(qkv_bias=True), rngs=nnx.Rngs(0))
    pretrained.export_llm(nnx.state(model, nnx.Param), model.config, tmp_path / "q")
    written = json.loads((tmp_path / "q" / "config.json").read_text())
    assert written["model_type"] == "qwen2" and written["tie_word_embeddings"] is True


def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        pretrained.load_llm(tmp_path / "nope")
    with pytest.raises(UserError, match="no config.json"):
        pretrained.load_llm(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **COMMON}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        pretrained.load_llm(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **COMMON}))
    with pytest.raises(UserError, match="no \\*.safetensors"):
        pretrained.load_llm(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(UserError, match="lists missing file"):
        pretrained.load_llm(tmp_path)
    with pytest.raises(UserError, match="mlp_bias"):
        hf.config_from_hf({"model_type": "llama", **COMMON, "mlp_bias": True})
    with pytest.raises(UserError, match="rope type 'longrope'"):
        hf.config_from_hf({"model_type": "llama", **COMMON, "rope_parameters": {"rope_type": "longrope"}})
    moe = LLM(LLMConfig(moe=MoEConfig(every=1)), rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="mixture-of-experts"):
        pretrained.export_llm(nnx.state(moe, nnx.Param), moe.config, tmp_path / "moe")


def test_missing_weight_is_reported(tmp_path):
    from safetensors.numpy import load_file, save_file
    model = LLM(LLMConfig(tie_embeddings=False), rngs=nnx.Rngs(0))
    pretrained.export_llm(nnx.state(model, nnx.Param), model.config, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        pretrained.load_llm(tmp_path / "m")
