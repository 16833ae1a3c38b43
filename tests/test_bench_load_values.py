"""`bench load`'s value check: every parameter's shards against the source files read by the safetensors library,
in every layout (plain, linear_in, linear_out); a loader that lays out any one tensor wrongly fails it."""
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from omnijax.interop import layout, pretrained
from omnijax.models.llm import LLM
from omnijax.parallel.engine import LLMParallel
from recipes.bench import load as bench_load


def test_the_value_check_sees_a_wrong_layout_in_any_tensor(tmp_path):
    b = bench_load.BenchConfig(embed_dim=64, num_layers=2, mlp_dim=128, vocab_size=256, num_heads=4, num_kv_heads=2,
                               file_mb=1)
    folder = Path(tmp_path) / "llama"
    bench_load.write_folder(b, folder)
    cfg = pretrained.llm_config_from_folder(folder)
    params = nnx.state(nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = LLMParallel("fsdp8", cfg).state_shardings(params)
    target = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
                          params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    loaded = pretrained.load_llm_params(folder, target)
    assert bench_load.values_match(folder, cfg, loaded)
    kinds = {t.kind: t for t in reversed(layout.llm_tensors(cfg))}   # the first tensor of each layout
    assert set(kinds) == {"same", "linear_in", "linear_out"}
    for kind, t in kinds.items():
        flat = dict(nnx.to_flat_state(loaded))
        value = flat[t.path].get_value()
        # the same bytes in the wrong order: rows of the first axis rotated by one
        flat[t.path].set_value(jax.device_put(np.roll(np.asarray(value), 1, axis=0), value.sharding))
        assert not bench_load.values_match(folder, cfg, loaded), kind
        flat[t.path].set_value(value)
        assert bench_load.values_match(folder, cfg, loaded), kind   # put back: right again
    q = next(t for t in layout.llm_tensors(cfg) if t.kind == "linear_in" and t.path[-1] == "q")
    value = dict(nnx.to_flat_state(loaded))[q.path].get_value()
    from safetensors.numpy import load_file

    # [out, in] reshaped without the transpose: the mistake a loader makes when it forgets HF's orientation
    full = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}[q.hf]
    dict(nnx.to_flat_state(loaded))[q.path].set_value(jax.device_put(full.reshape(q.shape), value.sharding))
    assert not bench_load.values_match(folder, cfg, loaded)
