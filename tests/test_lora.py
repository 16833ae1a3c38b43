"""LoRA / QLoRA adapters (trainer.lora): the adapted model computes x·W + alpha/r·(x·A)·B, every layout gives the
single-device loss and adapter gradients, the base stays bitwise frozen with no optimizer state, checkpoints carry
the adapters, and PEFT over the original Hugging Face folder computes what omnijax computes."""
from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import Config, LLMConfig, LoraConfig, from_dict
from omnijax.errors import ConfigError
from omnijax.layers import lora
from omnijax.models import adapters, mllm
from omnijax.models.llm import LLM
from omnijax.models.losses import lm_loss
from omnijax.mm_config import MMConfig
from omnijax.parallel.engine import LLMParallel, unstack_params
from omnijax.train.parts import Partition
from omnijax.train.step import loss_and_grads
from numerics import assert_grads_close
from test_parallel_llm import BATCH, DENSE

LORA = LoraConfig(rank=4, alpha=8.0)


def _with_b(params, value: float = 0.02):
    """Adapters with B != 0 (as after training), the same in every layout: B = value·sin(index) over each
    layer's own B (a pipelined stack repeats it over its leading [stage, repeat, layer] axes)."""
    def fill(path, x):
        keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        if not any(k.endswith(lora.B_SUFFIX) for k in keys):
            return x
        core = x.shape[3:] if "stages" in keys else x.shape
        one = value * jnp.sin(jnp.arange(math.prod(core), dtype=x.dtype)).reshape(core)
        return jnp.broadcast_to(one, x.shape)
    return jax.tree_util.tree_map_with_path(fill, params)


def _mask(params) -> list[bool]:
    return Partition(params).mask()


def test_adapted_projection_is_base_plus_low_rank_and_merges():
    """B = 0: the adapted model is the base; B != 0: it equals the merged weights' model; gradients only for A/B."""
    tokens = jnp.asarray(BATCH["tokens"][:2])
    base = LLM(DENSE, rngs=nnx.Rngs(0))
    ref = base(tokens)
    model = adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LORA)
    assert float(jnp.abs(model(tokens) - ref).max()) == 0.0
    g, p, r = nnx.split(model, nnx.Param, ...)
    p = _with_b(p)
    got = jax.jit(lambda p: nnx.merge(g, p, r)(tokens))(p)
    gb, _, rb = nnx.split(base, nnx.Param, ...)
    merged = nnx.merge(gb, adapters.merged_base(p), rb)(tokens)
    assert float(jnp.abs(got - ref).max()) > 1e-2  # the adapters change the logits ...
    np.testing.assert_allclose(got, merged, rtol=0, atol=2e-5 * float(jnp.abs(merged).max()))  # ... as merging does
    # the einsum interception is scoped: outside an adapted module jnp.einsum is jax's own
    assert jnp.einsum is lora._ORIGINAL_EINSUM
    part = Partition(p)
    assert part.trainable == ["lora"] and "llm" in part.frozen
    # a frozen base takes no gradient: the step's jaxpr has fewer matmuls than one differentiating everything
    full = lambda q: loss_and_grads(g, r, lm_loss, q, BATCH)  # noqa: E731
    only = lambda q: loss_and_grads(g, r, lm_loss, q, BATCH, trainable=part.mask())  # noqa: E731
    assert str(jax.make_jaxpr(only)(p)).count("dot_general") < str(jax.make_jaxpr(full)(p)).count("dot_general")


def _adapted_grads(layout: str | None):
    if layout is None:
        model = adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LORA)
        g, p, r = nnx.split(model, nnx.Param, ...)
        p = _with_b(jax.device_put(p, jax.devices()[0]))
        loss, grads, _ = jax.jit(lambda q, b: loss_and_grads(g, r, lm_loss, q, b, trainable=_mask(p)))(p, BATCH)
        return float(loss), nnx.to_pure_dict(jax.device_get(grads)), None
    n = math.prod(int(t.lstrip("abcdefghijklmnopqrstuvwxyz")) for t in layout.split("x"))
    par = LLMParallel(layout, DENSE, devices=jax.devices()[:n])
    # as the Trainer does: the layout prepares the model (stacks the stages under pp), then adapters attach
    model = adapters.adapt(par.prepare(LLM(DENSE, rngs=nnx.Rngs(0))), LORA)
    g, p, r = nnx.split(model, nnx.Param, ...)
    p = jax.device_put(_with_b(p), par.state_shardings(p))
    mask = _mask(p)
    loss, grads, _ = jax.jit(lambda q, b: loss_and_grads(g, r, par.loss_fn, q, b, trainable=mask))(
        p, par.put_batch(BATCH))
    grads = jax.device_get(grads)
    grads = unstack_params(grads, par.schedule) if par.schedule else nnx.to_pure_dict(grads)
    return float(loss), grads, p


@pytest.fixture(scope="module")
def single_device():
    return _adapted_grads(None)


# The module's fixtures are built once per worker that runs one of their tests, so each fixture's tests are one
# xdist group; two groups (not the module's one), so that the layouts and the LoRA run go to both workers.
@pytest.mark.xdist_group("lora_layouts")
@pytest.mark.parametrize("layout", ["dp8", "fsdp8", "tp2", "pp2"])
def test_layouts_match_single_device(single_device, layout):
    ref_loss, ref_grads, _ = single_device
    loss, grads, params = _adapted_grads(layout)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert_grads_close(grads, ref_grads)
    a = [v for path, v in nnx.to_flat_state(params) if str(path[-1]).endswith(lora.A_SUFFIX)]
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(grads))
    if layout == "fsdp8":  # adapters are parameters of the layout: A [embed, r] is split over fsdp like W
        assert any(not v[...].sharding.is_fully_replicated for v in a)


def test_qlora_base_is_quantized_and_close():
    """nf4 / int8: the base is stored as codes (1/2 or 1/4 the bytes of fp32 weights... plus block scales), the
    dequantised weights round-trip within the format's error, and the adapted model stays near the fp32 one."""
    w = jax.random.normal(jax.random.key(0), (64, 4, 16))
    for kind, tol, ratio in (("int8", 0.01, 0.3), ("nf4", 0.11, 0.15)):
        codes, scale = lora.quantize(w, kind)
        back = lora.dequantize(codes, scale, kind, jnp.float32)
        assert float(jnp.sqrt(jnp.mean((back - w) ** 2)) / jnp.std(w)) < tol
        assert (codes.nbytes + scale.nbytes) / w.nbytes < ratio
    tokens = jnp.asarray(BATCH["tokens"][:2])
    ref = LLM(DENSE, rngs=nnx.Rngs(0))(tokens)
    model = adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0, base_dtype="int8"))
    params = nnx.state(model, nnx.Param)
    assert params["blocks"][0]["attn"]["q"][...].dtype == jnp.int8
    got = model(tokens)
    assert float(jnp.abs(got - ref).max() / jnp.abs(ref).max()) < 0.05
    # merging dequantises: the merged plain model computes what the quantised adapted one does
    gb, _, rb = nnx.split(LLM(DENSE, rngs=nnx.Rngs(0)), nnx.Param, ...)
    np.testing.assert_allclose(nnx.merge(gb, adapters.merged_base(params), rb)(tokens), got, atol=1e-4)


def test_bad_lora_settings_are_one_line_errors():
    model = lambda: LLM(DENSE, rngs=nnx.Rngs(0))  # noqa: E731
    with pytest.raises(ConfigError, match="trainer.lora.targets"):
        adapters.adapt(model(), LoraConfig(rank=4, targets=["qq"]))
    with pytest.raises(ConfigError, match="trainer.lora.dropout"):
        adapters.adapt(model(), LoraConfig(rank=4, dropout=0.1))
    with pytest.raises(ConfigError, match="trainer.lora.parts: this model has no part 'vision'"):
        adapters.adapt(model(), LoraConfig(rank=4, parts=["vision"]))
    p = nnx.state(adapters.adapt(model(), LORA), nnx.Param)
    with pytest.raises(ConfigError, match="llm carries adapters"):
        Partition(p, ["llm"])
    assert adapters.attach(model, LoraConfig()) is model  # rank 0: no adapters


def test_encoder_layout_matches_single_device():
    """Adapters on the LLM and the vision encoder under the joint step (fsdp8 LLM, edp8 encoders) give the
    single-device loss and adapter gradients."""
    from omnijax.data.packing import SamplePacker as Packer
    from omnijax.data.world import World
    from omnijax.parallel.multiplex import Multiplexer
    from test_multiplex_step import ENCODERS, LLM as MM_LLM, WORLD as MX_WORLD

    cfg = from_dict(MMConfig, {"llm": MM_LLM, "encoders": ENCODERS})
    both = LoraConfig(rank=4, alpha=8.0, parts=["llm", "vision"])
    batch, _ = Packer(cfg, 8, 64, {"vision": 512, "audio": 256}).pack(World(MX_WORLD).sample(i) for i in range(80))
    model = adapters.adapt(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0)), both)
    g, p, r = nnx.split(model, nnx.Param, ...)
    p = _with_b(p)
    mask = _mask(p)
    ref_loss, ref_grads, _ = jax.jit(lambda q, b: loss_and_grads(g, r, mllm.mm_loss, q, b, trainable=mask))(
        p, {k: jnp.asarray(v) for k, v in batch.items()})
    mx = Multiplexer(LLMParallel("fsdp8", cfg.llm), cfg, encoder_layout="edp8")
    model = adapters.adapt(mx.prepare(mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))), both)
    g, p, r = nnx.split(model, nnx.Param, ...)
    p = mx.put_state(_with_b(p))
    loss, grads, _ = jax.jit(lambda q, b: loss_and_grads(g, r, mx.loss_fn, q, b, trainable=mask))(p, mx.put_batch(batch))
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_grads_close(nnx.to_pure_dict(jax.device_get(grads)), nnx.to_pure_dict(jax.device_get(ref_grads)))
    vision = [k for k, _ in nnx.to_flat_state(p) if k[0] == "encoders" and str(k[-1]).endswith(lora.A_SUFFIX)]
    assert vision  # the encoder really carries adapters


def _lora_trainer(run_dir, steps: int = 2):
    """The joint step (fsdp8 LLM, edp8 encoders) with rank-16 adapters on the LLM and the projector trainable,
    checkpointed every 2 steps."""
    from omnijax.data.loader import Loader, LoaderConfig, TrainerBatches
    from omnijax.parallel.multiplex import Multiplexer
    from omnijax.train.loop import Trainer
    from test_data_trainer import LOADER
    from test_mllm import MM, WORLD

    mm = from_dict(MMConfig, MM)
    cfg = from_dict(Config, {"model": {}, "trainer": {"steps": steps, "log_every": 1, "checkpoint_every": 2,
                                                      "progress": False, "trainable": ["projector"],
                                                      "lora": {"rank": 16, "alpha": 32.0}},
                             "optimizer": {"warmup_steps": 0, "weight_decay": 0.5}})
    placement = Multiplexer(LLMParallel("fsdp8", mm.llm), mm, encoder_layout="edp8", balance_rows=False)
    loader = TrainerBatches(Loader(LoaderConfig(**{**LOADER, "fixed_shapes": False}), mm_cfg=mm, world_cfg=WORLD))
    return Trainer(cfg, lambda: placement.prepare(mllm.MultimodalModel(mm, rngs=nnx.Rngs(0))), placement.loss_fn,
                   loader, placement=placement, run_dir=run_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two AdamW steps of `_lora_trainer`, checkpointed at step 2."""
    run_dir = tmp_path_factory.mktemp("lora")
    trainer = _lora_trainer(run_dir)
    before = jax.device_get(trainer.state.params)
    result = trainer.fit()
    return trainer, before, jax.device_get(result.state.params), run_dir


@pytest.mark.xdist_group("lora_run")
def test_lora_run_freezes_base_and_keeps_state_for_adapters_only(lora_run):
    trainer, before, after, run_dir = lora_run
    assert trainer.partition.trainable == ["lora", "projector"]
    changed = {}
    for (path, a), (_, b) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after)):
        changed[path] = not (np.array_equal(a[...], b[...]) and np.array_equal(np.signbit(a[...]), np.signbit(b[...])))
    for path, moved in changed.items():
        part = adapters.part_of(path)
        if part in ("lora", "projector"):
            continue
        assert not moved, path  # every base weight (LLM and encoders) bitwise as it was
    assert any(moved for p, moved in changed.items() if adapters.is_adapter(p) and str(p[-1]).endswith("_lora_b"))
    # Adam moments for the adapters and the projector only
    sizes = trainer.partition.sizes
    moments = sum(int(x.size) for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim > 0)
    assert moments == 2 * (sizes["lora"] + sizes["projector"])
    # the checkpoint holds the base once, the adapters, and those moments
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata((run_dir / "checkpoints" / "2" / "state").absolute())
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    saved = sum(int(np.prod(m.shape)) for m in jax.tree.leaves(tree["opt_state"]) if getattr(m, "shape", ()))
    assert saved == moments
    names = ["/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(tree["params"])[0]]
    llm = [n for n in names if n.startswith("llm/")]  # one layer: its q once, its adapter once
    assert sum("attn/q_lora_a" in n for n in llm) == 1 and sum(n.split("/")[-2:] in (["attn", "q"], ["q", "value"])
                                                               for n in llm) == 1


@pytest.mark.xdist_group("lora_run")
def test_resume_and_init_checkpoint_carry_adapters(lora_run):
    """Resuming the run restores its adapters and moments; a later stage started from its checkpoint
    (warmstart.params_from_run, init.checkpoint) gets its trained adapters."""
    from omnijax.train import warmstart

    trainer, _, after, run_dir = lora_run
    again = _lora_trainer(run_dir)
    assert again._restore() == 2
    for (path, a), (_, b) in zip(nnx.to_flat_state(jax.device_get(again.state.params)), nnx.to_flat_state(after)):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))
    for a, b in zip(jax.tree.leaves(jax.device_get(again.state.opt_state)),
                    jax.tree.leaves(jax.device_get(trainer.state.opt_state))):
        np.testing.assert_array_equal(a, b)
    fresh = trainer.state.params
    restored, step = warmstart.params_from_run(run_dir, fresh)
    assert step == 2
    for (path, a), (_, b) in zip(nnx.to_flat_state(jax.device_get(restored)), nnx.to_flat_state(after)):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))


# The PEFT tests build the same small HF models: on one worker the second and third reuse the first's op-by-op
# compiles (qwen2 alone: 5.6 CPU-s with torch imported; after llama: 0.9)
@pytest.mark.xdist_group("lora_peft")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_loads_our_adapter_and_merge_equals_peft(tmp_path, family):
    """The exported adapter under PEFT over the original folder gives omnijax's logits (1e-4), and the merged
    export equals PEFT's merge_and_unload (1e-5)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from omnijax.interop import peft as peft_io, pretrained

    torch.manual_seed(0)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
    hf_model = (LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=False)) if family == "llama" else
                Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=True)))
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.05)
    hf_model.save_pretrained(tmp_path / "base", safe_serialization=True)
    cfg = LoraConfig(rank=4, alpha=12.0)
    model = adapters.adapt(pretrained.load_llm(tmp_path / "base"), cfg)
    g, params, rest = nnx.split(model, nnx.Param, ...)
    key = iter(jax.random.split(jax.random.key(1), 64))
    params = jax.tree_util.tree_map_with_path(   # trained-looking adapters: A and B both non-zero
        lambda p, x: 0.2 * jax.random.normal(next(key), x.shape) if adapters.is_adapter(p) else x, params)
    ids = np.array([[5, 17, 33, 60, 90, 120, 7, 8, 9, 44, 51, 52]])
    ours = np.asarray(nnx.merge(g, params, rest)(jnp.asarray(ids)))
    peft_io.write_adapter(tmp_path / "adapter", params, cfg, str(tmp_path / "base"))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 12 and written["base_model_name_or_path"]
    assert sorted(written["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
    llm_cfg = pretrained.llm_config_from_folder(tmp_path / "base")
    pretrained.export_llm(adapters.merged_base(params), llm_cfg, tmp_path / "merged", like=tmp_path / "base")
    merged = peft_model.merge_and_unload().state_dict()
    ours_merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert sorted(merged) == sorted(ours_merged)
    assert max(float((merged[k] - ours_merged[k]).abs().max()) for k in merged) <= 1e-5


def test_qlora_train_step_keeps_codes_and_trains_adapters():
    """The trainer's step over an nf4 base: integer leaves pass the gradient clip and the update untouched."""
    from omnijax.config import OptimizerConfig
    from omnijax.train.optimizer import make_optimizer
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    model = adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0, base_dtype="nf4"))
    g, p, r = nnx.split(model, nnx.Param, ...)
    part = Partition(p)
    opt = make_optimizer(OptimizerConfig(warmup_steps=0, grad_clip=1e-3), 10, part)  # the clip acts
    step = jax.jit(make_train_step(g, r, lm_loss, opt, trainable=part.mask()))
    state, metrics = step(init_state(p, opt), BATCH)
    assert bool(jnp.isfinite(metrics["loss"])) and int(metrics["update_skipped"]) == 0
    before, after = nnx.to_flat_state(p), nnx.to_flat_state(state.params)
    for (path, a), (_, b) in zip(before, after):
        if str(path[-1]) in ("q", "down"):
            assert a[...].dtype == jnp.uint8 and np.array_equal(a[...], b[...])
        if str(path[-1]).endswith(lora.B_SUFFIX):
            assert not np.array_equal(a[...], b[...])


@pytest.mark.xdist_group("lora_peft")
def test_peft_adapter_imports(tmp_path):
    """init.adapter: an adapter PEFT saved (get_peft_model + save_pretrained) read into omnijax's adapters gives
    PEFT's logits (1e-4); its config sets rank, alpha and targets."""
    torch = pytest.importorskip("torch")
    peft_lib = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM
    from omnijax.interop import peft as peft_io, pretrained

    torch.manual_seed(1)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    tuned = peft_lib.get_peft_model(base, peft_lib.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                    "down_proj"]))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    tuned.save_pretrained(tmp_path / "adapter")
    cfg = peft_io.lora_config(tmp_path / "adapter")
    assert (cfg.rank, cfg.alpha, sorted(cfg.targets)) == (4, 8.0, ["down", "q", "v"])
    model = adapters.adapt(pretrained.load_llm(tmp_path / "base"), cfg)
    g, params, rest = nnx.split(model, nnx.Param, ...)
    params = peft_io.load_adapter(tmp_path / "adapter", params)
    ids = np.array([[3, 9, 27, 81, 14, 42, 99, 5]])
    ours = np.asarray(nnx.merge(g, params, rest)(jnp.asarray(ids)))
    with torch.no_grad():
        theirs = tuned.eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4


def test_pretrained_weights_enter_a_quantized_base():
    """with_base (init.llm / init.encoders into a QLoRA run): the loader sees the base dequantised under the plain
    model's paths, and what it returns is stored quantised again; the adapters are kept."""
    model = adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0, base_dtype="nf4"))
    params = nnx.state(model, nnx.Param)
    seen = {}

    def load(base):
        flat = list(nnx.to_flat_state(base))
        seen["paths"] = {tuple(p) for p, _ in flat}
        new = [(p, v.replace(jnp.full(v[...].shape, 0.5, v[...].dtype)) if str(p[-1]) == "q" else v) for p, v in flat]
        return nnx.from_flat_state(new)
    out = adapters.with_base(params, load)
    assert ("blocks", 0, "attn", "q") in seen["paths"]
    assert not any(adapters.is_adapter(p) or str(p[-1]).endswith(lora.SCALE_SUFFIX) for p in seen["paths"])
    q = out["blocks"][0]["attn"]["q"]
    assert q[...].dtype == jnp.uint8
    back = lora.dequantize(q[...], out["blocks"][0]["attn"]["q_qscale"][...], "nf4", jnp.float32)
    np.testing.assert_allclose(back, 0.5, rtol=1e-6)
    np.testing.assert_array_equal(out["blocks"][0]["attn"]["q_lora_a"][...], params["blocks"][0]["attn"]["q_lora_a"][...])
