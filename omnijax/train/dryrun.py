"""Validate a recipe that cannot run here (e.g. 64 GPUs) on the CPU: config, meshes, shardings,
per-device memory of the training state and of the LLM's saved activations at the configured
``parallel.remat``, and the abstract shapes of one step (`jax.eval_shape`).

Nothing is allocated: the model is built with `nnx.eval_shape` and the step is traced only.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from omnijax.errors import ConfigError
from omnijax.models import mllm
from omnijax.models.llm import REMAT_MODES, remat_mode
from omnijax.parallel import mesh as mesh_lib, routing, rules as rules_lib
from omnijax.train.step import loss_and_grads

GiB = 1 << 30
BYTES_PER_PARAM = 16  # fp32 master weights + fp32 gradients + two fp32 Adam moments


def _per_device_params(state: Any, rules: rules_lib.Rules, mesh: AbstractMesh, pp: int, in_blocks: bool) -> float:
    total = 0.0
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        shape = var.get_value().shape
        names = var.get_metadata().get("out_sharding") or (None,) * len(shape)
        spec = rules.spec(names, shape, mesh, "params")
        shard = list(shape)
        for i, axes in enumerate(spec):
            for axis in (axes if isinstance(axes, tuple) else (axes,)) if axes else ():
                shard[i] //= mesh.shape[axis]
        keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        stage_split = pp if (in_blocks and "blocks" in keys) else 1
        total += math.prod(shard) / stage_split
    return total


def llm_activation_bytes(llm: Any, layout: mesh_lib.Layout, batch_size: int, seq_len: int, remat: Any,
                         dtype_bytes: int) -> float:
    """Estimated bytes of LLM activations one device keeps for the backward (the peak between forward
    and backward), from the model shape alone.

    Per token and layer, in elements (D embed, H/K query/kv heads of Dh, F the MLP width, or top_k x
    the expert width for MoE; the parts split by heads or MLP columns divide by tp):

    - ``none``: ``4D + ((2H + 2K)·Dh + 3F) / tp`` (residuals and norm outputs; q, k, v and the
      attention output; gate, up and their product; attention itself is blockwise, no L² term);
    - ``save_dots``: ``3D + ((H + 2K)·Dh + 2F) / tp`` (the layer input and the weight matmuls'
      outputs: q, k, v, attention and MLP output projections, gate and up);
    - ``full``: ``D`` (the layer input), plus one layer's ``none`` set while it is recomputed.

    bytes = tokens_per_device x (per_layer x layers / pp [+ the recomputed layer]) x dtype_bytes
            + tokens_per_device x V / tp x 4 (the fp32 logits),
    with tokens_per_device = batch_size x seq_len / (dp x fsdp x ep x cp): a pipeline stage holds
    its layers' activations for every microbatch in flight (GPipe: all of them) and cp splits the
    sequence."""
    mode = remat_mode(remat)
    D, H, K, Dh = llm.embed_dim, llm.num_heads, llm.num_kv_heads, llm.head_dim
    F = llm.moe.top_k * llm.moe.mlp_dim if llm.moe.every else llm.mlp_dim
    tp = layout.tp
    none = 4 * D + ((2 * H + 2 * K) * Dh + 3 * F) / tp
    per_layer = {"none": none, "save_dots": 3 * D + ((H + 2 * K) * Dh + 2 * F) / tp, "full": D}[mode]
    layers = llm.num_layers / layout.pp
    tokens = batch_size * seq_len / (layout.batch_shards * layout.cp)
    elems = per_layer * layers + (none if mode == "full" else 0.0)
    return tokens * elems * dtype_bytes + tokens * llm.vocab_size / tp * 4


def dry_run(cfg: Any, num_devices: int, device_memory_gib: float = 80.0) -> dict[str, Any]:
    """Check an `OmniConfig` against `num_devices` accelerators; returns a report, raises ConfigError."""
    p, m = cfg.parallel, cfg.model
    layout = mesh_lib.parse_layout(p.llm, num_devices)
    mb = p.microbatches or 2 * layout.pp
    mesh_lib.check_layout(layout, num_devices, m.llm, microbatches=mb if layout.pp > 1 else 0)
    edp, esp = routing.parse_encoder_layout(p.encoder, num_devices)
    grid = routing.DeviceGrid.from_layout(layout, esp)
    grid.esp_axes()
    from omnijax.mm_config import encoder_configs

    for name, enc in encoder_configs(m).items():
        if enc.num_heads % esp:
            raise ConfigError(f"parallel.encoder=edp{edp}xesp{esp}: esp must divide model.encoders.{name}.num_heads="
                              f"{enc.num_heads}")
    if cfg.data.batch_size % (layout.batch_shards * (mb if layout.pp > 1 else 1)):
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must split over {layout.batch_shards} batch shards"
                          + (f" x {mb} microbatches" if layout.pp > 1 else ""))

    abstract = nnx.eval_shape(lambda: mllm.MultimodalModel(m, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    amesh = AbstractMesh(tuple(layout.sizes.values()), tuple(layout.sizes))
    llm_rules, enc_rules = rules_lib.load_rules(p.rules), rules_lib.load_rules(p.encoder_rules)
    counts = {k: sum(math.prod(v.get_value().shape) for v in jax.tree.leaves(params[k], is_leaf=lambda x: isinstance(x, nnx.Variable)))
              for k in ("llm", "encoders", "projectors")}
    per_dev = (_per_device_params(params["llm"], llm_rules, amesh, layout.pp, in_blocks=True)
               + _per_device_params(params["encoders"], enc_rules, amesh, 1, False)
               + _per_device_params(params["projectors"], enc_rules, amesh, 1, False))
    state_gib = per_dev * BYTES_PER_PARAM / GiB
    B, L = cfg.data.batch_size, cfg.data.seq_len
    dtype = jnp.dtype(cfg.trainer.compute_dtype)
    act = {r: llm_activation_bytes(m.llm, layout, B, L, r, dtype.itemsize) / GiB for r in REMAT_MODES}
    remat = remat_mode(p.remat)
    total_gib = state_gib + act[remat]
    if total_gib > device_memory_gib:
        raise ConfigError(f"training needs {total_gib:.1f} GiB per device (> {device_memory_gib} GiB): state "
                          f"{state_gib:.1f} + LLM activations {act[remat]:.1f} at parallel.remat={remat}; shard more "
                          "(fsdp/tp/pp), remat more, or use encoder_fsdp rules")

    from omnijax.data.packing import encoder_specs

    batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct((B, L), jnp.float32)
    for name, spec in encoder_specs(m).items():
        n = int(cfg.capacity[name])
        batch[f"{name}_inputs"] = jax.ShapeDtypeStruct((n, spec.dim), jnp.float32)
        batch[f"{name}_segment_ids"] = jax.ShapeDtypeStruct((n,), jnp.int32)
        batch[f"{name}_positions"] = jax.ShapeDtypeStruct((n, 3), jnp.int32)
        batch[f"{name}_dest"] = jax.ShapeDtypeStruct((n // spec.group,), jnp.int32)
    loss, grads, _ = jax.eval_shape(lambda prm, b: loss_and_grads(graphdef, rest, mllm.mm_loss, prm, b,
                                                                   compute_dtype=dtype), params, batch)
    if loss.shape != () or jax.tree.structure(grads) != jax.tree.structure(params):
        raise ConfigError("the abstract step does not produce a scalar loss and one gradient per parameter")
    return {"devices": num_devices, "llm_layout": str(layout), "encoder_layout": f"edp{edp}xesp{esp}",
            "esp_axes": list(grid.esp_axes()), "params": counts, "params_total": sum(counts.values()),
            "state_gib_per_device": round(state_gib, 2), "remat": remat,
            "activation_gib_per_device": round(act[remat], 2),
            "activation_gib_per_device_by_remat": {r: round(v, 2) for r, v in act.items()},
            "total_gib_per_device": round(total_gib, 2), "bubble_fraction": _bubble(layout.pp, mb),
            "tokens_per_step": B * L}


def _bubble(pp: int, microbatches: int) -> float:
    return 0.0 if pp == 1 else (pp - 1) / (microbatches + pp - 1)
