"""The training step: global-mean loss, gradient accumulation, mixed precision, non-finite guard."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from omnijax.config import LLMConfig, OptimizerConfig
from omnijax.data import stdlib_text
from omnijax.models.llm import LLM
from omnijax.models.losses import lm_loss
from omnijax.train.optimizer import make_optimizer
from omnijax.train.state import init_state
from omnijax.train.step import loss_and_grads, make_train_step

TINY = LLMConfig(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)


@pytest.fixture(scope="module")
def setup():
    model = LLM(TINY, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = stdlib_text.packed("train", 32, seed=0).batch(0, 8)
    return graphdef, params, rest, {k: jnp.asarray(v) for k, v in batch.items()}


def test_grad_accumulation_equals_one_big_batch(setup):
    graphdef, params, rest, batch = setup
    f = jax.jit(lambda p, b, a: loss_and_grads(graphdef, rest, lm_loss, p, b, grad_accum=a)[:2], static_argnums=2)
    loss1, g1 = f(params, batch, 1)
    loss4, g4 = f(params, batch, 4)
    assert float(loss1) == pytest.approx(float(loss4), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # the loss is the token-weighted mean cross entropy over the whole batch (the forward compiled as one
    # program: run op by op, it compiled each of its hundreds of ops alone, most of this test's time)
    forward = jax.jit(lambda p, b: nnx.merge(graphdef, p, rest)(b["tokens"], b["segment_ids"], b["positions"]))
    logits = forward(params, batch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    expected = (ce * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    assert float(loss1) == pytest.approx(float(expected), rel=1e-5)


def test_bf16_compute_keeps_fp32_masters(setup):
    graphdef, params, rest, batch = setup
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), 10)
    step = jax.jit(make_train_step(graphdef, rest, lm_loss, opt, compute_dtype=jnp.bfloat16))
    state, m = step(init_state(params, opt), batch)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
    assert np.isfinite(float(m["loss"])) and int(state.step) == 1


def test_nonfinite_loss_skips_update_and_counts(setup):
    graphdef, params, rest, batch = setup
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), 10)
    step = jax.jit(make_train_step(graphdef, rest, lm_loss, opt))
    bad = jax.tree.map(lambda p: p.at[(0,) * p.ndim].set(jnp.nan) if p.ndim == 2 else p, params)
    state0 = init_state(bad, opt)
    state1, m = step(state0, batch)
    assert int(m["update_skipped"]) == 1 and int(state1.step) == 0
    assert int(state1.nonfinite_in_row) == 1 and int(state1.skipped_updates) == 1
    good, _ = step(init_state(params, opt), batch)
    assert int(good.step) == 1 and int(good.nonfinite_in_row) == 0
