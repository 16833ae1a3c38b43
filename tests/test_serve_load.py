"""Loading at size: the sharded HF reader reads each byte of this host's shards once (whatever axis the layout
splits), and generation loads straight into its layout's shardings and refuses prompts past the context."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.errors import ConfigError
from omnijax.interop import pretrained
from omnijax.models.llm import LLM
from omnijax.parallel.engine import LLMParallel

CFG = LLMConfig(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                tie_embeddings=False, max_seq_len=64)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = LLM(CFG, rngs=nnx.Rngs(3))
    out = tmp_path_factory.mktemp("hf") / "llama"
    pretrained.export_llm(nnx.state(model, nnx.Param), CFG, out)
    return out, model


def _target(layout: str, n: int):
    params = nnx.state(nnx.eval_shape(lambda: LLM(CFG, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = LLMParallel(layout, CFG, devices=jax.devices()[:n]).state_shardings(params)
    return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
                        params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("layout,n", [("fsdp8", 8), ("tp2", 2), ("fsdp4xtp2", 8)])
def test_reader_reads_each_local_byte_once(folder, layout, n):
    """fsdp splits the HF columns of q/k/v/gate/up/embedding and the rows of o/down; tp the other way round.
    Every device of this process is local, so its share is every distinct shard: read once (<= 1.1x, headers
    included), where reading whole rows per device read each row once per device (n x)."""
    path, model = folder
    target = _target(layout, n)
    before = _rchar()
    loaded = pretrained.load_llm_params(path, target)
    read = _rchar() - before
    leaves = [v.get_value() for _, v in nnx.to_flat_state(loaded)]
    share = 0
    for a in leaves:
        share += sum({tuple((i.start, i.stop) for i in s.index): s.data.nbytes for s in a.addressable_shards}.values())
    assert share <= read <= 1.1 * share, (read, share)
    for (path_, v), ref in zip(nnx.to_flat_state(loaded), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(ref), err_msg=str(path_))


def test_read_box_reads_only_the_block(folder, tmp_path):
    """A narrow column block reads each row's span alone; a block of (almost) whole rows reads the rows."""
    from omnijax.interop.tensors import TensorIndex

    path, _ = folder
    index = TensorIndex(path)
    name = "model.embed_tokens.weight"
    whole = index.read(name)
    for rows, cols in (((5, 77), (8, 24)), ((0, 512), (0, 64)), ((100, 101), (3, 61)), ((10, 20), (0, 0))):
        before = _rchar()
        got = index.read_box(name, rows, cols)
        read = _rchar() - before
        np.testing.assert_array_equal(got, whole[rows[0]:rows[1], cols[0]:cols[1]])
        need = got.nbytes
        assert need <= read <= max(1.1 * need, need + 64 * 4), (rows, cols, read, need)


def _run_folder(root: Path, cfg: LLMConfig, model) -> Path:
    from omnijax.train.checkpoint import Checkpointer
    from omnijax.train.state import init_state

    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg), "tokenizer": {"path": ""}}))
    ck = Checkpointer(run / "checkpoints", async_save=False)
    ck.save(3, init_state(nnx.state(model, nnx.Param), optax.adam(1e-3)), {"step": 3})
    ck.close()
    return run


def test_generate_loads_into_the_layout_and_refuses_prompts_past_the_context(folder, tmp_path):
    from omnijax.serve.generate import Generator, SamplingConfig, param_target
    from omnijax.serve.load import load

    _, model = folder
    run = _run_folder(tmp_path, CFG, model)
    served = load(run, layout="fsdp4xtp2")
    want = param_target(served.model, "fsdp4xtp2")
    got = nnx.state(served.model, nnx.Param)
    for (p, v), (_, w), ref in zip(nnx.to_flat_state(got), nnx.to_flat_state(want),
                                   jax.tree.leaves(nnx.state(model, nnx.Param))):
        arr = v.get_value()
        assert arr.sharding.is_equivalent_to(w.get_value().sharding, arr.ndim), p
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(ref))
    emb = dict(nnx.to_flat_state(got))[("embedding",)].get_value()
    assert len(emb.sharding.device_set) == 8 and emb.addressable_shards[0].data.size < emb.size  # not on device 0
    gen = Generator(served.model, layout="fsdp4xtp2")
    assert gen.params is not None
    with pytest.raises(ConfigError, match=r"prompt 1 has 60 tokens; with max_new_tokens=5 that exceeds the model's "
                                          r"context of 64 tokens"):
        gen.generate([[1, 2, 3], list(range(1, 61))], SamplingConfig(max_new_tokens=5))
