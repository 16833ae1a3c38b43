"""Entry point: run the LLM backbone under a 5D layout (PP x DP/FSDP x CP x TP x EP).

``LLMParallel`` is a placement for the trainer (``mesh``, ``state_shardings``, ``put_state``,
``put_batch``, ``bubble_fraction``) plus a ``loss_fn(model, batch) -> (loss_sum, count, aux)`` that runs
the model's own layers with the parallel pieces plugged in:

- DP / FSDP / TP: parameters and optimizer state placed by ``shardings/<rules>.yaml``; GSPMD inserts
  the gathers, reduce-scatters and all-reduces those placements imply.
- CP: batches are stored in the causal load-balanced order (``put_batch``) and attention runs with
  :func:`omnijax.parallel.context.cp_attention` (ring or all-gather of K/V).
- M-RoPE (Qwen2-VL): a batch's ``rope_positions`` [B, L, 3] travel with its tokens (cp's order, pipeline
  microbatches, the explicit FSDP step) and turn q/k in every layer; ``positions`` still make the masks.
- EP: MoE layers run with :func:`omnijax.parallel.expert.ep_moe` (all-to-all dispatch/combine).
- PP: ``prepare(model)`` stacks the blocks on a ``stage`` axis (``PipelinedLLM``); the loss runs them
  with :func:`omnijax.parallel.pipeline.spmd_pipeline`.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.layers import mrope
from omnijax.layers.attention import dot_product_attention
from omnijax.models.llm import AUX_KEYS, LLM, default_packing, is_moe_layer, remat_mode, run_block, zero_aux
from omnijax.parallel import context, embedding, expert, hosts, pipeline, rules as rules_lib
from omnijax.parallel.mesh import Layout, make_mesh, parse_layout
from omnijax.parallel.stage_attention import stage_attention
from omnijax.models.losses import head_cross_entropy
from omnijax.models.objective import loss_and_grads

_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops by kind in (compiled) HLO text; async pairs count once (the ``-start``)."""
    counts: dict[str, int] = {}
    for m in _COLLECTIVE.finditer(hlo_text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items()))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")


def all_reduce_then_slice(hlo_text: str) -> int:
    """Arrays (elements of combined all-reduces counted one by one, scalars left out) that compiled HLO
    all-reduces whole and then only slices (a ``dynamic-slice``, directly or inside the fusion that
    consumes it): a full reduction where a reduce-scatter into the shard would do (XLA:CPU does not
    rewrite the pair by itself)."""
    lines = hlo_text.splitlines()
    comps: dict[str, list[str]] = {}
    current = None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    slicing = {name for name, body in comps.items() if any(" dynamic-slice(" in ln for ln in body)}
    defs = [(m.group(1), ln) for ln in lines if (m := re.match(r"\s*(?:ROOT )?%(\S+) = ", ln))]
    used_by: dict[str, list[tuple[str, str]]] = {}
    for n, ln in defs:
        rhs = ln.split(" = ", 1)[1].split(" metadata=")[0]
        for operand in set(re.findall(r"[(,] ?%([^,)\s]+)(?=[,)])", rhs)):
            used_by.setdefault(operand, []).append((n, ln))

    def users(name: str) -> list[tuple[str, str]]:
        return used_by.get(name, [])

    def only_sliced(name: str) -> bool:
        us = users(name)
        for n, ln in us:
            if " get-tuple-element(" in ln:
                if not only_sliced(n):
                    return False
                continue
            called = re.search(r"calls=%([^,\s]+)", ln)
            if not (" dynamic-slice(" in ln or (called and called.group(1) in slicing)):
                return False
        return bool(us)

    count = 0
    for name, ln in defs:
        m = re.search(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", ln)
        if not m:
            continue
        shapes = re.findall(r"[a-z0-9]+\[[0-9,]*\]", m.group(1))
        if not m.group(1).startswith("("):
            count += int(not shapes[0].endswith("[]") and only_sliced(name))
            continue
        for i, shape in enumerate(shapes):
            if shape.endswith("[]"):
                continue
            gtes = [n for n, u in users(name) if " get-tuple-element(" in u and re.search(rf"index={i}\b", u)]
            count += int(bool(gtes) and all(only_sliced(g) for g in gtes))
    return count


class CompileCounter:
    """Wraps a jitted function and reports how many distinct programs it compiled."""

    def __init__(self, jitted: Callable):
        self.fn = jitted

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @property
    def programs(self) -> int:
        return int(self.fn._cache_size())


# --------------------------------------------------------------------------------- pipelined model
def _stacked_var(v: nnx.Variable, value: jax.Array) -> nnx.Variable:
    names = v.get_metadata().get("out_sharding") or (None,) * (value.ndim - 3)
    return v.replace(value, out_sharding=("stage", None, "layers", *names))


def layout_schedule(layout: Layout, num_layers: int, *, microbatches: int = 0, schedule: str = "gpipe",
                    repeats: int = 2) -> "pipeline.Schedule | None":
    """The pipeline schedule a layout trains under (None without pp); it is also how a pipelined run's
    checkpoint stacks the LLM's blocks, so `export` rebuilds it from the run's `parallel.*`."""
    if layout.pp <= 1:
        return None
    return pipeline.make_schedule(schedule, layout.pp, microbatches or 2 * layout.pp, num_layers, repeats)


class PipelinedLLM(nnx.Module):
    """The LLM with its blocks stacked ``[stage, repeat, layer, ...]`` so ``pp`` can shard them.

    Shares the embedding, final norm and head of the model it is built from; ``embed``/``logits`` are the
    model's own methods.
    """

    def __init__(self, model: LLM, schedule: pipeline.Schedule):
        self.embedding, self.lm_head, self.final_norm = model.embedding, model.lm_head, model.final_norm
        self.tie_embeddings = model.tie_embeddings
        self.vocab_size, self.embed_dim, self.config_json = model.vocab_size, model.embed_dim, model.config_json
        self.num_layers = len(model.blocks)
        graphs, states = zip(*(nnx.split(b) for b in model.blocks))
        if any(g != graphs[0] for g in graphs[1:]):
            raise ConfigError("pipeline parallelism needs identical blocks on every layer (e.g. model.moe.every=0 "
                              "or 1): stages are stacked into one array per parameter")
        stacked = pipeline.stack_layers(list(states), schedule)
        stacked = jax.tree.map(lambda v, a: _stacked_var(v, a), states[0], stacked,
                               is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.stages = nnx.merge(graphs[0], stacked)
        self.repeats = schedule.repeats

    embed = LLM.embed
    logits = LLM.logits


def unstack_params(pipelined_params: nnx.State, schedule: pipeline.Schedule) -> dict:
    """Pure-dict params of a ``PipelinedLLM`` in the original ``LLM`` layout (``blocks`` as a list)."""
    pure = nnx.to_pure_dict(pipelined_params)
    stages = pure.pop("stages")
    stages = jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, stages,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    layers = pipeline.unstack_layers(stages, schedule)
    pure["blocks"] = {i: layer for i, layer in enumerate(layers)}
    return pure


def _wraps(fn: Callable, target: Callable, depth: int = 4) -> bool:
    """``fn`` is ``target`` or a thin wrapper of it (``functools.wraps``' ``__wrapped__``, or a closure over it,
    e.g. the trainer tracing the loss inside a context): the explicit step may then replace it."""
    if fn == target:
        return True
    if depth == 0 or not callable(fn):
        return False
    inner = [getattr(fn, "__wrapped__", None)] + [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                                                  if callable(getattr(c, "cell_contents", None))]
    return any(f is not None and _wraps(f, target, depth - 1) for f in inner)


def _project_qkv(blk: nnx.Module, x: jax.Array, pos: jax.Array, rope: jax.Array | None):
    """A layer's q/k/v of its normed input: turned by ``pos`` (RoPE) or by ``rope`` [B, L, 3] (M-RoPE)."""
    if rope is None:
        return blk.attn.project_qkv(blk.attn_norm(x), pos)
    return mrope.project_qkv(blk.attn, blk.attn_norm(x), rope, blk.mrope_section)


def _is_embedding(path: tuple) -> bool:
    return bool(path) and getattr(path[0], "key", None) == "embedding"


# ---------------------------------------------------------------------------------------- engine
class LLMParallel:
    """Mesh, placements and the parallel loss for one LLM layout."""

    def __init__(self, layout: str | Layout, model_cfg: Any, *, devices: list | None = None,
                 rules: str = "llm_5d", microbatches: int = 0,
                 schedule: Literal["gpipe", "circular"] = "gpipe", repeats: int = 2, remat: bool | str = "none",
                 cp_impl: Literal["ring", "allgather"] = "ring", ep_impl: Literal["alltoall", "gspmd"] = "alltoall",
                 skip_bubbles: bool = True):
        devices = list(jax.devices() if devices is None else devices)
        self.layout = parse_layout(layout, len(devices)) if isinstance(layout, str) else layout
        r = repeats if (schedule == "circular" and self.layout.pp > 1) else 1
        self.mesh: Mesh = make_mesh(self.layout, devices, model_cfg, microbatches=microbatches, circular_repeats=r)
        self.rules = rules_lib.load_rules(rules)
        self.model_cfg = model_cfg
        # parallel.remat (none | full | save_dots): every layer, in every layout (pipeline stages included)
        self.remat = remat_mode(remat)
        self.cp_impl, self.ep_impl, self.skip_bubbles = cp_impl, ep_impl, skip_bubbles
        self.schedule: pipeline.Schedule | None = layout_schedule(self.layout, model_cfg.num_layers,
                                                                  microbatches=microbatches, schedule=schedule,
                                                                  repeats=repeats)
        if self.layout.ep > 1 and ep_impl == "alltoall" and self.layout.pp > 1:
            raise ConfigError(f"parallel.llm={self.layout}: expert all-to-all inside the pipeline is not supported; "
                              "use pp with dense layers or ep without pp")

    @classmethod
    def from_config(cls, cfg: Any, devices: list | None = None) -> "LLMParallel":
        """From an omnijax ``Config`` (``parallel`` and ``model`` sections)."""
        p = cfg.parallel
        return cls(p.llm, cfg.model, devices=devices, rules=p.rules, microbatches=p.microbatches,
                   schedule=p.pipeline_schedule, remat=p.remat)

    # ---------------------------------------------------------------------- placement interface
    @property
    def bubble_fraction(self) -> float:
        return self.schedule.bubble_fraction if self.schedule else 0.0

    @property
    def data_parallel_size(self) -> int:
        return self.layout.batch_shards

    def activation(self, *names: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(names, None, self.mesh, "activations"))

    def constrain(self, x: jax.Array, *names: str | None) -> jax.Array:
        spec = self.rules.spec(names, x.shape, self.mesh, "activations")
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def state_shardings(self, state: Any) -> Any:
        """Params and everything that mirrors them (optimizer moments, gradients) by the rules."""
        return rules_lib.state_shardings(state, self.rules, self.mesh)

    def put_state(self, state: Any) -> Any:
        return jax.device_put(state, self.state_shardings(state))

    def batch_sharding(self, batch: dict) -> dict:
        return {k: self.activation("batch", "seq") if np.ndim(v) >= 2 else self.activation("batch")
                for k, v in batch.items()}

    def layout_batch(self, batch: dict) -> dict:
        """Host-side: store every ``[B, L]`` array in the causal load-balanced order for ``cp``."""
        if self.layout.cp == 1:
            return dict(batch)
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            out[k] = v[:, context.balanced_order(v.shape[1], self.layout.cp)] if v.ndim >= 2 else v
        return out

    def host_rows(self, global_rows: int, process: int | None = None) -> np.ndarray:
        """Global rows of every batch that this host (or ``process``) loads: the rows of the batch shards
        its devices hold, increasing (hosts that differ only across pp/tp/cp load the same rows)."""
        return hosts.sharding_rows(self.activation("batch"), global_rows, process)

    def put_batch(self, batch: dict, global_rows: int | None = None) -> dict:
        """This host's rows of the batch (``host_rows``, in that order) -> global arrays of explicit
        global shape; the global row count is inferred from the shards this host holds unless given."""
        if not batch:
            return {}
        local = len(np.asarray(next(iter(batch.values()))))
        g = global_rows or hosts.global_rows_of(self.activation("batch"), local, what=f"layout {self.layout}")
        rows = self.host_rows(g)
        if local != len(rows):
            raise ConfigError(f"put_batch got {local} rows; this host loads {len(rows)} of the {g}-row batch "
                              "(LLMParallel.host_rows)")
        batch = self.layout_batch(batch)
        sh = self.batch_sharding(batch)
        return {k: hosts.put_host_rows(sh[k], v, rows, (g, *np.shape(v)[1:])) for k, v in batch.items()}

    def put_global_batch(self, batch: dict) -> dict:
        """The whole batch, identical on every host -> global arrays (each host places only its rows)."""
        if not batch:
            return {}
        g = len(np.asarray(next(iter(batch.values()))))
        if g % self.layout.batch_shards:
            raise ConfigError(f"data.batch_size={g}: layout {self.layout} splits the batch {self.layout.batch_shards} "
                              f"ways (dp x fsdp x ep); use a multiple of {self.layout.batch_shards}")
        return self.put_batch(hosts.take_rows(batch, self.host_rows(g)), global_rows=g)

    # ----------------------------------------------------------------------------------- model
    def prepare(self, model: LLM) -> nnx.Module:
        """The module to train under this layout: the model itself, or its pipelined form for pp > 1."""
        return PipelinedLLM(model, self.schedule) if self.schedule else model

    def _attention(self, q, k, v, seg, pos, inside_pipeline: bool):
        impl = getattr(self.model_cfg, "attention", "auto")  # model.attention: which implementation
        if self.layout.cp > 1 and not inside_pipeline:
            return context.cp_attention(q, k, v, seg, seg, pos, pos, mesh=self.mesh, impl=self.cp_impl,
                                        attention_impl=impl)
        if inside_pipeline:  # cuDNN in a stage: fully manual over the other axes (omnijax.parallel.stage_attention)
            out = stage_attention(q, k, v, seg, pos, mesh=self.mesh, rules=self.rules, impl=impl)
            if out is not None:
                return out
        return dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                     kv_positions=pos, causal=True, impl=impl)

    def _moe(self, moe, h, seg):
        if self.layout.ep > 1 and self.ep_impl == "alltoall":
            specs = {n: self.rules.spec(getattr(moe, n).get_metadata()["out_sharding"], getattr(moe, n).shape,
                                        self.mesh, "params") for n in ("gate", "up", "down")}
            return expert.ep_moe(moe, h, seg, mesh=self.mesh, weight_specs=specs)
        return moe(h, seg)

    def block(self, blk: nnx.Module, x: jax.Array, seg: jax.Array, pos: jax.Array,
              inside_pipeline: bool = False, rope: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """One decoder layer (same maths as ``Block.__call__``) with CP attention and EP experts; ``rope``:
        the tokens' M-RoPE positions [B, L, 3] (q/k turned by them instead of by ``pos``)."""
        q, k, v = _project_qkv(blk, x, pos, rope)
        x = x + blk.attn.output(self._attention(q, k, v, seg, pos, inside_pipeline))
        h = blk.mlp_norm(x)
        y, aux = self._moe(blk.mlp, h, seg) if blk.is_moe else (blk.mlp(h), zero_aux())
        if not inside_pipeline:
            x = self.constrain(x + y, "batch", "seq", "embed")
        else:
            x = x + y
        return x, aux

    def forward_embeddings(self, model: nnx.Module, x: jax.Array, seg: jax.Array | None = None,
                           pos: jax.Array | None = None, feed: tuple | None = None,
                           head: bool = True, rope: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Parallel counterpart of ``LLM.forward_embeddings``: ``x [B, L, D] -> (logits, aux)``
        (``head=False``: the final-normed hidden states, for ``head_cross_entropy``; ``rope``: M-RoPE
        positions [B, L, 3], as the batch carries them).

        ``feed`` (pipelined layouts only): completes each microbatch's input inside the pipeline loop,
        see :func:`omnijax.parallel.pipeline.spmd_pipeline`."""
        seg, pos = default_packing(x.shape, seg, pos)
        x = self.constrain(x, "batch", "seq", "embed")
        if isinstance(model, PipelinedLLM):
            x, aux = self._pipeline(model, x, seg, pos, feed, rope)
        else:
            if feed is not None:
                raise ConfigError("feeding microbatches inside the pipeline needs a pipelined layout (pp > 1)")
            aux = zero_aux()
            for blk in model.blocks:
                x, a = run_block(lambda b, *a: self.block(b, *a[:3], False, *a[3:]), blk, x, seg, pos,
                                 *(() if rope is None else (rope,)), remat=self.remat)
                aux = {kk: aux[kk] + a[kk] for kk in AUX_KEYS}
        h = self.constrain(model.final_norm(x), "batch", "seq", "embed")
        if not head:
            return h, aux
        return self.constrain(model.logits(h), "batch", "seq", "vocab"), aux

    def _pipeline(self, model: PipelinedLLM, x, seg, pos, feed=None, rope=None):
        sch = self.schedule
        graph, stacked = nnx.split(model.stages)
        per = jax.tree.leaves(stacked)[0].shape[2]
        b = x.shape[0]
        if b % sch.microbatches or (b // sch.microbatches) % self.layout.batch_shards:
            raise ConfigError(f"batch of {b} sequences: pp needs it divisible by parallel.microbatches="
                              f"{sch.microbatches} x data shards {self.layout.batch_shards}")

        def stage(params, h, ex):
            s_seg, s_pos, *s_rope = ex
            tot = jnp.zeros((len(AUX_KEYS),), jnp.float32)
            for j in range(per):
                blk = nnx.merge(graph, jax.tree.map(lambda a: a[j], params))
                h, a = self.block(blk, h, s_seg, s_pos, inside_pipeline=True, rope=s_rope[0] if s_rope else None)
                tot = tot + jnp.stack([a[kk] for kk in AUX_KEYS])
            return h, tot

        xs = pipeline.split_microbatches(x, sch.microbatches)
        xs = self.constrain(xs, None, "batch", "seq", "embed")
        extras = tuple(pipeline.split_microbatches(a, sch.microbatches) for a in (seg, pos, rope) if a is not None)
        ys, aux = pipeline.spmd_pipeline(stage, stacked, xs, extras, mesh=self.mesh, schedule=sch, remat=self.remat,
                                         feed=feed, skip_bubbles=self.skip_bubbles)
        y = self.constrain(pipeline.merge_microbatches(ys), "batch", "seq", "embed")
        m = sch.microbatches  # per-microbatch means -> mean over the batch; counts add up
        aux = {kk: aux[i] if kk == "moe_dropped_tokens" else aux[i] / m for i, kk in enumerate(AUX_KEYS)}
        return y, aux

    def embed(self, model: nnx.Module, tokens: jax.Array) -> jax.Array:
        """``model.embed`` on the table in its own (vocab/FSDP) sharding: token ids and looked-up rows
        move between devices, never the table (:func:`omnijax.parallel.embedding.sharded_lookup`); the
        table's gradient stays in its shard. A layout whose column split does not follow the batch split
        gathers the table's columns first, as FSDP gathers any weight before use."""
        table = model.embedding[...]
        names = model.embedding.get_metadata().get("out_sharding") or ("vocab", "embed")
        stored = self.rules.spec(names, table.shape, self.mesh, "params")
        ids = self.rules.spec(("batch", "seq"), tokens.shape, self.mesh, "activations")
        if embedding.can_shard_lookup(stored, ids):
            table = jax.lax.with_sharding_constraint(table, NamedSharding(self.mesh, stored))
            tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(self.mesh, ids))
            rows = embedding.sharded_lookup(table, tokens, mesh=self.mesh, table_spec=stored, ids_spec=ids)
            return self.constrain(rows, "batch", "seq", "embed")
        spec = self.rules.spec(("vocab", None), table.shape, self.mesh, "params")
        table = jax.lax.with_sharding_constraint(table, NamedSharding(self.mesh, spec))
        return self.constrain(jnp.take(table, tokens, axis=0), "batch", "seq", "embed")

    def loss_fn(self, model: nnx.Module, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
        """``LossFn`` for ``omnijax.train.step``: (loss_sum, token_count, aux) of the next-token loss."""
        x = self.embed(model, batch["tokens"])
        h, aux = self.forward_embeddings(model, x, batch["segment_ids"], batch["positions"], head=False,
                                         rope=batch.get("rope_positions"))
        loss_sum, count = head_cross_entropy(model, h, batch["targets"], batch["loss_mask"])
        return loss_sum, count, aux

    # ---------------------------------------------------------------- explicit FSDP gradients
    def grads_fn(self, loss_fn: Callable) -> Callable | None:
        """``loss_and_grads`` replacement for layouts that split the batch and the sequence (dp x fsdp x cp,
        a dense LLM), or None where GSPMD keeps the step.

        XLA:CPU lowers a sharded weight's gradient as an all-reduce of the full gradient followed by a
        slice; here the whole forward/backward runs per device inside one ``shard_map``: each weight is
        gathered over the axes that split it (ZeRO-3), and the transpose of that gather reduce-scatters
        its gradient straight into the shard. The embedding table is not gathered for the lookup unless
        the logits need it (tied embeddings)."""
        lay = self.layout
        dense = not any(is_moe_layer(self.model_cfg, i) for i in range(self.model_cfg.num_layers))
        if not _wraps(loss_fn, self.loss_fn) or not dense or lay.tp * lay.pp * lay.ep != 1 or lay.fsdp == 1:
            return None
        return self._manual_loss_and_grads

    def _manual_loss_and_grads(self, graphdef: Any, rest: Any, loss_fn: Callable, params: Any, batch: dict, *,
                               grad_accum: int = 1, compute_dtype: Any = jnp.float32,
                               aux_weights: dict[str, float] | None = None) -> tuple[jax.Array, Any, dict]:
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        lay = self.layout
        p_specs = jax.tree.map(lambda v: v.get_value().spec, self.state_shardings(params), is_leaf=is_var)
        p_specs = jax.tree.map(lambda v: v.get_value() if is_var(v) else v, p_specs, is_leaf=is_var)
        b_specs = {k: v.spec for k, v in self.batch_sharding(batch).items()}
        total = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        tied = self.model_cfg.tie_embeddings
        table_spec = p_specs["embedding"]
        axes = embedding.spec_axes(b_specs["tokens"])  # the axes that split the batch

        def gather(x: jax.Array, spec: Any) -> jax.Array:
            for dim, entry in enumerate(spec):
                if entry is not None:
                    x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
            return x

        def body(p_local, b_local, total):
            def local_loss(model, mb):
                if tied:
                    x = jnp.take(model.embedding[...], mb["tokens"], axis=0)
                else:
                    x = embedding.local_lookup(model.embedding[...], mb["tokens"], mesh=self.mesh,
                                               table_spec=table_spec, ids_spec=b_specs["tokens"])
                rope = mb.get("rope_positions")
                if lay.cp == 1:
                    h, aux = model.forward_embeddings(x, mb["segment_ids"], mb["positions"], remat=self.remat,
                                                      head=False, rope_positions=rope)
                else:  # the sequence split over cp: this device's chunks, attention over the cp ring
                    seg, pos = mb["segment_ids"], mb["positions"]
                    for blk in model.blocks:
                        x, _ = run_block(self._manual_block, blk, x, seg, pos, *(() if rope is None else (rope,)),
                                         remat=self.remat)
                    h, aux = model.final_norm(x), zero_aux()
                loss_sum, count = head_cross_entropy(model, h, mb["targets"], mb["loss_mask"])
                return loss_sum, count, aux

            def full(p):
                return jax.tree_util.tree_map_with_path(
                    lambda path, v, sp: v if (not tied and _is_embedding(path)) else v.replace(gather(v[...], sp)),
                    p, p_specs, is_leaf=is_var)

            loss, grads, aux = loss_and_grads(graphdef, rest, local_loss, p_local, b_local, grad_accum=grad_accum,
                                              compute_dtype=compute_dtype, aux_weights=aux_weights, total=total,
                                              params_fn=full)
            return jax.lax.psum(loss, axes), grads, jax.tree.map(lambda a: jax.lax.psum(a, axes), aux)

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(p_specs, b_specs, P()), out_specs=(P(), p_specs, P()))
        return fn(params, batch, total)

    def _manual_block(self, blk: nnx.Module, x: jax.Array, seg: jax.Array, pos: jax.Array,
                      rope: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """One dense layer per device inside the explicit step: the sequence is this device's cp chunks
        (balanced order; masks come from positions), attention runs over the cp ring or an all-gather."""
        impl = getattr(self.model_cfg, "attention", "auto")
        body = context._ring_body if self.cp_impl == "ring" else context._allgather_body
        extra = ({"attention_impl": impl} if self.cp_impl == "ring"
                 else {"attention_fn": functools.partial(dot_product_attention, impl=impl)})
        q, k, v = _project_qkv(blk, x, pos, rope)
        att = body(q, k, v, seg, seg, pos, pos, axis="cp", size=self.layout.cp, causal=True, **extra)
        x = x + blk.attn.output(att)
        return x + blk.mlp(blk.mlp_norm(x)), zero_aux()

    # ------------------------------------------------------------------------------ train step
    def jit_train_step(self, step: Callable, state: Any, batch: dict) -> CompileCounter:
        """A train step (``omnijax.train.step.make_train_step`` with this layout's ``loss_fn``), jitted
        with fixed input/output shardings so every step reuses one compiled program."""
        s_sh = self.state_shardings(state)
        b_sh = {k: v.sharding if isinstance(v, jax.Array) else self.batch_sharding(batch)[k] for k, v in batch.items()}
        return CompileCounter(jax.jit(step, in_shardings=(s_sh, b_sh), out_shardings=(s_sh, None), donate_argnums=0))
