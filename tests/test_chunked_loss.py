"""The chunked loss (models/losses.py::head_cross_entropy): the same numbers as the full-logits loss, on one
device and under the layouts (tp splitting the vocabulary, fsdp's explicit step, cp, pp), with no
[tokens x vocabulary] buffer in the compiled step, and chunks without loss positions skipped."""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.models import losses
from omnijax.models.llm import LLM
from omnijax.models.losses import chunked_cross_entropy, head_cross_entropy, lm_loss, masked_cross_entropy
from omnijax.parallel.engine import LLMParallel, unstack_params
from omnijax.train.step import loss_and_grads
from numerics import assert_grads_close
from test_parallel_llm import make_batch

pytestmark = pytest.mark.xdist_group("parallel_llm")


def _logits(h, w, tied):
    return jnp.einsum("bld,vd->blv" if tied else "bld,dv->blv", h, w, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_full_loss_and_gradients(tied):
    """Chunks that do not divide the row, rows without any loss position, masked targets outside the
    vocabulary (media placeholders) and chunks past every row's loss positions (skipped)."""
    rng = np.random.default_rng(1)
    b, l, d, v = 4, 37, 16, 50
    h = jnp.asarray(rng.normal(size=(b, l, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(v, d) if tied else (d, v)), jnp.float32)
    mask = (rng.random((b, l)) < 0.25).astype(np.float32)
    mask[0] = 0
    targets = rng.integers(0, v, (b, l)).astype(np.int32)
    targets[mask == 0] = v + 7  # never looked up
    t, m = jnp.asarray(targets), jnp.asarray(mask)

    def full(h, w):
        return masked_cross_entropy(_logits(h, w, tied), t, m)[0]

    def chunked(h, w):
        return chunked_cross_entropy(h, w, t, m, chunk=4, tied=tied)[0]

    ref, ref_g = jax.jit(jax.value_and_grad(full, (0, 1)))(h, w)
    got, got_g = jax.jit(jax.value_and_grad(chunked, (0, 1)))(h, w)
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))
    assert_grads_close(list(got_g), list(ref_g), rel=1e-5)
    # the count is every row's loss positions; at most ceil(max per row / chunk) chunks are computed
    assert float(chunked_cross_entropy(h, w, t, m, chunk=4, tied=tied)[1]) == mask.sum()
    order = np.argsort(mask <= 0, axis=1, kind="stable")
    packed = np.take_along_axis(mask, order, axis=1)
    nc = -(-l // 4)
    packed = np.pad(packed, ((0, 0), (0, nc * 4 - l))).reshape(b, nc, 4).transpose(1, 0, 2)
    needed = int(losses._chunks_needed(jnp.asarray(packed)))
    assert needed == -(-int(mask.sum(1).max()) // 4) < nc


def test_bf16_chunked_stays_close_to_full():
    """bf16 compute: the head's gradient summed over chunks in bf16 stays within bf16 rounding of the full path's."""
    rng = np.random.default_rng(2)
    b, l, d, v = 2, 64, 32, 96
    h = jnp.asarray(rng.normal(size=(b, l, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(d, v)) / 4, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, v, (b, l)), jnp.int32)
    m = jnp.ones((b, l), jnp.float32)
    full = jax.grad(lambda h, w: masked_cross_entropy(_logits(h, w, False), t, m)[0], (0, 1))(h, w)
    chunked = jax.grad(lambda h, w: chunked_cross_entropy(h, w, t, m, chunk=8, tied=False)[0], (0, 1))(h, w)
    for a, c in zip(chunked, full):
        assert a.dtype == c.dtype == jnp.bfloat16
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.abs(a - c).max() <= 3e-2 * np.abs(c).max()


def _big_buffers(hlo: str, elements: int) -> list[str]:
    shapes = set(re.findall(r"\b(?:f32|bf16)\[[0-9,]+\]", hlo))
    return sorted(s for s in shapes if math.prod(int(x) for x in s.split("[")[1][:-1].split(",")) >= elements)


def test_compiled_step_holds_one_chunk_of_logits():
    """Loss and gradients at a 32k vocabulary: the full path has [B, L, V] buffers, the chunked one none
    larger than a chunk, and XLA's temporary bytes fall by more than the logits' size."""
    b, l, d, v, chunk = 2, 256, 32, 32768, 32
    args = (jax.ShapeDtypeStruct((b, l, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((b, l), jnp.int32), jax.ShapeDtypeStruct((b, l), jnp.float32))

    def compiled(fn):
        return jax.jit(jax.value_and_grad(fn, (0, 1))).lower(*args).compile()

    full = compiled(lambda h, w, t, m: masked_cross_entropy(_logits(h, w, False), t, m)[0])
    chunked = compiled(lambda h, w, t, m: chunked_cross_entropy(h, w, t, m, chunk=chunk, tied=False)[0])
    logits_bytes = b * l * v * 4
    assert _big_buffers(full.as_text(), b * l * v)  # the check sees the logits where they exist
    assert _big_buffers(chunked.as_text(), 2 * b * chunk * v) == []
    saved = full.memory_analysis().temp_size_in_bytes - chunked.memory_analysis().temp_size_in_bytes
    assert saved > logits_bytes, (saved, logits_bytes)


# --- the model's loss under the layouts, against the single-device full-logits loss
CFG = LLMConfig(vocab_size=128, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                tie_embeddings=False, loss_chunk=8)
BATCH = make_batch(16, mask="answers")  # loss on each document's answer only, padding in row 0


@pytest.fixture(scope="module")
def reference():
    model = LLM(CFG, rngs=nnx.Rngs(0))
    full = LLM(dataclasses.replace(CFG, loss_chunk=0), rngs=nnx.Rngs(0))
    dev = jax.devices()[0]
    out = {}
    for name, m in (("full", full), ("chunked", model)):
        gd, params, rest = nnx.split(m, nnx.Param, ...)
        loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(gd, rest, lm_loss, p, b))(
            jax.device_put(params, dev), jax.device_put(BATCH, dev))
        out[name] = (float(loss), nnx.to_pure_dict(jax.device_get(grads)))
    return model, out


def test_one_device_chunked_equals_full(reference):
    _, out = reference
    (ref_loss, ref_grads), (loss, grads) = out["full"], out["chunked"]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_close(grads, ref_grads, rel=1e-5)


@pytest.mark.parametrize("layout,kw", [("pp2xdp2xtp2", {}), ("fsdp4xcp2", {"cp_impl": "allgather"}),
                                       ("pp2xfsdp2xcp2", {})])
def test_layouts_equal_the_full_logits_reference(reference, layout, kw):
    """tp2 splits the vocabulary of every chunk; fsdp4xcp2 runs the explicit shard_map step (local chunks);
    pp2xfsdp2xcp2 the pipeline with the sequence split."""
    model, out = reference
    ref_loss, ref_grads = out["full"]
    n = math.prod(int(t.lstrip("abcdefghijklmnopqrstuvwxyz")) for t in layout.split("x"))
    par = LLMParallel(layout, CFG, devices=jax.devices()[:n], **kw)
    gd, params, rest = nnx.split(par.prepare(model), nnx.Param, ...)
    params = jax.device_put(params, par.state_shardings(params))
    batch = par.put_batch(BATCH)
    grads_fn = par.grads_fn(par.loss_fn) or loss_and_grads
    loss, grads, _ = jax.jit(lambda p, b: grads_fn(gd, rest, par.loss_fn, p, b))(params, batch)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (float(loss), ref_loss)
    grads = jax.device_get(grads)
    grads = unstack_params(grads, par.schedule) if par.schedule else nnx.to_pure_dict(grads)
    assert_grads_close(grads, ref_grads)


def test_head_cross_entropy_chunk_zero_is_the_full_logits_path():
    """model.loss_chunk=0 (or a chunk as long as the row) is the old loss: logits of every position."""
    model = LLM(dataclasses.replace(CFG, loss_chunk=0), rngs=nnx.Rngs(0))
    h = jnp.ones((1, 8, CFG.embed_dim), jnp.float32)
    t, m = jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.float32)
    for chunk in (None, 8):
        jaxpr = str(jax.make_jaxpr(lambda x: head_cross_entropy(model, x, t, m, chunk=chunk))(h))
        assert "custom_vjp" not in jaxpr and "f32[1,8,128]" in jaxpr
    jaxpr = str(jax.make_jaxpr(lambda x: head_cross_entropy(model, x, t, m, chunk=2))(h))
    assert "custom_vjp" in jaxpr and "f32[1,8,128]" not in jaxpr


def test_multimodal_loss_chunked_equals_full():
    """mm_loss (encoders filling placeholders, loss on text targets only) through the chunked head."""
    from omnijax.config import from_dict
    from omnijax.data.packing import SamplePacker
    from omnijax.data.world import World
    from omnijax.mm_config import MMConfig
    from omnijax.models import mllm
    from test_mllm import CAP, MM, WORLD

    out = []
    for chunk in (0, 16):
        cfg = from_dict(MMConfig, {**MM, "llm": {**MM["llm"], "loss_chunk": chunk}})
        batch, _ = SamplePacker(cfg, 4, 96, CAP).pack(World(WORLD).sample(i) for i in range(40))
        model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
        gd, params, rest = nnx.split(model, nnx.Param, ...)
        loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(gd, rest, mllm.mm_loss, p, b))(params, batch)
        out.append((float(loss), nnx.to_pure_dict(jax.device_get(grads))))
    (ref, ref_g), (got, got_g) = out
    assert abs(got - ref) <= 1e-5 * abs(ref)
    assert_grads_close(got_g, ref_g, rel=1e-5)
