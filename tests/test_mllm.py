"""Multimodal assembly: placeholders filled by encoders, gradients reach encoders, registry, bad input."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from omnijax.config import from_dict
from omnijax.data import tokenizer
from omnijax.data.sample import Sample, Segment, text
from omnijax.data.world import Tail, World, WorldConfig
from omnijax.errors import ConfigError
from omnijax.models import mllm
from omnijax.mm_config import MMConfig
from omnijax.train.state import init_state
from omnijax.train.step import make_train_step
from omnijax.data.packing import SamplePacker as Packer

MM = {"llm": {"vocab_size": 512, "embed_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
              "mlp_dim": 64, "max_seq_len": 96},
      "encoders": {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 32,
                              "embed_dim": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64},
                   "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 32, "num_layers": 1,
                             "num_heads": 2, "mlp_dim": 64}}}
CAP = {"vision": 256, "audio": 256}
WORLD = WorldConfig(image_side=Tail(16, 32, 1.3), video_side=Tail(16, 24, 1.5), video_frames=Tail(2, 4, 1.2),
                    audio_items=Tail(1, 3, 1.2), text_words=Tail(2, 8, 1.0))


@pytest.fixture(scope="module")
def setup():
    cfg = from_dict(MMConfig, MM)
    packer = Packer(cfg, 4, 96, CAP)
    world = World(WORLD)
    batch, used = packer.pack(world.sample(i) for i in range(40))
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    return cfg, packer, batch, used, model


def test_batch_layout(setup):
    cfg, packer, batch, used, _ = setup
    assert len(used) >= 4
    for name in ("vision", "audio"):
        dest = batch[f"{name}_dest"]
        live = dest[dest >= 0]
        assert len(live) > 0 and len(np.unique(live)) == len(live)
        toks = batch["tokens"].reshape(-1)[live]
        assert set(np.unique(toks)) <= {tokenizer.IMAGE, tokenizer.VIDEO, tokenizer.AUDIO}
    placeholders = np.isin(batch["tokens"], [tokenizer.IMAGE, tokenizer.VIDEO, tokenizer.AUDIO]).sum()
    assert placeholders == sum((batch[f"{n}_dest"] >= 0).sum() for n in ("vision", "audio"))
    # loss only on text targets (never predicting a placeholder)
    assert not np.isin(batch["targets"][batch["loss_mask"] > 0], [tokenizer.IMAGE, tokenizer.VIDEO, tokenizer.AUDIO]).any()


def test_loss_depends_on_encoders_and_gradients_reach_them(setup):
    cfg, _, batch, _, model = setup
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(1e-2)
    step = jax.jit(make_train_step(graphdef, rest, mllm.mm_loss, opt))
    zero = jax.jit(lambda m, b: m(b, zero_encoders=True)[0])
    full = jax.jit(lambda m, b: m(b)[0])
    logits, logits0 = np.asarray(full(model, batch)), np.asarray(zero(model, batch))
    # only positions after a placeholder change when encoder outputs are zeroed
    assert np.abs(logits - logits0).max() > 1e-3
    first = np.argmax(np.isin(batch["tokens"][0], [tokenizer.IMAGE, tokenizer.VIDEO, tokenizer.AUDIO]))
    np.testing.assert_allclose(logits[0, :first], logits0[0, :first], atol=1e-5)

    state = init_state(params, opt)
    new_state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    before, after = state.params, new_state.params
    for name in ("vision", "audio"):
        for part in ("encoders", "projectors"):
            b = jax.tree.leaves(before[part][name])
            a = jax.tree.leaves(after[part][name])
            changed = sum(float(jnp.abs(x - y).max()) > 0 for x, y in zip(a, b))
            assert changed == len(b), f"{part}.{name}: only {changed}/{len(b)} params changed"


def test_bad_inputs_are_counted_skips(setup):
    cfg, _, _, _, model = setup
    packer = Packer(cfg, 4, 96, CAP)
    good = World(WORLD).sample(0)
    bad = [
        Sample((text("Q"), Segment("image", np.zeros((0, 16, 3), np.float32)))),
        Sample((text("Q"), Segment("audio", np.zeros((0,), np.float32)))),
        Sample((text("Q"), Segment("video", np.zeros((0, 16, 16, 3), np.float32)))),
        Sample((text("Q"), Segment("audio", np.zeros((16000 * 30,), np.float32)))),  # larger than any capacity
        Sample((text("Q"), Segment("image", np.full((16, 16, 3), np.nan, np.float32)))),
    ]
    batch, used = packer.pack([*bad, good])
    assert used == list(range(6))
    assert packer.skipped == {"bad_sample": 4, "too_large_for_audio_capacity": 1}
    assert batch["segment_ids"].max() == 1  # the good sample was packed
    out = jax.jit(lambda m, b: m(b)[0])(model, batch)
    assert np.all(np.isfinite(np.asarray(out)))


class MeanPoolEncoder(nnx.Module):
    """A toy encoder kind: linear map of each row; shows a new encoder is one module + one config entry."""

    def __init__(self, cfg, *, rngs):
        self.input_dim, self.reduction, self.out_dim = cfg.n_mels, cfg.reduction, cfg.embed_dim
        self.proj = nnx.Linear(cfg.n_mels * cfg.reduction, cfg.embed_dim, rngs=rngs)

    def __call__(self, inputs, segment_ids, positions):
        return self.proj(inputs.reshape(inputs.shape[0] // self.reduction, -1))

    def cost(self, segment_shape):
        return float(segment_shape[0])


@dataclasses.dataclass
class ToyConfig:
    kind: str = "toy"
    n_mels: int = 16
    n_fft: int = 400
    hop: int = 160
    sample_rate: int = 16000
    reduction: int = 4
    embed_dim: int = 8
    num_layers: int = 1
    num_heads: int = 1
    mlp_dim: int = 8


def test_registry_new_encoder_is_config(setup):
    _, _, batch, _, _ = setup
    mllm.register_encoder("toy", ToyConfig, MeanPoolEncoder)
    cfg = from_dict(MMConfig, {**MM, "encoders": {**MM["encoders"], "audio": {"kind": "toy"}}})
    model = mllm.MultimodalModel(cfg, rngs=nnx.Rngs(0))
    assert isinstance(model.encoders["audio"], MeanPoolEncoder)
    loss, count, _ = jax.jit(mllm.mm_loss)(model, batch)
    assert np.isfinite(float(loss)) and float(count) > 0
    with pytest.raises(ConfigError, match="kind"):
        mllm.MultimodalModel(from_dict(MMConfig, {**MM, "encoders": {"audio": {"kind": "nope"}}}), rngs=nnx.Rngs(0))
