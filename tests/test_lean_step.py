"""The lean sharded LLM step: gradients reduce-scattered into their FSDP shards, an embedding lookup that
moves ids and rows (never the table), a non-finite guard that does not copy the donated state, and the
same numbers as one device over several updates."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import omnijax  # noqa: F401
from omnijax.config import Config, LLMConfig
from omnijax.models.llm import LLM
from omnijax.parallel.engine import LLMParallel, all_reduce_then_slice
from omnijax.train import step as step_lib
from omnijax.train.loop import Trainer
from omnijax.models.losses import lm_loss
from omnijax.train.placement import DataParallel
from omnijax.train.state import init_state

pytestmark = pytest.mark.xdist_group("lean_step")

V, D = 320, 64  # a vocab size no other weight shares, so the table's shapes are recognisable in HLO
TIED = LLMConfig(vocab_size=V, embed_dim=D, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
UNTIED = LLMConfig(vocab_size=V, embed_dim=D, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                   tie_embeddings=False)
B, L, STEPS = 8, 32, 4


def batch(i: int) -> dict:
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, V, (B, L)).astype(np.int32)
    seg = np.ones((B, L), np.int32)
    seg[:, 20:] = 2
    pos = np.concatenate([np.arange(20), np.arange(L - 20)])[None].repeat(B, 0).astype(np.int32)
    return dict(tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=seg, positions=pos,
                loss_mask=np.ones((B, L), np.float32))


class Loader:
    def __init__(self):
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.step += 1
        return batch(self.step)

    def get_state(self):
        return {"step": self.step}

    def set_state(self, state):
        self.step = state["step"]


def config(model: LLMConfig, layout: str = "") -> Config:
    cfg = Config()
    cfg.model = model
    cfg.parallel.llm = layout
    cfg.optimizer.lr, cfg.optimizer.warmup_steps = 1e-2, 0
    cfg.trainer.steps, cfg.trainer.log_every, cfg.trainer.progress = STEPS, 1, False
    cfg.trainer.checkpoint_every = 0
    return cfg


def trainer(model: LLMConfig, layout: str, tmp) -> tuple[Trainer, object]:
    cfg = config(model, layout)
    build = lambda: LLM(model, rngs=nnx.Rngs(0))  # noqa: E731
    if not layout:
        placement = DataParallel(jax.devices()[:1])
        return Trainer(cfg, build, lm_loss, Loader(), placement=placement, run_dir=tmp), placement
    par = LLMParallel.from_config(cfg)
    return Trainer(cfg, lambda: par.prepare(build()), par.loss_fn, Loader(), placement=par, run_dir=tmp), par


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Loss and grad norm at every step, per layout (tied embeddings), and the trainers."""
    out = {}
    for layout in ("", "fsdp8", "pp2xfsdp2xtp2"):
        t, par = trainer(TIED, layout, tmp_path_factory.mktemp(layout or "one"))
        result = t.fit()
        out[layout] = (t, par, [(r["loss"], r["grad_norm"]) for r in result.history])
    return out


def compiled_text(t: Trainer, par) -> str:
    return t._step.lower(t.state, par.put_batch(batch(0))).compile().as_text()


def collectives(hlo: str) -> list[tuple[str, str, str]]:
    """(kind, result shape, op_name) of every collective in compiled HLO text (tuple results split)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", line)
        if m:
            name = re.search(r'op_name="([^"]*)"', line)
            for shape in re.findall(r"[a-z0-9]+\[[0-9,]*\]", m.group(1)):
                out.append((m.group(2), shape, name.group(1) if name else ""))
    return out


@pytest.mark.parametrize("layout", ["fsdp8", "pp2xfsdp2xtp2"])
def test_layout_matches_one_device_every_step(runs, layout):
    ref, got = runs[""][2], runs[layout][2]
    assert len(ref) == len(got) == STEPS
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert abs(l1 - l0) <= 1e-5 * abs(l0), (layout, ref, got)
        assert abs(g1 - g0) <= 1e-5 * abs(g0), (layout, ref, got)
    assert ref[-1][0] < ref[0][0]  # it learns: later steps see different params


def test_fsdp_grads_reduce_scatter_and_state_is_one_eighth(runs):
    t, par, _ = runs["fsdp8"]
    text = compiled_text(t, par)
    ops = collectives(text)
    kinds = {k for k, _, _ in ops}
    assert "reduce-scatter" in kinds
    assert all_reduce_then_slice(text) == 0
    # no gradient is all-reduced: every all-reduce is a scalar (loss, norms, token counts)
    assert all(shape.endswith("[]") for k, shape, _ in ops if k == "all-reduce"), ops
    state = (t.state.params, t.state.opt_state)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    dev0 = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
               if s.device == jax.devices()[0])
    assert dev0 <= total / 8 * 1.01


def test_all_reduce_then_slice_is_seen():
    """The HLO check the FSDP test relies on finds the pattern where GSPMD leaves it: a row-sharded
    operand's column sums wanted sharded come out as a full all-reduce and a slice on XLA:CPU."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    fn = jax.jit(lambda a: a.sum(0), in_shardings=NamedSharding(mesh, P("x")), out_shardings=NamedSharding(mesh, P("x")))
    text = fn.lower(jnp.ones((64, 64))).compile().as_text()
    assert all_reduce_then_slice(text) >= 1
    scatter = jax.jit(jax.shard_map(lambda a: jax.lax.psum_scatter(a.sum(0), "x", tiled=True), mesh=mesh,
                                    in_specs=P("x"), out_specs=P("x")))
    assert all_reduce_then_slice(scatter.lower(jnp.ones((64, 64))).compile().as_text()) == 0


@pytest.mark.parametrize("layout", ["fsdp8", "fsdp4xtp2"])
def test_lookup_never_gathers_the_table(tmp_path, layout):
    """Untied: the table is only looked up, so no device ever gathers it whole (or a whole column/row
    block of it), and its gradient is not all-reduced at full size. (The head [D, V] is a different
    weight: its einsum `bld,dv->blv` is left out; under tp, GSPMD still all-reduces its gradient.)"""
    t, par = trainer(UNTIED, layout, tmp_path)
    ops = collectives(compiled_text(t, par))
    table_like = {f"f32[{V},{D}]", f"f32[{V // 2},{D}]", f"f32[{V},{D // 4}]", f"f32[{V},{D // 2}]"}
    bad = [(k, s, n) for k, s, n in ops if s in table_like and k in ("all-gather", "all-reduce") and "dv->blv" not in n]
    assert not bad, bad
    assert any(k == "all-to-all" and "shard_map" in n for k, _, n in ops)  # looked-up rows go to their batch shard


def test_nonfinite_step_is_skipped_and_counted(runs):
    t, par, _ = runs["fsdp8"]
    before = jax.device_get((t.state.params, t.state.opt_state, t.state.step))
    bad = batch(7)
    bad["loss_mask"][0, 0] = np.nan
    state, m = t._step(t.state, par.put_batch(bad))
    t.state = state
    assert int(m["update_skipped"]) == 1 and int(state.skipped_updates) == 1 and int(state.nonfinite_in_row) == 1
    after = jax.device_get((state.params, state.opt_state, state.step))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    state, m = t._step(t.state, par.put_batch(batch(8)))  # a good step updates again and resets the run
    t.state = state
    assert int(m["update_skipped"]) == 0 and int(state.nonfinite_in_row) == 0 and int(state.skipped_updates) == 1


def _where_guard(state, grads, optimizer, finite, trainable=None):
    """The old guard (select over every leaf), kept here as the baseline the cond is measured against."""
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new = optax.apply_updates(state.params, updates)
    keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)  # noqa: E731
    return state.replace(step=state.step + finite.astype(jnp.int32), params=keep(new, state.params),
                         opt_state=keep(new_opt, state.opt_state),
                         nonfinite_in_row=jnp.where(finite, 0, state.nonfinite_in_row + 1),
                         skipped_updates=state.skipped_updates + 1 - finite.astype(jnp.int32))


def test_guard_does_not_copy_donated_state(monkeypatch):
    graphdef, params, rest = nnx.split(LLM(TIED, rngs=nnx.Rngs(0)), nnx.Param, ...)
    opt = optax.adamw(1e-3)
    state = init_state(params, opt)
    b = {k: jnp.asarray(v[:2]) for k, v in batch(0).items()}

    def state_copies() -> int:
        text = jax.jit(step_lib.make_train_step(graphdef, rest, lm_loss, opt), donate_argnums=0) \
            .lower(state, b).compile().as_text()
        return len(re.findall(r" copy\(%state_(?:params|opt_state)", text)), "conditional(" in text

    copies, has_cond = state_copies()
    assert copies == 0 and has_cond
    monkeypatch.setattr(step_lib, "apply_update", _where_guard)
    where_copies, _ = state_copies()
    assert where_copies >= len(jax.tree.leaves(state.opt_state)) // 2  # the baseline does copy: the check sees it


def test_dryrun_activation_estimate_follows_remat_and_sharding():
    """The dryrun's activation bytes: remat full < save_dots < none, and each sharding axis divides what
    it splits (batch shards and cp the tokens, pp the layers, tp the head/MLP parts and the logits)."""
    from omnijax.parallel.mesh import Layout
    from omnijax.train.dryrun import llm_activation_bytes

    one = Layout()
    est = {r: llm_activation_bytes(UNTIED, one, B, L, r, 4) for r in ("none", "full", "save_dots")}
    assert est["full"] < est["save_dots"] < est["none"]
    for r, v in est.items():
        assert llm_activation_bytes(UNTIED, Layout(fsdp=8), B, L, r, 4) == pytest.approx(v / 8)
        assert llm_activation_bytes(UNTIED, Layout(dp=2, cp=4), B, L, r, 4) == pytest.approx(v / 8)
    layers = est["none"] - B * L * V * 4  # the per-layer part, logits aside
    assert llm_activation_bytes(UNTIED, Layout(pp=2), B, L, "none", 4) == pytest.approx(layers / 2 + B * L * V * 4)
    tp = llm_activation_bytes(UNTIED, Layout(tp=2), B, L, "none", 4)
    assert est["none"] / 2 < tp < est["none"]
    assert llm_activation_bytes(UNTIED, one, B, L, "none", 2) < est["none"]  # bf16 halves the saved layers
