"""Stale data parallelism: each mode against its update rule computed by hand, FSDP = DP, exact resume."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.train.state import init_state
from omnijax.train.staleness import (StalenessSpec, init_extra, make_stale_step, stale_state_shardings,
                                     data_axes)

LR, LAM, W = 0.1, 0.5, 1
STEPS = 4


class Line(nnx.Module):
    """y = a·x + b: two scalars, so every update rule is checked exactly by hand."""

    def __init__(self):
        self.a = nnx.Param(jnp.asarray(0.3))
        self.b = nnx.Param(jnp.asarray(-0.2))


def line_loss(model, batch):
    pred = model.a[...] * batch["x"] + model.b[...]
    err = (pred - batch["y"]) ** 2 * batch["loss_mask"]
    return jnp.sum(err), jnp.sum(batch["loss_mask"]), {}


def line_batches(n=STEPS, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=rows).astype(np.float32)
        out.append({"x": x, "y": (1.5 * x + 0.7 + 0.1 * rng.normal(size=rows)).astype(np.float32),
                    "loss_mask": np.ones(rows, np.float32)})
    return out


def hand_grad(a, b, x, y, total):
    r = a * x + b - y
    return np.array([np.sum(2 * r * x), np.sum(2 * r)]) / total


def hand_run(mode: str, batches, adaptive=False, dev=8):
    """The update rules of omnijax.train.staleness, in float64 numpy."""
    w = np.array([0.3, -0.2])
    prev_w, prev_local, v = w.copy(), None, np.zeros(2)
    for t, bt in enumerate(batches):
        x, y = bt["x"].astype(np.float64), bt["y"].astype(np.float64)
        total = len(x)
        xs, ys = np.split(x, dev), np.split(y, dev)
        stale = t >= W
        if stale and "wp" in mode:   # each device at its own prediction w - lr * R * g_local
            local = [hand_grad(*(w - LR * dev * prev_local[i]), xs[i], ys[i], total) for i in range(dev)]
        else:
            local = [hand_grad(*w, xs[i], ys[i], total) for i in range(dev)]
        g = np.sum(prev_local, 0) if stale else np.sum(local, 0)
        if "dc" in mode:
            if adaptive:
                v = 0.95 * v + 0.05 * g * g
                lam = LAM / np.sqrt(v + 1e-7)
            else:
                lam = LAM
            if stale:
                g = g + lam * g * g * (w - prev_w)
            prev_w = w.copy()
        w = w - LR * g
        prev_local = local
    return w


@pytest.fixture(scope="module")
def dp_mesh():
    return Mesh(np.array(jax.devices()), ("dp",))


def run_mode(mesh, mode, batches, adaptive=False, optimizer=None):
    model = Line()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optimizer or optax.sgd(LR)
    spec = StalenessSpec(mode=mode, dc_lambda=LAM, dc_adaptive=adaptive, warmup_steps=W)
    pspecs = jax.tree.map(lambda _: P(), params)
    state = init_state(params, optimizer, init_extra(params, spec, 8))
    ospecs = jax.tree.map(lambda _: P(), state.opt_state)
    shard = stale_state_shardings(state, mesh, pspecs, ospecs)
    state = jax.device_put(state, shard)
    step = jax.jit(make_stale_step(graphdef, rest, line_loss, optimizer, mesh, pspecs, ospecs, spec,
                                   state_shardings=shard))
    bs = NamedSharding(mesh, P(data_axes(mesh)))
    flags = []
    for b in batches:
        state, m = step(state, jax.device_put(b, bs))
        flags.append(int(m["stale"]))
    return state, flags


@pytest.mark.parametrize("mode,adaptive", [("stale1", False), ("stale1+dc", False), ("stale1+dc", True),
                                           ("stale1+wp", False), ("stale1+dc+wp", False)])
def test_mode_matches_hand_rule(dp_mesh, mode, adaptive):
    batches = line_batches()
    state, flags = run_mode(dp_mesh, mode, batches, adaptive)
    assert flags == [0] + [1] * (STEPS - 1)       # one synchronous warm-up step, then stale
    got = np.array([float(state.params["a"][...]), float(state.params["b"][...])])
    want = hand_run(mode, batches, adaptive)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # and the rule really differs from synchronous SGD (the test could not pass with a sync step)
    w = np.array([0.3, -0.2])
    for b in batches:
        w = w - LR * hand_grad(*w, b["x"].astype(np.float64), b["y"].astype(np.float64), len(b["x"]))
    assert np.abs(got - w).max() > 1e-4


def test_modes_differ_from_each_other(dp_mesh):
    """The library's compensations change its updates (the hand rules could agree with the step and still
    leave every mode the same)."""
    batches = line_batches()
    finals = {}
    for m in ("stale1", "stale1+dc", "stale1+wp"):
        state, _ = run_mode(dp_mesh, m, batches)
        finals[m] = np.array([float(state.params["a"][...]), float(state.params["b"][...])])
    assert np.abs(finals["stale1"] - finals["stale1+dc"]).max() > 1e-5
    assert np.abs(finals["stale1"] - finals["stale1+wp"]).max() > 1e-5


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def mlp_loss(model, batch):
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) * batch["loss_mask"]
    return jnp.sum(ce), jnp.sum(batch["loss_mask"]), {}


def _mlp_setup(mesh, fsdp: bool, mode="stale1+dc+wp"):
    model = Mlp(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(1e-2)
    spec = StalenessSpec(mode=mode, dc_lambda=0.1, dc_adaptive=True, warmup_steps=1)
    state = init_state(params, opt, init_extra(params, spec, 8))
    shard_dim0 = lambda x: P("fsdp") if (fsdp and x.ndim >= 1 and x.shape[0] % 4 == 0) else P()
    pspecs = jax.tree.map(shard_dim0, params)
    ospecs = jax.tree.map(lambda x: shard_dim0(x) if hasattr(x, "ndim") else P(), state.opt_state)
    shard = stale_state_shardings(state, mesh, pspecs, ospecs)
    state = jax.device_put(state, shard)
    step = jax.jit(make_stale_step(graphdef, rest, mlp_loss, opt, mesh, pspecs, ospecs, spec, state_shardings=shard),
                   donate_argnums=0)
    return state, step, NamedSharding(mesh, P(data_axes(mesh)))


def mlp_batches(n=STEPS):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.integers(0, 4, 16).astype(np.int32),
             "loss_mask": np.ones(16, np.float32)} for _ in range(n)]


@pytest.fixture(scope="module")
def dp8_mlp(dp_mesh):
    state, step, bs = _mlp_setup(dp_mesh, fsdp=False)
    return step, bs


def test_fsdp_layout_equals_dp(dp8_mlp):
    devs = np.array(jax.devices())
    results = {}
    for name, mesh in {"dp8": Mesh(devs, ("dp",)), "dp2xfsdp4": Mesh(devs.reshape(2, 4), ("dp", "fsdp"))}.items():
        state, step, bs = _mlp_setup(mesh, fsdp=name != "dp8")
        if name == "dp8":
            step, bs = dp8_mlp
        for b in mlp_batches():
            state, _ = step(state, jax.device_put(b, bs))
        results[name] = jax.device_get(state.params)
        if name != "dp8":   # really sharded: each device holds a quarter of l1's kernel rows
            kernel = state.params["l1"]["kernel"][...]
            assert kernel.addressable_shards[0].data.shape == (2, 16)
            txt = step.lower(state, jax.device_put(mlp_batches(1)[0], bs)).as_text()
            assert "reduce_scatter" in txt
    for a, b in zip(jax.tree.leaves(results["dp8"]), jax.tree.leaves(results["dp2xfsdp4"])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_resume_is_exact(tmp_path, dp_mesh, dp8_mlp):
    from omnijax.train.checkpoint import Checkpointer, abstract_like

    batches = mlp_batches(6)
    state, _, _ = _mlp_setup(dp_mesh, fsdp=False)
    step, bs = dp8_mlp
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    for i, b in enumerate(batches):
        state, _ = step(state, jax.device_put(b, bs))
        if i == 2:
            ckpt.save(3, state)
    straight = jax.device_get(state)
    restored, _, at = ckpt.restore(abstract_like(state))
    assert at == 3 and set(restored.extra) == {"local_grads", "prev_params", "grad_sq"}
    for b in batches[3:]:
        restored, _ = step(restored, jax.device_put(b, bs))
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(jax.device_get(restored))):
        np.testing.assert_array_equal(a, b)
    ckpt.close()


def test_bad_config_errors():
    with pytest.raises(ConfigError, match="trainer.staleness"):
        StalenessSpec(mode="stale2")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
    with pytest.raises(ConfigError, match="dp/fsdp only"):
        data_axes(mesh)
