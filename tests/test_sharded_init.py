"""Sharded initialisation: parameters and optimizer state are created in their shardings, so no device
ever holds a full-size copy of a weight that the layout splits (an 8B model's state fits no device)."""
from __future__ import annotations

import math

import jax
import pytest
from flax import nnx

import omnijax  # noqa: F401
from omnijax.config import Config, LLMConfig
from omnijax.models.llm import LLM
from omnijax.parallel.engine import LLMParallel
from omnijax.parallel.rules import promised_bytes
from omnijax.train import state as state_lib
from omnijax.train.loop import Trainer
from omnijax.models.losses import lm_loss
from omnijax.train.placement import DataParallel

pytestmark = pytest.mark.xdist_group("sharded_init")

CFG = LLMConfig(vocab_size=320, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)


class NoLoader:
    def __next__(self):
        raise AssertionError("not used")

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def config(layout: str) -> Config:
    cfg = Config()
    cfg.model, cfg.parallel.llm = CFG, layout
    cfg.trainer.checkpoint_every, cfg.trainer.progress = 0, False
    return cfg


def full_shapes() -> set[tuple[int, ...]]:
    """Full shapes of every parameter with at least 2 axes (each is split 8 ways under fsdp8)."""
    abstract = nnx.state(nnx.eval_shape(lambda: LLM(CFG, rngs=nnx.Rngs(0))), nnx.Param)
    return {tuple(x.shape) for x in jax.tree.leaves(abstract) if len(x.shape) >= 2}


def unsharded_full_size(shapes: set, exclude: frozenset = frozenset()) -> list:
    """Live arrays (other than `exclude`, by id) of a parameter's full shape held whole by one device."""
    return [a.shape for a in jax.live_arrays() if id(a) not in exclude
            and tuple(a.shape) in shapes and any(s.data.shape == a.shape for s in a.addressable_shards)]


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory):
    shapes = full_shapes()
    seen: list = []
    real_init_state = state_lib.init_state
    before = frozenset(map(id, jax.live_arrays()))  # other tests' arrays

    def watching_init_state(params, optimizer, extra=None):  # called inside the init, params and all
        seen.extend(unsharded_full_size(shapes, before))
        return real_init_state(params, optimizer, extra)

    state_lib.init_state = watching_init_state
    try:
        cfg = config("fsdp8")
        par = LLMParallel.from_config(cfg)
        t = Trainer(cfg, lambda: par.prepare(LLM(CFG, rngs=nnx.Rngs(0))), par.loss_fn, NoLoader(), placement=par,
                    run_dir=tmp_path_factory.mktemp("init"))
        seen.extend(unsharded_full_size(shapes, before))
    finally:
        state_lib.init_state = real_init_state
    return t, par, seen


def test_no_full_size_parameter_on_one_device(fsdp8):
    _, _, seen = fsdp8
    assert seen == []


def test_per_device_state_is_one_eighth(fsdp8):
    t, par, _ = fsdp8
    state = (t.state.params, t.state.opt_state)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    for dev in jax.devices():
        mine = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == dev)
        assert mine <= total / 8 * 1.01  # only scalars (the AdamW count) are replicated
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(t.state.params))


def test_concrete_model_would_be_caught(tmp_path):
    """The check above is not vacuous: a model built on one device (the old path) is seen."""
    shapes = full_shapes()
    before = frozenset(map(id, jax.live_arrays()))
    model = LLM(CFG, rngs=nnx.Rngs(0))
    assert unsharded_full_size(shapes, before)
    del model


def test_pipelined_layout_initialises_to_its_promise(tmp_path):
    cfg = config("pp2xfsdp2xtp2")
    par = LLMParallel.from_config(cfg)
    t = Trainer(cfg, lambda: par.prepare(LLM(CFG, rngs=nnx.Rngs(0))), par.loss_fn, NoLoader(), placement=par,
                run_dir=tmp_path)
    state = (t.state.params, t.state.opt_state)
    shardings = par.state_shardings(t.state)
    promised = promised_bytes(state, (shardings.params, shardings.opt_state))
    got = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
              if s.device == jax.devices()[0])
    assert got == promised
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    assert got <= total / 4  # pp2 x fsdp2 x tp2: most bytes split 4-8 ways


def test_sharded_init_equals_eager_init():
    """The same random parameters as building the model eagerly on one device (values do not depend on
    the layout, so runs under different layouts start from the same point)."""
    import numpy as np
    import optax

    par = DataParallel(jax.devices()[:1])
    eager = nnx.state(LLM(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    layout = LLMParallel("fsdp8", CFG)
    _, _, st = state_lib.sharded_init(lambda: LLM(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-3),
                                      layout.state_shardings, layout.mesh)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(st.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert math.prod(st.params["embedding"][...].sharding.shard_shape((320, 64))) == 320 * 64 // 8
    del par


def test_trainer_rejects_a_non_model(tmp_path):
    from omnijax.errors import UserError

    with pytest.raises(UserError, match="nnx.Module or a function"):
        Trainer(config(""), 42, lm_loss, NoLoader(), run_dir=tmp_path)
