"""LoRA / QLoRA adapters (trainer.lora): the adapted model computes x·W + alpha/r·(x·A)·B, every layout gives the
single-device loss and adapter gradients, the base stays bitwise frozen with no optimizer state, checkpoints carry
the adapters, and PEFT over the original Hugging Face folder computes what omnijax computes."""
from __future__ import annotations

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
    """Adapters with B != 0 (as after training), the same in every layout: B = value everywhere."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.full_like(x, value) if any(str(getattr(k, "key", "")).endswith(lora.B_SUFFIX) for k in p)
        else x, params)


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
