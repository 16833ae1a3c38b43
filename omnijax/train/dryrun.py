"""Validate a recipe that cannot run here (e.g. 64 GPUs) on the CPU.

Two halves: the analytic check (`dry_run`: config, meshes, shardings, per-device memory of the training
state and of the LLM's saved activations at the configured ``parallel.remat``, the abstract shapes of one
step) and the compiled one (`abstract_trainer_class`, `compile_step`, `target_report`): the recipe's own
train step compiled by XLA:GPU for abstract devices of a target card (`omnijax.targets`), whose memory,
buffers, kernels and collectives are XLA's. Nothing is allocated in either.
"""
from __future__ import annotations

import collections
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.models import mllm
from omnijax.models.llm import REMAT_MODES, remat_mode
from omnijax.parallel import mesh as mesh_lib, routing, rules as rules_lib
from omnijax.train.step import loss_and_grads

GiB = 1 << 30
BYTES_PER_PARAM = 16  # the estimate before XLA's reports: fp32 masters + gradients + two Adam moments, as state


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
                         dtype_bytes: int, logits: bool = True) -> float:
    """Estimated bytes of LLM activations one device keeps for the backward (the peak between forward
    and backward), from the model shape alone.

    Per token and layer, in elements (D embed, H/K query/kv heads of Dh, F the MLP width, or top_k x
    the expert width for MoE; the parts split by heads or MLP columns divide by tp):

    - ``none``: ``4D + ((2H + 2K)·Dh + 3F) / tp`` (residuals and norm outputs; q, k, v and the
      attention output; gate, up and their product; attention itself is blockwise, no L² term);
    - ``save_dots``: ``3D + ((H + 2K)·Dh + 2F) / tp`` (the layer input and the weight matmuls'
      outputs: q, k, v, attention and MLP output projections, gate and up);
    - ``full``: ``D`` (the layer input), plus one layer's ``none`` set while it is recomputed (with the layers
      unrolled, XLA:GPU holds every layer's recomputed set: `step_memory_terms`' ``recomputed_layers``).

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
    return tokens * elems * dtype_bytes + (tokens * llm.vocab_size / tp * 4 if logits else 0.0)


STATE_BYTES_PER_PARAM = 12  # what the step takes as arguments: fp32 masters + two fp32 Adam moments
GRAD_BYTES_PER_PARAM = 4    # fp32 gradients: temporaries of the step, not state


def cudnn_stats_bytes(llm: Any, layout: mesh_lib.Layout, batch_size: int, seq_len: int, remat: Any = "none") -> float:
    """Softmax statistics cuDNN's packed attention saves for its backward, per device: jax's packed API
    declares them [B x max_segments, H, L] fp32, max_segments being the bound `attention._cudnn_or_blockwise`
    passes (max(64, L/16), at most L), per layer: every layer of a stage at remat none; at full and save_dots
    the attention call (a custom call, not a saveable dot) is recomputed in the backward, so one layer's
    (omni_8b with cuDNN in its stages: 8.0 GiB counted for all 16 layers where XLA's whole working memory
    is 16.2 GiB)."""
    L = seq_len // layout.cp
    max_segments = max(2, min(L, max(64, L // 16)))
    rows = batch_size / layout.batch_shards
    layers = llm.num_layers / layout.pp if remat_mode(remat) == "none" else 1
    return rows * max_segments * (llm.num_heads / layout.tp) * L * 4 * layers


def moe_dispatch_bytes(llm: Any, layout: mesh_lib.Layout, batch_size: int, seq_len: int, remat: Any,
                       dtype_bytes: int) -> float:
    """The expert dispatch buffers of the MoE layers per device, which the activations term has no place for:
    each MoE layer routes a row's T tokens into E experts x C slots (C = capacity_factor x T x top_k / E,
    `layers.moe.expert_capacity`), with the dispatch and combine tensors [rows, T, E, C] in the compute dtype
    (XLA fuses their fp32 forms away) and the slot buffers [rows, E, C, D] sent and received by the expert
    all-to-all both ways (4; 2 without ep). rows = batch_size / (dp x fsdp x ep) and T the whole row
    (`parallel.expert.ep_moe` routes whole rows). Held for every MoE layer of a stage at remat none or
    save_dots (the backward reads them), for the one layer being recomputed at full."""
    from omnijax.layers.moe import expert_capacity
    from omnijax.models.llm import is_moe_layer

    m = llm.moe
    layers = sum(is_moe_layer(llm, i) for i in range(llm.num_layers))
    if not layers:
        return 0.0
    C = expert_capacity(seq_len, m.num_experts, m.top_k, m.capacity_factor)
    rows = batch_size / layout.batch_shards
    routing = 2 * rows * seq_len * m.num_experts * C * dtype_bytes
    slots = (4 if layout.ep > 1 else 2) * rows * m.num_experts * C * llm.embed_dim * dtype_bytes
    live = 1 if remat_mode(remat) == "full" else layers / layout.pp
    return live * (routing + slots)


def layer_weight_bytes(llm: Any, layout: mesh_lib.Layout, layer: int, dtype_bytes: int) -> float:
    """One LLM layer's weights as its forward uses them, per device: in the compute dtype, gathered over fsdp, split
    by tp (heads, MLP columns) and, for experts, by ep: q/k/v/o, the dense MLP or the router and the experts."""
    from omnijax.models.llm import is_moe_layer

    D, H, K, Dh, tp = llm.embed_dim, llm.num_heads, llm.num_kv_heads, llm.head_dim, layout.tp
    elems = D * (2 * H + 2 * K) * Dh / tp + 2 * D
    if is_moe_layer(llm, layer):
        m = llm.moe
        elems += D * m.num_experts + 3 * m.num_experts * D * m.mlp_dim / (layout.ep * tp)
    else:
        elems += 3 * D * llm.mlp_dim / tp
    return elems * dtype_bytes


def recomputed_layer_bytes(llm: Any, layout: mesh_lib.Layout, batch_size: int, seq_len: int, layer: int,
                           dtype_bytes: int) -> float:
    """What one layer's backward reads from its recomputed forward under remat full, per device (the values XLA
    holds from a layer's recomputation until its backward runs): per token 3D (the two norms' outputs and the
    residual sum) + (2H + 2K)·Dh / tp (q, k, v and the attention output); a dense MLP's gate, up and product
    (3F / tp per token); an MoE layer's expert hidden buffers [rows, E, C, F / tp] (3: the recomputed product,
    silu's derivative and its product with up) and its slot buffers [rows, E, C, D] (2: the expert input and
    output of the all-to-alls). Checked value by value against the 8-layer omni_moe step below
    (`step_memory_terms`): 0.65 GiB a layer here, 0.66 live at XLA's peak."""
    from omnijax.layers.moe import expert_capacity
    from omnijax.models.llm import is_moe_layer

    D, H, K, Dh, tp = llm.embed_dim, llm.num_heads, llm.num_kv_heads, llm.head_dim, layout.tp
    rows = batch_size / layout.batch_shards
    L = seq_len / layout.cp
    elems = rows * L * (3 * D + (2 * H + 2 * K) * Dh / tp)
    if is_moe_layer(llm, layer):
        m = llm.moe
        slots = rows * m.num_experts * expert_capacity(seq_len, m.num_experts, m.top_k, m.capacity_factor)
        elems += slots * (3 * m.mlp_dim / tp + 2 * D)
    else:
        elems += rows * L * 3 * llm.mlp_dim / tp
    return elems * dtype_bytes


def step_memory_terms(llm: Any, layout: mesh_lib.Layout, batch_size: int, seq_len: int, remat: Any,
                      dtype_bytes: int, params_per_device: float, *, cudnn_packed: bool = False,
                      trainable_per_device: float | None = None) -> dict[str, float]:
    """The estimated bytes per device of one training step, by term (what `dryrun` prints beside XLA's):

    - ``state`` (the step's arguments): 12 B per trained parameter on the fullest device, 4 B per frozen one;
    - ``gradients``: 4 B per trained parameter; ``compute_copy``: the parameters cast to the compute dtype (bf16) and,
      under fsdp, gathered: the step keeps every layer's gathered weights for the backward (XLA's all-gathers
      of the Qwen2-7B step on 8 H100s add up to the whole model in bf16);
    - ``activations``: the LLM layers' saved activations at ``parallel.remat`` (`llm_activation_bytes`);
    - ``loss``: the logits the loss holds: two chunks of ``model.loss_chunk`` positions per row (the forward's
      and the backward's recomputed one) or, with ``loss_chunk=0``, three [tokens x V] fp32 arrays (logits,
      their gradient, the gradient's scatter), as XLA allocates them;
    - ``attention_stats``: cuDNN's packed softmax statistics (`cudnn_stats_bytes`), where cuDNN is used;
    - ``moe_dispatch``: the MoE layers' dispatch/combine tensors and expert slot buffers (`moe_dispatch_bytes`);
    - ``recomputed_layers``: at remat full with the layers unrolled in one program (no pp), XLA:GPU recomputes
      every layer's forward ahead of the backward chain and holds every layer's recomputed values
      (`recomputed_layer_bytes`) at once; the term is what that holds beyond the loss's phase (the saved layer
      inputs and the logits), so the sum is the larger of the two phases. There the compute copy keeps one
      layer's gathered weights, not every layer's: the recomputation gathers them again (`layer_weight_bytes`).
      omni_moe with 8 LLM layers (1-layer encoders) compiled for 64 x H100: XLA's working memory 6.63 GiB, every
      layer's recomputed values live at its peak (0.66 GiB a layer); the estimate 4.96 GiB without the term,
      7.44 with it.

    The estimate before XLA's reports were compared counted 16 B/param of state (gradients included) and one
    [tokens x V] fp32 array, and nothing for the compute copy or the statistics: 29.4 GiB for the gpucheck 1B
    step on one H100 where XLA plans 34.9 (docs/real-size.md)."""
    chunk = int(getattr(llm, "loss_chunk", 0) or 0)
    rows = batch_size / layout.batch_shards
    L = seq_len / layout.cp
    vocab = llm.vocab_size / layout.tp
    loss = 2 * rows * min(chunk, L) * vocab * 4 if chunk else 3 * rows * L * vocab * 4
    trained = params_per_device if trainable_per_device is None else trainable_per_device  # frozen: no moments
    copy = params_per_device * layout.fsdp * dtype_bytes if dtype_bytes < 4 or layout.fsdp > 1 else 0.0
    activations = llm_activation_bytes(llm, layout, batch_size, seq_len, remat, dtype_bytes, logits=False)
    recomputed = 0.0
    if remat_mode(remat) == "full" and layout.pp == 1:
        # layers unrolled in one program: XLA:GPU runs every layer's recomputation ahead of the backward chain
        # (jax's optimization barriers are gone by the time it schedules), so its peak holds every layer's
        # recomputed values, and gathers each layer's weights again in the recomputation instead of keeping them
        weights = [layer_weight_bytes(llm, layout, i, dtype_bytes) for i in range(llm.num_layers)]
        if copy:
            copy -= sum(weights) - max(weights, default=0.0)
        held = sum(recomputed_layer_bytes(llm, layout, batch_size, seq_len, i, dtype_bytes)
                   for i in range(llm.num_layers))
        recomputed = max(0.0, held - activations - loss)  # the loss's phase (saved inputs, logits) is over by then
    return {"state": params_per_device * 4 + trained * (STATE_BYTES_PER_PARAM - 4),
            "gradients": trained * GRAD_BYTES_PER_PARAM,
            "compute_copy": copy,
            "activations": activations,
            "loss": loss,
            "attention_stats": cudnn_stats_bytes(llm, layout, batch_size, seq_len, remat) if cudnn_packed else 0.0,
            "moe_dispatch": moe_dispatch_bytes(llm, layout, batch_size, seq_len, remat, dtype_bytes),
            "recomputed_layers": recomputed}


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
    B, L = cfg.data.batch_size, cfg.data.seq_len
    dtype = jnp.dtype(cfg.trainer.compute_dtype)
    remat = remat_mode(p.remat)
    terms = {r: step_memory_terms(m.llm, layout, B, L, r, dtype.itemsize, per_dev) for r in REMAT_MODES}
    state_gib = terms[remat]["state"] / GiB
    act = {r: (t["activations"] + t["loss"] + t["recomputed_layers"]) / GiB for r, t in terms.items()}
    total_gib = sum(terms[remat].values()) / GiB
    if total_gib > device_memory_gib:
        raise ConfigError(f"training needs {total_gib:.1f} GiB per device (> {device_memory_gib} GiB): state "
                          f"{state_gib:.1f} + gradients and compute copy "
                          f"{(terms[remat]['gradients'] + terms[remat]['compute_copy']) / GiB:.1f} + LLM activations "
                          f"and loss {act[remat]:.1f} at parallel.remat={remat}; shard more (fsdp/tp/pp), remat more, "
                          "or use encoder_fsdp rules")

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


# ============================================================================ compiled for a GPU target
# The recipe's own train step (the Trainer's jit, its placement and loss) compiled by XLA:GPU for abstract
# devices of the target (omnijax.targets): nothing is allocated, nothing runs. XLA's own figures (memory per
# device, the buffers, kernels and collectives of the optimised program) are the evidence a shape fits.

HEADROOM = 0.10  # a shape "fits" with 10% of the card's memory left (fragmentation, NCCL and cuDNN workspaces)
_SHAPE = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)\[([0-9,]*)\]")
_BITS = {"pred": 8, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64, "u4": 4, "u8": 8, "u16": 16, "u32": 32,
         "u64": 64, "f8e4m3fn": 8, "f8e5m2": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")


def _shape_bytes(dtype: str, dims: str) -> int:
    return math.prod(int(d) for d in dims.split(",") if d) * _BITS[dtype] // 8


def abstract_trainer_class():
    """A Trainer whose state is abstract (ShapeDtypeStructs in the placement's shardings): everything else
    (optimizer, partition, remat, the step and its `jax.jit`) is the Trainer's own."""
    from omnijax.train.loop import Trainer
    from omnijax.train.state import init_state

    class AbstractTrainer(Trainer):
        def _initial_state(self, model):
            graph: list = []

            def init():
                module = model if isinstance(model, nnx.Module) else model()
                graphdef, params, rest = nnx.split(module, nnx.Param, ...)
                graph[:] = [graphdef]
                return init_state(params, self.optimizer), rest

            state, rest = jax.eval_shape(init)
            self.graphdef = graph[0]
            # non-parameter variables are constants of the step (none in omnijax's models today)
            self.rest = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), rest)
            # the placement's shardings may stand where the state has a Variable node (one leaf each): pair
            # them leaf by leaf, in the one flattening order both trees share
            shardings = jax.tree.leaves(self.placement.state_shardings(state),
                                        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
            leaves, treedef = jax.tree.flatten(state)
            if len(leaves) != len(shardings):
                raise ConfigError(f"the placement gave {len(shardings)} shardings for {len(leaves)} state arrays")
            return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                                for x, s in zip(leaves, shardings)])

    return AbstractTrainer


def llm_batch(placement: Any, batch_size: int, seq_len: int) -> dict:
    """The abstract LLM batch a placement's `put_batch` makes ([B, L] token arrays in its shardings)."""
    host = {k: np.zeros((1, 1), np.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    host["loss_mask"] = np.zeros((1, 1), np.float32)
    shardings = placement.batch_sharding(host)
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), v.dtype, sharding=shardings[k]) for k, v in host.items()}


def encoder_batch(placement: Any, mm_cfg: Any, capacity: dict[str, int]) -> dict:
    """Abstract encoder arrays of the plain data-parallel multimodal step (no joint-step placement)."""
    from omnijax.data.packing import encoder_specs

    rows = NamedSharding(placement.mesh, P(placement.mesh.axis_names))
    out = {}
    for name, spec in encoder_specs(mm_cfg).items():
        n = int(capacity[name])
        out[f"{name}_inputs"] = jax.ShapeDtypeStruct((n, spec.dim), jnp.float32, sharding=rows)
        out[f"{name}_segment_ids"] = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows)
        out[f"{name}_positions"] = jax.ShapeDtypeStruct((n, 3), jnp.int32, sharding=rows)
        out[f"{name}_dest"] = jax.ShapeDtypeStruct((n // spec.group,), jnp.int32, sharding=rows)
    return out


def plan_batch(mux: Any, capacities: dict[str, int]) -> dict:
    """Abstract encoder buffers and routing tables of a `Multiplexer` step with these plan capacities
    (`Multiplexer.size_window`'s: `<enc>_short`, `<enc>_long`, `route`), as `put_batch` lays them out:
    one row per device (and per pipeline microbatch when encoders are interleaved)."""
    from omnijax.parallel.multiplex import ALL

    D = mux.grid.num_devices
    lead = (D, mux.engine.schedule.microbatches) if mux.interleave else (D,)
    rows = NamedSharding(mux.mesh, P(ALL))
    out = {}
    for name in sorted(mux.reductions):
        for part in ("short", "long"):
            cap = int(capacities.get(f"{name}_{part}", 0))
            out[f"{name}_{part}_inputs"] = jax.ShapeDtypeStruct((*lead, cap, mux.dims[name]), jnp.float32, sharding=rows)
            out[f"{name}_{part}_segment_ids"] = jax.ShapeDtypeStruct((*lead, cap), jnp.int32, sharding=rows)
            out[f"{name}_{part}_positions"] = jax.ShapeDtypeStruct((*lead, cap, 3), jnp.int32, sharding=rows)
    C = int(capacities["route"])
    for k in ("route_send", "route_recv"):
        out[k] = jax.ShapeDtypeStruct((*lead, D, C), jnp.int32, sharding=rows)
    return out


def compile_step(trainer: Any, batch: dict, dump_dir: str) -> tuple[Any, list[dict], float]:
    """Lower and compile the trainer's own jitted step for the devices of its placement; returns
    (compiled, the attention calls as traced, compile seconds). XLA dumps its buffer assignment to `dump_dir`."""
    from omnijax.layers.attention import recording_kernels

    t0 = time.perf_counter()
    with recording_kernels() as calls:
        lowered = trainer._step.lower(trainer.state, batch)
    compiled = lowered.compile(compiler_options={"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True})
    return compiled, calls, time.perf_counter() - t0


def _instructions(hlo: str) -> dict[str, dict]:
    """name -> {opcode, shape text, op_name} of every instruction in optimised HLO text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-$]+)\((.*)$", hlo, re.M):
        meta = re.search(r'op_name="([^"]*)"', m.group(4))
        target = re.search(r'custom_call_target="([^"]*)"', m.group(4))
        out[m.group(1)] = {"opcode": m.group(3), "shape": m.group(2), "op_name": meta.group(1) if meta else "",
                           "target": target.group(1) if target else ""}
    return out


def largest_buffers(buffer_assignment: str, instructions: dict[str, dict], n: int = 5) -> list[dict]:
    """The `n` largest values of XLA's buffer assignment (one device): shape, bytes, the op that makes each."""
    seen: dict[tuple, dict] = {}
    for m in re.finditer(r"value: <\d+ ([\w.\-]+) @(\{?[0-9,]*\}?)> \(size=(\d+),offset=\d+\): (\S+)", buffer_assignment):
        name, index, size, shape = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        key = (name, index)
        if key in seen:
            continue
        info = instructions.get(name, {})
        seen[key] = {"shape": re.sub(r"\{[^}]*\}$", "", shape), "bytes": size, "instruction": name,
                     "op": info.get("opcode", "?"), "source": info.get("op_name", "")[-160:]}
    return sorted(seen.values(), key=lambda v: -v["bytes"])[:n]


def collectives(hlo: str) -> dict[str, dict]:
    """Collectives of the optimised program by kind: how many, and the bytes of their results (one device;
    one occurrence in the program text each: a collective inside a loop runs once per iteration)."""
    out: dict[str, dict] = {}
    pattern = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
    for m in pattern.finditer(hlo):
        shapes = [_shape_bytes(d, s) for d, s in _SHAPE.findall(m.group(1))]
        kind, start = m.group(2), bool(m.group(3))
        if start and kind == "all-gather":
            nbytes = sum(shapes[len(shapes) // 2:])  # (operands..., outputs...)
        elif start and kind == "collective-permute":
            nbytes = shapes[0] if shapes else 0      # (operand, output, contexts...)
        else:
            nbytes = sum(shapes)
        row = out.setdefault(kind, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += nbytes
    return dict(sorted(out.items()))


def cudnn_calls(instructions: dict[str, dict]) -> dict[str, int]:
    """cuDNN fused-attention custom calls in the optimised program: forward and backward kernels."""
    fwd = sum(1 for i in instructions.values() if i["target"].startswith("__cudnn$fmha") and "Backward" not in i["target"])
    bwd = sum(1 for i in instructions.values() if i["target"].startswith("__cudnn$fmha") and "Backward" in i["target"])
    return {"forward": fwd, "backward": bwd}


def xla_flops(compiled: Any) -> float | None:
    """XLA's HloCostAnalysis FLOPs of the optimised per-device program (custom calls, e.g. cuDNN attention,
    count 0 there). The deviceless executable has no cost analysis of its own: the module is analysed with
    the host's backend, which runs the same HloCostAnalysis over the GPU-optimised HLO."""
    from omnijax.jax_private import jaxlib_jax as _jax, xla_bridge

    try:
        modules = compiled.runtime_executable().hlo_modules()
        return float(sum(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), m).get("flops", 0.0)
                         for m in modules))
    except Exception:  # a jaxlib without the entry point: report none rather than a guess
        return None


def read_dump(dump_dir: str) -> tuple[str, str]:
    files = sorted(os.listdir(dump_dir))
    hlo = [f for f in files if f.endswith("after_optimizations.txt")]
    ba = [f for f in files if f.endswith("after_optimizations-buffer-assignment.txt")]
    read = lambda f: open(os.path.join(dump_dir, f)).read()  # noqa: E731
    return (read(hlo[-1]) if hlo else "", read(ba[-1]) if ba else "")


# the setting that shrinks a buffer, by what makes it (first match wins)
_SHRINK = [
    (r"logits|lm_head|cross_entropy|log_softmax|vocab", "a vocabulary-chunked loss, or tp (splits the vocabulary), "
                                                        "or fewer tokens per device (data.batch_size / fsdp)"),
    (r"attention|fmha|flash|blockwise", "parallel.remat=full, cp (splits the sequence), or fewer tokens per device"),
    (r"encoder|vision|audio|vit|whisper", "parallel.encoder with more esp, encoder_rules=encoder_fsdp, or smaller capacity.*"),
    (r"adam|opt_state|mu|nu", "more fsdp (shards optimizer state) or pp"),
    (r"", "parallel.remat=full, more fsdp/tp/pp, or a smaller data.batch_size"),
]


def shrink_advice(buffer: dict) -> str:
    text = f"{buffer.get('source', '')} {buffer.get('instruction', '')}".lower()
    for pattern, advice in _SHRINK:
        if re.search(pattern, text):
            return advice
    return _SHRINK[-1][1]


def target_report(compiled: Any, calls: list[dict], dump_dir: str, *, target: Any, info: dict,
                  analytic: dict | None, model_flops_per_device: float | None, compile_s: float) -> dict:
    """The per-device report of a step compiled for `target` (see `recipes dryrun`)."""
    mem = compiled.memory_analysis()
    hlo, assignment = read_dump(dump_dir)
    instr = _instructions(hlo)
    args, outs = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    alias, temp = int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes)
    code = int(getattr(mem, "generated_code_size_in_bytes", 0) or 0)
    peak = args + outs - alias + temp + code
    device_mem = int(info["device_memory_bytes"])
    buffers = largest_buffers(assignment, instr)
    kinds = collections.Counter(c["impl"] for c in calls)
    colls = collectives(hlo)
    flops = xla_flops(compiled)
    report = {
        "target": target.name, "card": target.card, "device_kind": info["device_kind"], "devices": target.devices,
        "hosts": target.hosts, "argument_bytes": args, "output_bytes": outs, "alias_bytes": alias,
        "temp_bytes": temp, "generated_code_bytes": code, "peak_bytes_per_device": peak,
        "device_memory_bytes": device_mem, "peak_fraction": round(peak / device_mem, 4),
        "fits": peak <= (1 - HEADROOM) * device_mem,
        "largest_buffers": [b["shape"] for b in buffers], "largest_buffers_detail": buffers,
        "attention_kernels": dict(sorted(kinds.items())), "cudnn_custom_calls": cudnn_calls(instr),
        "cudnn_refused": dict(collections.Counter(c["cudnn_refused"] for c in calls if "cudnn_refused" in c)),
        "collectives": colls, "collective_bytes": sum(c["bytes"] for c in colls.values()),
        "xla_flops": flops, "model_flops_per_device": model_flops_per_device,
        "xla_flops_note": "HloCostAnalysis of the per-device program: a loop body (the pipeline's scan, the loss's "
                          "chunks, blockwise attention) counts once, custom calls (cuDNN attention) count 0 (recipes dryrun adds "
                          "loop_flops: every loop body times its trip count)",
        "compile_s": round(compile_s, 1),
    }
    if flops and model_flops_per_device:
        report["xla_flops_over_model_flops"] = round(flops / model_flops_per_device, 3)
    if analytic:
        report["analytic"] = analytic
        report["estimate_check"] = estimate_check(analytic, args, temp + outs - alias)
    if not report["fits"] and buffers:
        b = buffers[0]
        report["advice"] = (f"does not fit: peak {peak / GiB:.1f} GiB of {device_mem / GiB:.1f} GiB "
                            f"(needs {HEADROOM:.0%} headroom); the biggest buffer is {b['shape']} "
                            f"({b['bytes'] / GiB:.2f} GiB, {b['op']} {b['instruction']}); shrink it with "
                            + shrink_advice(b))
    return report


def estimate_check(analytic: dict, argument_bytes: int, working_bytes: int) -> list[str]:
    """Where the analytic estimate and XLA differ by more than 20%, which part: the state (XLA's arguments)
    or the working memory (everything else the step allocates: gradients, compute copy, activations, loss,
    attention statistics, expert dispatch, recomputed layers), with the estimate's terms of that part."""
    terms = analytic["terms_gib"]
    out = []
    for part, names, xla in (("state", ["state"], argument_bytes),
                             ("working memory", [k for k in terms if k != "state"], working_bytes)):
        est = sum(terms[k] for k in names) * GiB
        if xla > 0 and abs(est - xla) > 0.2 * xla:
            out.append(f"{part}: estimate {est / GiB:.2f} GiB ({', '.join(f'{k} {terms[k]}' for k in names)}) vs XLA "
                       f"{xla / GiB:.2f} GiB")
    return out
