"""Frozen parts (trainer.trainable) and per-part learning rates (optimizer.lr_scale): an optax partition, gradients
w.r.t. the trainable leaves only, frozen leaves bitwise unchanged and without optimizer state, on 8 devices."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from omnijax.config import Config, OptimizerConfig, from_dict
from omnijax.data.loader import Loader, LoaderConfig, TrainerBatches
from omnijax.errors import ConfigError
from omnijax.models import mllm
from omnijax.models.objective import loss_and_grads
from omnijax.mm_config import MMConfig
from omnijax.train.loop import Trainer
from omnijax.train.optimizer import make_optimizer
from omnijax.train.parts import Partition
from test_data_trainer import LOADER
from test_mllm import MM, WORLD


def _parts(tree) -> dict:
    pure = nnx.to_pure_dict(jax.device_get(tree))
    out = {"llm": pure["llm"], "projector": pure["projectors"]}
    out.update(pure["encoders"])
    return out


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) and
                                      np.array_equal(np.signbit(x), np.signbit(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    """Two AdamW steps (weight decay on) of the joint multimodal step (fsdp4 x tp2 LLM, edp8 encoders) with only
    the projector and the vision encoder training, the vision encoder at a tenth of the learning rate."""
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer

    run_dir = tmp_path_factory.mktemp("frozen")
    mm = from_dict(MMConfig, MM)
    cfg = from_dict(Config, {"model": {}, "trainer": {"steps": 2, "log_every": 1, "checkpoint_every": 2,
                                                      "progress": False, "trainable": ["projector", "vision"]},
                             "optimizer": {"warmup_steps": 0, "weight_decay": 0.5, "lr_scale": {"vision": 0.1}}})
    placement = Multiplexer(LLMParallel("fsdp8", mm.llm), mm, encoder_layout="edp8", balance_rows=False)
    loader = TrainerBatches(Loader(LoaderConfig(**{**LOADER, "fixed_shapes": False}), mm_cfg=mm, world_cfg=WORLD))
    trainer = Trainer(cfg, lambda: placement.prepare(mllm.MultimodalModel(mm, rngs=nnx.Rngs(0))), placement.loss_fn,
                      loader, placement=placement, run_dir=run_dir)
    before = _parts(trainer.state.params)
    result = trainer.fit()
    return trainer, before, _parts(result.state.params), run_dir


def test_frozen_parts_bitwise_unchanged_and_hold_no_optimizer_state(frozen_run):
    trainer, before, after, run_dir = frozen_run
    assert set(trainer.partition.trainable) == {"vision", "projector"}
    assert _same(before["llm"], after["llm"]) and _same(before["audio"], after["audio"])
    assert not _same(before["projector"], after["projector"]) and not _same(before["vision"], after["vision"])
    # Adam moments exist for the trainable parts only: 2 x their parameters (+ scalar step counters)
    sizes = trainer.partition.sizes
    moments = sum(int(x.size) for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim > 0)
    assert moments == 2 * (sizes["projector"] + sizes["vision"])
    # ... and so does the checkpoint on disk: its optimizer arrays add up to the same count
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata((run_dir / "checkpoints" / "2" / "state").absolute())
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    saved = sum(int(np.prod(m.shape)) for m in jax.tree.leaves(tree["opt_state"]) if getattr(m, "shape", ()))
    assert saved == moments
    # the layout really is sharded: an LLM weight is split over fsdp8
    llm_leaf = max(jax.tree.leaves(trainer.state.params["llm"]), key=lambda x: x.size)
    assert len(llm_leaf.sharding.device_set) == 8 and llm_leaf.addressable_shards[0].data.size < llm_leaf.size


def test_trainable_gradient_only_and_per_part_learning_rate():
    """The gradient w.r.t. the trainable leaves equals the full gradient's, frozen leaves get zeros, the frozen
    encoders' backward pass is not traced at all, and lr_scale scales exactly one part's SGD update."""
    from omnijax.data.world import World
    from omnijax.data.packing import SamplePacker as Packer

    cfg = from_dict(MMConfig, MM)
    batch, _ = Packer(cfg, 4, 96, {"vision": 256, "audio": 256}).pack(World(WORLD).sample(i) for i in range(40))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    part = Partition(params, ["projector"], {"projector": 0.5})
    mask = part.mask()
    full = lambda p: loss_and_grads(graphdef, rest, mllm.mm_loss, p, batch)  # noqa: E731
    only = lambda p: loss_and_grads(graphdef, rest, mllm.mm_loss, p, batch, trainable=mask)  # noqa: E731
    (l1, g1, _), (l2, g2, _) = jax.jit(full)(params), jax.jit(only)(params)
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    for t, a, b in zip(mask, jax.tree.leaves(g1), jax.tree.leaves(g2)):
        if t:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(jnp.abs(a).max() + 1e-12))
        else:
            assert not np.any(np.asarray(b))

    def dots(fn):
        return str(jax.make_jaxpr(fn)(params)).count("dot_general")
    assert dots(only) < dots(full)  # no backward through the frozen encoders' matmuls

    sgd = OptimizerConfig(name="sgd", lr=0.1, b1=0.0, warmup_steps=0, grad_clip=0.0, min_lr_ratio=1.0)
    base = make_optimizer(sgd, 10, Partition(params, ["projector", "llm"]))
    scaled = make_optimizer(sgd, 10, Partition(params, ["projector", "llm"], {"projector": 0.5}))
    u_base, _ = base.update(g1, base.init(params), params)
    u_scaled, _ = scaled.update(g1, scaled.init(params), params)
    for p, a, b in zip(part.leaf_parts, jax.tree.leaves(u_base), jax.tree.leaves(u_scaled)):
        np.testing.assert_allclose(b, a * (0.5 if p == "projector" else 1.0), rtol=1e-6, atol=1e-12)
        if p in ("vision", "audio"):
            assert not np.any(np.asarray(b))  # frozen under both


def test_unknown_parts_are_one_line_errors():
    params = nnx.state(nnx.eval_shape(lambda: mllm.MultimodalModel(from_dict(MMConfig, MM), rngs=nnx.Rngs(0))), nnx.Param)
    with pytest.raises(ConfigError, match="trainer.trainable: this model has no part 'visoin'; its parts are"):
        Partition(params, ["visoin"])
    with pytest.raises(ConfigError, match="optimizer.lr_scale.projectr"):
        Partition(params, None, {"projectr": 0.1})
    assert Partition(params).is_trivial and not Partition(params, ["llm"]).is_trivial
    assert isinstance(make_optimizer(OptimizerConfig(), 10, Partition(params, ["llm"])), optax.GradientTransformation)
