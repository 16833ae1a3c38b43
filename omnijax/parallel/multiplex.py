"""Encoder–LLM multiplexing: one jitted step in which every device encodes and the LLM keeps its layout.

The encoders run inside one `shard_map` over *all* devices (the encoder view `(edp, esp)` of the
LLM mesh): each device encodes its own short segments (pure data parallelism) and its chunk of the
long segments of its `esp` group (sequence parallelism: all-to-all over heads). The projected
output tokens then travel to the LLM positions that need them with one fixed-capacity
`all_to_all` driven by the host plan (`omnijax.parallel.routing`); its transpose carries the
gradients back. The LLM half is `LLMParallel`'s (DP/FSDP/TP/CP/EP/PP), so the whole
forward/backward is one XLA program that the compiler schedules.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from omnijax.data.packing import ROW_KEYS
from omnijax.data.payload import LazyRows, global_layout, local_rows, payload_bytes, step_rows
from omnijax.errors import ConfigError
from omnijax.layers import attention as attention_lib, remat as remat_lib, sequence
from omnijax.models.encoder_layers import compute_dtype
from omnijax.models.mllm import MultimodalModel
from omnijax.parallel import context, hosts, routing, rules as rules_lib
from omnijax.parallel.engine import LLMParallel
from omnijax.models.losses import head_cross_entropy

ALL = routing.MESH_AXES


class MultiplexedModel(nnx.Module):
    """The multimodal model with its LLM in the layout's form (stacked stages under pp)."""

    def __init__(self, model: MultimodalModel, engine: LLMParallel):
        self.llm = engine.prepare(model.llm)
        self.encoders = model.encoders
        self.projectors = model.projectors


class EncoderPart(nnx.Module):
    """Encoders + projectors: the half of the model that runs inside the shard_map."""

    def __init__(self, encoders: nnx.Dict, projectors: nnx.Dict):
        self.encoders, self.projectors = encoders, projectors


def ulysses_attention(axes: tuple[str, ...]):
    """Sequence-parallel attention over `axes`: all-to-all heads<->sequence, attend, and back.

    Each device holds a chunk of the group's long buffer; after the exchange it holds every row of
    the group for H/esp heads, so attention sees whole segments (segment ids decide who attends to
    whom), then the inverse exchange restores the row chunking."""

    def attend(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=False, **kw):
        # q/k/v [B=1, n, H, Dh] -> [1, esp*n, H/esp, Dh]
        gather = lambda t: jax.lax.all_to_all(t, axes, 2, 1, tiled=True)  # noqa: E731
        seg = jax.lax.all_gather(q_segment_ids, axes, axis=1, tiled=True)
        pos = jax.lax.all_gather(q_positions, axes, axis=1, tiled=True)
        out = attention_lib.dot_product_attention(gather(q), gather(k), gather(v), q_segment_ids=seg,
                                                  kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                                                  causal=causal, **kw)
        return jax.lax.all_to_all(out, axes, 1, 2, tiled=True)

    return attend


LLM_KEYS = ROW_KEYS  # the per-token row arrays (M-RoPE's rope_positions among them, where the batch has them)


def microbatch_views(batch: dict, microbatches: int, encoders: tuple[str, ...]) -> list[dict]:
    """The pipeline's microbatch m as a batch of its own: LLM rows m, m+M, ... (the rows
    `pipeline.split_microbatches` gives it) with only the encoder segments whose outputs land there,
    their destinations renumbered into the sub-batch. Pure host function."""
    M = microbatches
    B, L = step_rows(batch), int(np.shape(batch["tokens"])[1])
    if B % M:
        raise ConfigError(f"batch of {B} rows is not divisible by parallel.microbatches={M}")
    rows = local_rows(batch)
    if rows is None:
        views = [{k: np.asarray(batch[k])[m::M] for k in LLM_KEYS if k in batch} for m in range(M)]
    else:  # the host's own rows of each microbatch, renumbered into it, and the step's row geometry
        views = [{**{k: np.asarray(batch[k])[rows % M == m] for k in LLM_KEYS if k in batch},
                  "rows": rows[rows % M == m] // M, "row_docs": np.asarray(batch["row_docs"])[m::M]}
                 for m in range(M)]
    for name in encoders:
        if f"{name}_segment_ids" not in batch:
            continue
        seg, dest = np.asarray(batch[f"{name}_segment_ids"]), np.asarray(batch[f"{name}_dest"]).astype(np.int64)
        r = len(seg) // len(dest)
        owner = np.zeros(len(seg), np.int64)      # microbatch of each input row's segment
        for s in routing.segments_of(batch, {name: r}, lambda *_: 0.0):
            rows = np.unique(s.dests[s.dests >= 0] // L % M)
            if rows.size > 1:
                raise ConfigError(f"a {name} segment feeds LLM rows of {rows.size} different microbatches; "
                                  "a segment's tokens must stay in one packed row")
            owner[s.start:s.start + s.rows] = rows[0] if rows.size else 0
        tok_owner = owner[::r]
        for m, view in enumerate(views):
            keep = (seg > 0) & (owner == m)
            keep_tok = (dest >= 0) & (tok_owner == m)
            view[f"{name}_inputs"] = batch[f"{name}_inputs"]  # possibly lazy: sliced, never copied whole
            view[f"{name}_positions"] = batch[f"{name}_positions"]  # sliced per placed segment
            view[f"{name}_segment_ids"] = np.where(keep, seg, 0).astype(seg.dtype)
            view[f"{name}_dest"] = np.where(keep_tok, (dest // L) // M * L + dest % L, -1).astype(np.int32)
    return views


def _maxima(caps) -> dict[str, int]:
    """The elementwise maximum of capacity dicts (a key missing from one counts as 0)."""
    out: dict[str, int] = {}
    for c in caps:
        for k, v in c.items():
            out[k] = max(int(v), out.get(k, 0))
    return out


def _stack_plans(plans: list[routing.Plan]) -> routing.Plan:
    """One plan per microbatch -> arrays [devices, microbatches, ...] and whole-step statistics
    (counts add up; the padded fraction is recomputed from the summed counts)."""
    arrays = {k: np.stack([p.arrays[k] for p in plans], axis=1) for k in plans[0].arrays}
    stats: dict[str, float] = {}
    for k in plans[0].stats:
        vals = [p.stats[k] for p in plans]
        if k.endswith("max_over_mean"):
            stats[k] = float(np.mean(vals))   # balance of each microbatch's encoder work (one per iteration)
        elif k.endswith("capacity"):
            stats[k] = max(vals)
        else:
            stats[k] = sum(vals)
    real = stats["enc_rows_real"] + stats["llm_tokens_real"]
    stats["padded_fraction"] = 1.0 - real / max(stats["enc_rows_computed"] + stats["llm_tokens_computed"], 1)
    payload = None if plans[0].device_payload is None else sum(p.device_payload for p in plans)
    return routing.Plan(arrays, stats, plans[0].capacities, plans[0].devices, payload)


def _encoder_path(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) in ("encoders", "projectors") for k in path)


class Multiplexer:
    """Placement + loss for the joint multimodal step (the trainer's placement interface).

    mode: "balanced" (omnijax), "arrival" (decoupled, no reordering), "coupled" (the baseline that
    encodes on pipeline stage 0, work split over its tp/cp ranks) or "coupled_replicated" (the same,
    every tp/cp rank encoding the whole shard). long_short=False keeps every segment DP.
    interleave (pipelined LLMs): plan each pipeline microbatch separately and encode + route it inside
    the pipeline loop, one iteration ahead of stage 0 (microbatch m+1 during iteration m), so encoder
    work runs beside the stages instead of as a phase before the pipeline; outputs then go to the pp=0
    replicas only. Off by default: per-microbatch buffers pad more when a microbatch holds only a few
    segments per device (`python -m recipes bench omni` measures both).
    """

    growth: float = routing.BUCKET_GROWTH  # capacity bucket step (a planning-only instance keeps it)
    hosts: int | None = None
    payload_band, reuse_slack, max_programs, route_growth, _resumed = 0.05, 0.05, 4, 1.25, False
    programs: list[dict] = []  # never mutated in place (a planning-only instance shares the empty one)
    route_local: bool | None = False  # plan per host group (issue 47); None: on with several processes
    exchange = None  # exchange(round, bytes) -> every process's bytes: agrees capacities between host groups
    group_host_of: np.ndarray | None = None  # a host group's planner: the hosts of its sub-grid devices
    own_host: int | None = None  # plan only this host's group (simulated hosts, e.g. `bench plan`); None: see _me
    in_group = False

    def __init__(self, engine: LLMParallel, mm_cfg: Any, *, encoder_layout: str = "",
                 encoder_rules: str = "encoder_dp", mode: routing.Mode = "balanced", long_short: bool = True,
                 balance_rows: bool | None = None, cost_fn=None, capacities: dict | None = None,
                 interleave: bool = False, growth: float = routing.BUCKET_GROWTH, hosts: int | None = None,
                 payload_band: float = 0.05, reuse_slack: float = 0.05, max_programs: int = 4,
                 route_local: bool | None = None, exchange=None):
        """growth: the capacity bucket step (`routing.BUCKET_GROWTH` in training; benches may vary it).
        hosts: split the devices into this many contiguous hosts for the payload check of `size_window`
        (None: the job's processes, where there are several). payload_band: every host decodes
        1/hosts +- this of each step's payload. reuse_slack / max_programs: a window reuses a program
        already compiled that holds it with at most `reuse_slack` more encoder rows in all than the
        window's own fit; past `max_programs` programs, the one that holds the window with the fewest
        rows, else a wider one (`_reuse`)."""
        self.engine, self.mesh, self.mm_cfg = engine, engine.mesh, mm_cfg
        self.growth = float(growth)
        self.hosts, self.payload_band = hosts, float(payload_band)
        self.reuse_slack, self.max_programs = float(reuse_slack), int(max_programs)
        self.programs: list[dict] = []   # the capacity sets windows were sized to so far (one program each)
        self._resumed = False
        self.interleave = interleave
        if self.interleave and engine.schedule is None:
            raise ConfigError(f"parallel.interleave_encoders: layout {engine.layout} has no pipeline (pp=1); "
                              "encoder work can only be interleaved with pipeline iterations")
        self.route_local, self.exchange = route_local, exchange
        self.encoder_rules = rules_lib.load_rules(encoder_rules)
        rows = self.encoder_rules.activations.get("rows", ())
        if tuple(rows) != ALL:
            raise ConfigError(f"shardings/{encoder_rules}.yaml: activations.rows must list every mesh axis in order "
                              f"{list(ALL)} (every device encodes), got {list(rows)}")
        devices = int(np.prod(list(self.mesh.shape.values())))
        edp, esp = routing.parse_encoder_layout(encoder_layout, devices)
        self.grid = routing.DeviceGrid.from_layout(engine.layout, esp)
        self.esp_axes = self.grid.esp_axes()
        self.mode, self.long_short = mode, long_short and esp > 1
        self.capacities = capacities
        from omnijax.data.packing import encoder_specs

        specs = encoder_specs(mm_cfg)
        self.reductions = {n: s.group for n, s in specs.items()}
        self.dims = {n: s.dim for n, s in specs.items()}
        if self.long_short:
            from omnijax.mm_config import encoder_configs

            for name, c in encoder_configs(mm_cfg).items():
                if c.num_heads % esp:
                    raise ConfigError(f"parallel.encoder: esp={esp} must divide model.encoders.{name}.num_heads="
                                      f"{c.num_heads} (sequence parallelism splits heads)")
        self.cost_fn = cost_fn or self._default_cost
        self.balance_rows = mode == "balanced" if balance_rows is None else balance_rows
        from omnijax.data.cost import CostModel

        flops = CostModel.from_flops(mm_cfg)  # built once: a config walk per segment cost half the host's planning
        self.llm_coeffs = (flops.llm.a, flops.llm.b)
        self._encoder_coeffs = flops.encoders
        self.last_plan: routing.Plan | None = None

    def _default_cost(self, name: str, rows: int) -> float:
        coeffs = self._encoder_coeffs[name]
        n = rows // self.reductions[name] if name == "audio" else rows
        return float(coeffs(n))

    # ------------------------------------------------------------------ placement interface
    @property
    def bubble_fraction(self) -> float:
        return self.engine.bubble_fraction

    @property
    def data_parallel_size(self) -> int:
        return self.engine.data_parallel_size

    def prepare(self, model: MultimodalModel) -> MultiplexedModel:
        return MultiplexedModel(model, self.engine)

    def state_shardings(self, state: Any) -> Any:
        """LLM variables by the LLM rules, encoder and projector variables by the encoder rules."""
        llm = self.engine.state_shardings(state)
        enc = rules_lib.state_shardings(state, self.encoder_rules, self.mesh)
        is_leaf = lambda x: isinstance(x, (nnx.Variable, NamedSharding))  # noqa: E731
        return jax.tree_util.tree_map_with_path(lambda path, a, b: b if _encoder_path(path) else a, llm, enc,
                                                is_leaf=is_leaf)

    def put_state(self, state: Any) -> Any:
        return jax.device_put(state, self.state_shardings(state))

    def plan(self, host_batch: dict, fill: bool = True) -> routing.Plan:
        """The step's plan inside the current capacities (the window's, from `size_window`); a batch that
        outgrows them (one no window reserved) grows them to the buckets that hold it, so it still trains.
        With several hosts, whole esp groups are spread so each decodes about its share of the payload.
        `fill=False` plans placement and capacities only: no buffer is built, no payload decoded.

        Interleaved: one plan per pipeline microbatch (shared capacities), stacked on axis 1 of every
        array ([devices, microbatches, ...]). Per host group (`route_local`): each group planned here
        places and routes its own rows' segments on its own devices (`_plan_grouped`)."""
        if self.host_groups() is not None:
            return self._plan_grouped(host_batch, fill)
        parts = self.parts(host_batch)
        host_of = self.host_of() if self.mode == "balanced" else None

        def build(caps):
            return [routing.build_plan(part, self.grid, self.reductions, self.dims, self.cost_fn,
                                       order=context.balanced_order, mode=self.mode, long_short=self.long_short,
                                       capacities=caps, first_stage_only=self.interleave, growth=self.growth,
                                       fill_devices=self.local_devices if fill else (), host_of=host_of)
                    for part in parts]

        try:
            plans = build(self.capacities)
        except ConfigError:  # this batch needs more than the current capacities: grow them
            plans = build(None)
        grown = dict(self.capacities or {})
        for p in plans:
            grown = {k: max(v, grown.get(k, 0)) for k, v in p.capacities}
        if any(dict(p.capacities) != grown for p in plans):
            plans = build(grown)
        self.capacities = grown
        plan = plans[0] if not self.interleave else _stack_plans(plans)
        host_of = self.host_of()
        if host_of is not None and plan.device_payload is not None:
            shares = routing.host_payload_shares(plan.device_payload, host_of)
            plan.stats["host_payload_share_min"] = float(shares.min())
            plan.stats["host_payload_share_max"] = float(shares.max())
        return plan

    def host_of(self) -> np.ndarray | None:
        """The host of every plan device (None: one host). `hosts` given: contiguous runs of the device
        order; else the process of each device of the mesh (any device order)."""
        if self.in_group:  # a host group's planner: the hosts of its own devices
            return self.group_host_of
        D = self.grid.num_devices
        if self.hosts is not None:
            if self.hosts <= 1:
                return None
            if D % self.hosts:
                raise ConfigError(f"{D} devices do not split over hosts={self.hosts}")
            return np.arange(D) // (D // self.hosts)
        if getattr(self, "mesh", None) is None or jax.process_count() == 1:
            return None
        if getattr(self, "_host_of", None) is None:
            index = NamedSharding(self.mesh, P(ALL)).devices_indices_map((D,))
            out = np.zeros(D, np.int64)
            for dev, idx in index.items():
                out[int(idx[0].start or 0)] = dev.process_index
            self._host_of = out
        return self._host_of

    @property
    def local_devices(self) -> list[int] | None:
        """Plan device indices (row of every plan array) of this process's devices, in any device order
        (None without a mesh: a planning-only multiplexer fills every device)."""
        if getattr(self, "mesh", None) is None:
            return None
        if getattr(self, "_local", None) is None:
            D = self.grid.num_devices
            index = NamedSharding(self.mesh, P(ALL)).addressable_devices_indices_map((D,))
            self._local = sorted(int(idx[0].start or 0) for idx in index.values())
        return self._local

    # ------------------------------------------------------------------ host groups (issue 47)
    def _several(self) -> bool:
        """Each process plans only its own host group (several processes, no simulated `hosts`)."""
        return self.hosts is None and getattr(self, "mesh", None) is not None and jax.process_count() > 1

    def host_groups(self) -> list[routing.HostGroup] | None:
        """The host groups planned one by one (`route_local`), or None: the whole step as one plan."""
        if self.in_group:
            return None
        on = self.route_local
        if on is None:  # auto: several processes, on the path the data plane feeds
            on = self._several() and self.mode == "balanced" and not self.interleave and not self.balance_rows
        if not on:
            return None
        if self.mode != "balanced" or self.interleave or self.balance_rows:
            raise ConfigError("route_local plans each host group's own rows on its own devices: it needs "
                              "mode='balanced', interleave=False and balance_rows=False (rows placed by the data plane)")
        host_of = self.host_of()
        if host_of is None:
            return None
        key = (self.hosts, self.grid)
        if getattr(self, "_groups_key", None) != key:
            self._groups, self._groups_key, self._planners = routing.host_groups(self.grid, host_of), key, {}
        return self._groups

    def _me(self) -> int | None:
        """The host whose group this multiplexer plans (None: every group, all hosts simulated here)."""
        if self.own_host is not None:
            return int(self.own_host)
        return jax.process_index() if self._several() else None

    def _own_groups(self) -> list[routing.HostGroup]:
        """The host groups planned here: this host's own (several processes, or `own_host`), else every one."""
        groups, me = self.host_groups(), self._me()
        return groups if me is None else [g for g in groups if me in g.hosts]

    def _group_planner(self, group: routing.HostGroup) -> "Multiplexer":
        """A planning-only multiplexer on the group's sub-grid (its hosts' payload band inside the group)."""
        sub = self._planners.get(group.index)
        if sub is None:
            sub = Multiplexer.__new__(Multiplexer)
            sub.grid, sub.reductions, sub.dims, sub.cost_fn = group.grid, self.reductions, self.dims, self.cost_fn
            sub.mode, sub.long_short, sub.growth = self.mode, self.long_short, self.growth
            sub.interleave, sub.balance_rows, sub.capacities, sub.programs = False, False, None, []
            sub.payload_band, sub.reuse_slack, sub.max_programs = self.payload_band, self.reuse_slack, self.max_programs
            sub.in_group, sub.group_host_of, sub.hosts = True, group.host_of, None
            self._planners[group.index] = sub
        return sub

    def _views(self, batch: dict) -> list[tuple[routing.HostGroup, dict]]:
        """(group, its part of `batch`: `routing.group_view`) for every group planned here (kept for the
        last few batches: a window's sizing and its steps' plans read the same views)."""
        cache = self.__dict__.setdefault("_view_cache", {})
        hit = cache.get(id(batch))
        if hit is None or hit[0] is not batch:
            while len(cache) >= 16:
                cache.pop(next(iter(cache)))
            hit = cache[id(batch)] = (batch, [(g, routing.group_view(batch, g, self.reductions, self.grid.batch_shards))
                                              for g in self._own_groups()])
        return hit[1]

    def _agree(self, value) -> list:
        """Every process's `value` (JSON-able), in process order, through `exchange`; [value] where this
        process plans every group."""
        if self._me() is None or (self.exchange is None and not self._several()):
            return [value]
        if self.exchange is None:
            self.exchange = hosts.kv_exchange("omnijax_route_local")
        # one sequence of rounds per calling thread (the prefetch thread's windows and steps, the main
        # thread's held-out batches), numbered in the order threads first agree: the same on every process
        import threading

        with self.__dict__.setdefault("_agree_lock", threading.Lock()):
            channels = self.__dict__.setdefault("_channels", {})
            ch = channels.setdefault(threading.get_ident(), [len(channels), 0])
            ch[1] += 1
            key = ch[0] * 10**9 + ch[1]
        return [json.loads(b) for b in self.exchange(key, json.dumps(value).encode())]

    def _agree_max(self, caps: dict) -> dict:
        """The elementwise max of every process's capacities: one SPMD program for every group."""
        return _maxima(self._agree({k: int(v) for k, v in caps.items()}))

    def _group_plans(self, batch: dict, caps: dict | None, fill: bool) -> list[routing.Plan]:
        """Each group's plan (on its sub-grid, inside `caps`), widened to the global device numbering: the
        group's devices of this process filled (`fill`), or none."""
        local = set(self.local_devices) if fill and self.local_devices is not None else None
        out = []
        for g, view in self._views(batch):
            fd = () if not fill else None if local is None else [k for k, d in enumerate(g.devices.tolist()) if d in local]
            p = routing.build_plan(view, g.grid, self.reductions, self.dims, self.cost_fn, order=context.balanced_order,
                                   mode=self.mode, long_short=self.long_short, capacities=caps, growth=self.growth,
                                   fill_devices=fd, host_of=g.host_of)
            p.stats["group_imbalance"] = self._group_planner(g)._imbalance([p])
            p.stats["devices"] = g.grid.num_devices
            out.append(routing.widen_plan(p, g, self.grid.num_devices))
        return out

    @staticmethod
    def _caps_of(plans: list[routing.Plan]) -> dict:
        return _maxima(dict(p.capacities) for p in plans)

    def _join(self, plans: list[routing.Plan]) -> routing.Plan:
        """The groups' widened plans as one: arrays by global device, counts summed, maxima kept;
        `enc_cost_max_over_mean` over every planned device (across groups), `..._in_group` the worst group's."""
        devices = np.array([d for p in plans for d in p.devices], np.int64)
        order = np.argsort(devices, kind="stable")
        arrays = {k: np.concatenate([p.arrays[k] for p in plans])[order] for k in plans[0].arrays}
        stats: dict[str, float] = {}
        for k in plans[0].stats:
            vals = [p.stats[k] for p in plans]
            keep_max = k.endswith(("capacity", "imbalance", "max_over_mean", "_max")) or k in ("pad_row", "drop_index")
            stats[k] = max(vals) if keep_max else sum(vals)
        stats["enc_cost_max_over_mean_in_group"] = stats["enc_cost_max_over_mean"]
        mean = stats["enc_cost_total"] / max(stats["devices"], 1)
        stats["enc_cost_max_over_mean"] = stats["enc_cost_max"] / mean if mean > 0 else 1.0
        real = stats["enc_rows_real"] + stats["llm_tokens_real"]
        stats["padded_fraction"] = 1.0 - real / max(stats["enc_rows_computed"] + stats["llm_tokens_computed"], 1)
        payload = None if plans[0].device_payload is None else sum(p.device_payload for p in plans)
        return routing.Plan(arrays, stats, tuple(sorted(self._caps_of(plans).items())),
                            tuple(int(d) for d in devices[order]), payload)

    def _plan_grouped(self, batch: dict, fill: bool) -> routing.Plan:
        """`plan` per host group: each group inside the current capacities, grown (to the maxima of every
        group's needs, agreed between processes) where one outgrows them."""
        current = dict(self.capacities or {})
        try:
            plans = self._group_plans(batch, self.capacities, fill)
            need = self._caps_of(plans)
        except ConfigError:  # this batch needs more than the current capacities: grow them
            plans, need = None, self._caps_of(self._group_plans(batch, None, False))
        grown = _maxima([current, need])
        reserved = id(batch) in self.__dict__.get("_reserved", {}) and self._reserved[id(batch)] is batch
        if not (reserved and grown == current):  # a batch its window's sizing held needs no agreement: it
            grown = self._agree_max(grown)        # fits on every group (`size_window` checked them all)
        if plans is None or any(dict(p.capacities) != grown for p in plans):
            plans = self._group_plans(batch, grown, fill)
        self.capacities = grown
        plan = self._join(plans)
        host_of = self.host_of()
        if plan.device_payload is not None:
            shares = routing.host_payload_shares(plan.device_payload, host_of)
            plan.stats["host_payload_share_min"] = float(shares.min())
            plan.stats["host_payload_share_max"] = float(shares.max())
        return plan

    def _fit_groups(self, parts: list[list[dict]]) -> dict:
        """The window's fit per host group (each its own joint fit, payload band inside the group), then
        the maxima over the groups (agreed between processes) with the route capacity each group needs
        inside those encoder buffers."""
        fits = []
        for g in self._own_groups():
            sub = self._group_planner(g)
            views = [[next(v for h, v in self._views(p) if h is g) for p in ps]
                     for ps in parts]
            fits.append(sub._fit_window(views))
        enc = {k: v for k, v in self._agree_max(_maxima(fits)).items() if k != "route"}
        need = dict(enc)
        for g in self._own_groups():
            sub = self._group_planner(g)
            for ps in parts:
                for p in ps:
                    view = next(v for h, v in self._views(p) if h is g)
                    try:
                        plan = sub._build(view, enc)
                    except ConfigError:
                        plan = sub._build(view, None)
                    need = _maxima([need, dict(plan.capacities)])
        return self._agree_max(need)

    def host_rows(self, global_rows: int) -> np.ndarray:
        """The global LLM rows this process's devices hold: the only token rows it needs to read."""
        return self.engine.host_rows(global_rows)

    def parts(self, host_batch: dict) -> list[dict]:
        """What one plan covers: the batch, or (interleaved) each pipeline microbatch of it."""
        if not self.interleave:
            return [host_batch]
        return microbatch_views(host_batch, self.engine.schedule.microbatches, tuple(self.reductions))

    def balanced(self, host_batch: dict) -> dict:
        """The batch with its rows spread over the batch shards by LLM cost (if `balance_rows`)."""
        if not self.balance_rows:
            return host_batch
        return routing.balance_rows(host_batch, self.grid.batch_shards, self.llm_coeffs, tuple(self.reductions))

    def host_plan(self, host_batch: dict) -> tuple[dict, routing.Plan]:
        """Host half of `put_batch`: (rows balanced by LLM cost if enabled, the step's plan)."""
        host_batch = self.balanced(host_batch)
        plan = self.plan(host_batch)
        plan.stats["llm_cost_max_over_mean"] = routing.shard_cost_max_over_mean(
            host_batch, self.grid.batch_shards, self.llm_coeffs)
        return host_batch, plan

    def get_state(self) -> dict:
        """The capacities of the window being run and the programs sized so far: saved with checkpoints,
        so a resumed run places its steps in the same buffers (and so the same way) as the run it
        continues, and later windows reuse the same programs."""
        return {"capacities": dict(self.capacities or {}), "programs": [dict(p) for p in self.programs]}

    def set_state(self, state: dict) -> None:
        self.capacities = {str(k): int(v) for k, v in state.get("capacities", {}).items()} or None
        self.programs = [{str(k): int(v) for k, v in p.items()} for p in state.get("programs", [])]
        if self.capacities and self.capacities not in self.programs:
            self.programs.append(dict(self.capacities))
        self._resumed = self.capacities is not None

    def size_window(self, host_batches) -> dict:
        """The one window sizing, for the trainer (`reserve`) and every bench: capacities that hold every
        plan of these upcoming batches, so the window's steps run one compiled program; returns them.

        Placement only (nothing is decoded: payloads are still read once, by `put_batch`). The window is
        fitted jointly (`routing.fit_capacities`: per encoder the smallest long/short pair every batch
        fits), then checked against each batch's host balance: a batch whose placement would leave some
        host decoding more than 1/hosts + `payload_band` of its payload (tight buffers pack by room, not
        by cost, commit f9d5d03) gets roomier buffers, a bucket at a time, until every host is inside the
        band. A program already compiled is reused where it holds the window within `reuse_slack` more
        encoder rows (past `max_programs`, the one that holds it with the fewest, else a wider one:
        `_reuse`), so a run compiles a few programs, not one per window. A fit is a pure function of the window's batches; what a
        resumed run needs is the window's capacities and the programs so far (`get_state`)."""
        batches = [self.balanced(b) for b in host_batches]
        if not batches:
            return dict(self.capacities or {})
        parts = [self.parts(b) for b in batches]
        if self._resumed:  # resumed mid-window: the checkpointed capacities, which hold its batches
            self._resumed = False
            if self._holds(self.capacities, parts):
                return dict(self.capacities)
        caps = self._reuse(self._fit_window(parts), parts)
        self.capacities = dict(caps)
        if self.host_groups() is not None:  # these batches plan inside `caps` on every group: no agreement per step
            self._reserved = {id(b): b for b in host_batches}
        if caps not in self.programs:
            self.programs = [*self.programs, dict(caps)]
        return dict(caps)

    def _build(self, part: dict, caps: dict | None) -> routing.Plan:
        if self.host_groups() is not None:  # every group planned here, joined (placement only)
            return self._join(self._group_plans(part, caps, False))
        return routing.build_plan(part, self.grid, self.reductions, self.dims, self.cost_fn,
                                  order=context.balanced_order, mode=self.mode, long_short=self.long_short,
                                  capacities=caps, first_stage_only=self.interleave, growth=self.growth,
                                  fill_devices=(), host_of=self.host_of() if self.mode == "balanced" else None)

    def _imbalance(self, plans: list[routing.Plan]) -> float:
        """How far the host furthest from an even share of the step's payload is from it (0: one host)."""
        if self.host_groups() is not None:  # each group's hosts against their group's payload
            return max(float(p.stats.get("group_imbalance", 0.0)) for p in plans)
        host_of = self.host_of()
        if host_of is None:
            return 0.0
        shares = routing.host_payload_shares(sum(p.device_payload for p in plans), host_of)
        return float(np.abs(shares - 1.0 / len(shares)).max())

    def _holds(self, caps: dict | None, parts: list[list[dict]]) -> bool:
        """Every batch plans inside `caps` (none grows) with every host inside the payload band (per host
        group: on every process)."""
        ok = self._holds_here(caps, parts)
        return all(self._agree(ok)) if self.host_groups() is not None else ok

    def _holds_here(self, caps: dict | None, parts: list[list[dict]]) -> bool:
        if not caps:
            return False
        for ps in parts:
            try:
                plans = [self._build(p, caps) for p in ps]
            except ConfigError:
                return False
            if any(dict(p.capacities) != caps for p in plans) or self._imbalance(plans) > self.payload_band:
                return False
        return True

    def _fit_window(self, parts: list[list[dict]]) -> dict:
        """The window's joint fit, grown a bucket at a time where a batch's hosts are out of balance."""
        if self.host_groups() is not None:
            return self._fit_groups(parts)
        flat = [p for ps in parts for p in ps]
        caps = routing.fit_capacities(flat, self.grid, self.reductions, self.dims, self.cost_fn,
                                      order=context.balanced_order, mode=self.mode, long_short=self.long_short,
                                      first_stage_only=self.interleave, growth=self.growth,
                                      host_of=self.host_of() if self.mode == "balanced" else None)
        if self.host_of() is None or self.mode != "balanced":  # the baselines place by arrival / on stage 0
            return caps
        best = None
        for _ in range(8):  # a step whose payload no placement splits evenly (one long clip) stops it
            worst = max(self._imbalance([self._build(p, caps) for p in ps]) for ps in parts)
            if best is None or worst < best[0] - 1e-9:
                best = (worst, caps)
            if worst <= self.payload_band:
                break
            enc = self._roomier(caps)
            caps = {**enc, "route": max(dict(self._build(p, enc).capacities)["route"] for p in flat)}
        return best[1]

    def _roomier(self, caps: dict) -> dict:
        """Every encoder buffer in use one bucket larger (the route capacity left out: refitted)."""
        out = {}
        for k, v in caps.items():
            if k != "route":
                r = self.reductions[k.rsplit("_", 1)[0]]
                out[k] = routing._bucket(v + 1, r, 16, self.growth) if v else 0
        return out

    def _enc_rows(self, caps: dict) -> int:
        return sum(v for k, v in caps.items() if k != "route")

    def _reuse(self, fit: dict, parts: list[list[dict]]) -> dict:
        """The capacities the window runs with: a compiled program that holds it (every batch plans
        inside it, hosts in their payload band) with at most `reuse_slack` more encoder rows in all
        than the window's own fit, else the fit, as long as fewer than `max_programs` programs exist.
        A program is judged by its total rows, not buffer by buffer: one that splits an encoder's rows
        differently between its long and short buffers still holds a window whose own fit put them the
        other way (the placement fills whichever buffers it has), and it was the buffer-by-buffer test
        that made a run compile 8-9 programs where 3-4 did before. Past `max_programs`, the program that
        holds the window with the fewest rows, else the widest program (`_widest`: per encoder the
        largest buffer pair any window needed so far) if it holds the window, else the program that,
        grown buffer by buffer to hold the window too, has the fewest rows. The route capacity is kept
        on a coarse ladder (`route_growth`): it pads no compute."""
        if "route" in fit:  # the all-to-all's capacity on a coarse ladder: it pads no compute, and windows
            # whose encoder buffers agree then share a program instead of differing by a few routed tokens
            fit = {**fit, "route": routing._bucket(fit["route"], 1, 8, self.route_growth)}
        if fit in self.programs:
            return dict(fit)
        budget = self._enc_rows(fit) * (1.0 + self.reuse_slack)
        full = len(self.programs) >= self.max_programs
        for caps in sorted(self.programs, key=lambda c: (self._enc_rows(c), sorted(c.items()))):
            if (full or self._enc_rows(caps) <= budget) and self._holds(caps, parts):
                return dict(caps)
        if not full:
            return fit
        wide = self._widest(fit)
        if wide not in self.programs and self._holds(wide, parts):
            return wide
        best = None
        for base in self.programs:  # each program grown to the fit, buffer by buffer: the smallest that holds
            grown = self._grown(base, fit, parts)
            if grown is not None and (best is None or self._enc_rows(grown) < self._enc_rows(best)):
                best = grown
        return fit if best is None else best

    def _widest(self, fit: dict) -> dict:
        """Per encoder the (long, short) pair with the most rows among the programs and the fit, the
        largest route: one program that holds what every window so far needed, encoder by encoder."""
        known = [fit, *self.programs]
        out: dict[str, int] = {"route": max(c["route"] for c in known if "route" in c)} if "route" in fit else {}
        for name in self.reductions:
            keys = (f"{name}_long", f"{name}_short")
            pair = max(([c.get(k, 0) for k in keys] for c in known), key=lambda p: (sum(p), p))
            out.update({k: v for k, v in zip(keys, pair) if any(k in c for c in known)})
        return out

    def _grown(self, base: dict, fit: dict, parts: list[list[dict]]) -> dict | None:
        """`base` grown (buffer by buffer, route refitted) until it holds the window, or None."""
        grown = {k: max(v, base.get(k, 0)) for k, v in fit.items()}
        for _ in range(4):
            for p in (p for ps in parts for p in ps):
                try:
                    plan = self._build(p, grown)
                except ConfigError:  # the placement inside these pins is a heuristic: the part's own fit
                    plan = self._build(p, None)
                grown = {k: max(v, grown.get(k, 0)) for k, v in plan.capacities}
            grown = self._agree_max(grown)  # per host group: the same on every process
            if self._holds(grown, parts):
                return grown
        return None

    reserve = size_window  # the trainer's prefetcher reserves a data-plane window ahead with it

    def put_batch(self, host_batch: dict) -> dict:
        """LLM arrays in the LLM layout; encoder buffers and routing tables one row per device.

        `host_batch` is the whole global batch, the same on every host, or (from the data plane) this
        host's own LLM rows plus the step's geometry from metadata (`rows`, `row_docs`, encoder
        segments as `Runs`): the plan's routing tables index global LLM rows and every device's encoder
        buffer, so each host plans the whole step (deterministically, identically) and then builds and
        places only the blocks its own devices hold, by global index (any device order). With `balance_rows`, packed rows are first spread over the
        batch shards by LLM cost (independently of where their encoder work runs)."""
        lazy = [v for k, v in host_batch.items() if k.endswith("_inputs") and isinstance(v, LazyRows)]
        if (lazy or global_layout(host_batch)) and self.balance_rows:
            raise ConfigError("a batch laid out from metadata (lazy encoder payloads, rows read per host) cannot "
                              "have its rows moved again: build the Multiplexer with balance_rows=False (the data "
                              "plane balanced its rows already)")
        host_batch, plan = self.host_plan(host_batch)
        if lazy:  # what this host decoded for the step vs what a host that decoded everything would
            decoded, step = payload_bytes(host_batch)  # the step's from its totals where rows are laid out per host
            plan.stats["payload_bytes_decoded"], plan.stats["payload_bytes_step"] = float(decoded), float(step)
        self.last_plan = plan
        out = self._put_rows(host_batch)
        sharding = NamedSharding(self.mesh, P(ALL))
        D = self.grid.num_devices
        rows = np.arange(D) if plan.devices is None else np.asarray(plan.devices)
        for k, v in plan.arrays.items():  # this host's devices' rows only
            out[k] = hosts.put_host_rows(sharding, v, rows, (D, *v.shape[1:]))
        return out

    def _put_rows(self, host_batch: dict) -> dict:
        """The LLM arrays placed: a whole batch by taking this host's rows, a host batch of its own rows
        (`rows`: their global indices, laid out by the data plane) as they are."""
        llm = {k: host_batch[k] for k in LLM_KEYS if k in host_batch}
        rows, B = local_rows(host_batch), step_rows(host_batch)
        if rows is None or len(rows) == B:
            return self.engine.put_global_batch(llm)
        want = self.host_rows(B)
        if not np.array_equal(rows, want):
            raise ConfigError(f"this host's batch holds global rows {rows[:4].tolist()}... but its devices hold rows "
                              f"{want[:4].tolist()}... of the {B}-row step: build the loader with the ranks of the "
                              "rows Multiplexer.host_rows names (data.loader.Loader(text_ranks=...))")
        return self.engine.put_batch(llm, global_rows=B)

    def metrics(self) -> dict[str, float]:
        """The last step's plan figures for the trainer's log (imbalance, padding, long segments)."""
        if self.last_plan is None:
            return {}
        keys = ("enc_cost_max_over_mean", "llm_cost_max_over_mean", "padded_fraction", "long_segments",
                "payload_bytes_decoded", "payload_bytes_step")
        return {k: float(self.last_plan.stats[k]) for k in keys if k in self.last_plan.stats}

    # --------------------------------------------------------------------------- the step
    def _encode_local(self, part: EncoderPart, arrays: dict) -> jax.Array:
        """This device's projected encoder outputs [M, D_llm] (short then long, per encoder) + a zero pad row,
        in the compute dtype (the projectors' parameters': bf16 under trainer.compute_dtype=bfloat16)."""
        outs = []
        dts = [compute_dtype(p.fc2.kernel) for p in part.projectors.values()]
        dt = jnp.result_type(*dts) if dts else jnp.dtype(jnp.float32)
        for name in sorted(self.reductions):
            if f"{name}_short_inputs" not in arrays:
                continue
            enc, proj = part.encoders[name], part.projectors[name]
            r = self.reductions[name]
            for kind in ("short", "long"):
                x = arrays[f"{name}_{kind}_inputs"]
                if x.shape[0] == 0:
                    continue
                seg, pos = arrays[f"{name}_{kind}_segment_ids"], arrays[f"{name}_{kind}_positions"]
                run = lambda x=x, seg=seg, pos=pos, kind=kind: self._run_encoder(enc, proj, x, seg, pos, kind)
                has_work = jnp.any(seg > 0)
                if kind == "long":  # every device must take the same branch (collectives inside): XLA:CPU meets
                    # all local devices at each collective, whatever its groups, so one esp group's extra
                    # collective (e.g. a Whisper stem's halo exchange) would wait forever for the others
                    has_work = jax.lax.psum(has_work.astype(jnp.int32), ALL) > 0
                width = self.engine.model_cfg.embed_dim
                outs.append(jax.lax.cond(has_work, lambda run=run: run().astype(dt),
                                         lambda: jnp.zeros((x.shape[0] // r, width), dt)))
        width = self.engine.model_cfg.embed_dim
        outs.append(jnp.zeros((1, width), dt))
        return jnp.concatenate(outs, axis=0)

    def _run_encoder(self, enc, proj, x, seg, pos, kind: Literal["short", "long"]) -> jax.Array:
        """One buffer through its encoder (blocks rematerialised as `parallel.remat` says) and projector."""
        with remat_lib.use_remat(self.engine.remat):
            if kind == "long":  # segments split over the esp group: attention and segment reductions span it
                with attention_lib.use_attention(ulysses_attention(self.esp_axes)), sequence.use_sequence_group(self.esp_axes):
                    h = enc(x, seg, pos)
            else:
                h = enc(x, seg, pos)
        return proj(h)

    def _encode_and_route(self, part: EncoderPart, x: jax.Array, local: dict) -> jax.Array:
        """Per device (inside shard_map): encode this device's buffers, send every output token to the
        devices that hold its LLM position, and write what arrives into the local block of `x`."""
        out = self._encode_local(part, local).astype(x.dtype)
        sent = out[local["route_send"]]                              # [D, C, D_llm]
        got = jax.lax.all_to_all(sent, ALL, 0, 0, tiled=True)        # [D, C, D_llm], row = source
        b, l, d = x.shape
        flat = x.reshape(b * l, d).at[local["route_recv"].reshape(-1)].set(got.reshape(-1, d), mode="drop")
        return flat.reshape(b, l, d)

    @staticmethod
    def _plan_arrays(batch: dict) -> dict:
        keys = [k for k in batch if k.endswith(("_inputs", "_segment_ids", "_positions")) and
                k.split("_")[1] in ("short", "long")] + ["route_send", "route_recv"]
        return {k: batch[k] for k in keys}

    def inject(self, part: EncoderPart, x: jax.Array, batch: dict) -> jax.Array:
        """Write every encoder output token into its LLM position of `x` [B, L, D] (LLM layout)."""
        graphdef, state = nnx.split(part)
        x_spec = self.engine.activation("batch", "seq", "embed").spec

        def body(state, x, arrays):
            return self._encode_and_route(nnx.merge(graphdef, state), x, {k: v[0] for k, v in arrays.items()})

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), x_spec, P(ALL)), out_specs=x_spec, check_vma=False)
        return fn(state, x, self._plan_arrays(batch))

    def feed(self, part: EncoderPart, batch: dict) -> tuple:
        """The pipeline's `feed` (see `pipeline.spmd_pipeline`): encode and route microbatch m inside
        the pipeline loop, over every device (a shard_map over the non-pipeline axes nested in the
        pipeline's, so the all-to-all still spans all devices)."""
        graphdef, state = nnx.split(part)
        rest = tuple(a for a in ALL if a != "pp")
        spec = self.engine.activation("batch", "seq", "embed").spec
        x_spec = P(*(tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a != "pp") or None
                     if e is not None else None for e in spec))

        def fn(ops, x, m):
            state, arrays = ops

            def body(state, like, arrays, m):
                local = {k: jax.lax.dynamic_index_in_dim(v[0], m, 0, keepdims=False) for k, v in arrays.items()}
                vals = self._encode_and_route(nnx.merge(graphdef, state), jnp.zeros_like(like), local)
                b, l = like.shape[:2]
                hit = jnp.zeros((b * l,), bool).at[local["route_recv"].reshape(-1)].set(True, mode="drop")
                return vals, hit.reshape(b, l)

            inner = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(P(), x_spec, P(rest), P()),
                                  out_specs=(x_spec, P(*x_spec[:2])), axis_names=set(rest), check_vma=False)
            vals, hit = inner(state, jax.lax.stop_gradient(x), arrays, m)
            # merged outside the nested shard_map: the text embeddings' gradient is a plain `where`
            # (zero where an encoder token took the position), with `x`'s per-stage typing intact
            return jnp.where(hit[..., None], vals, x)

        arrays = self._plan_arrays(batch)
        specs = (jax.tree.map(lambda _: P(), state), {k: P("pp") for k in arrays})
        return fn, (state, arrays), specs

    def loss_fn(self, model: MultiplexedModel, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
        h, aux = self.hidden_states(model, batch)
        loss_sum, count = head_cross_entropy(model.llm, h, batch["targets"], batch["loss_mask"])
        return loss_sum, count, aux

    def hidden_states(self, model: MultiplexedModel, batch: dict) -> tuple[jax.Array, dict]:
        """The LLM's final hidden states [B, L, D] (before the head) with every encoder output routed in,
        and the aux losses: what an objective other than next-token CE (DPO) puts its own head on."""
        vocab = self.engine.model_cfg.vocab_size  # placeholder ids beyond a pretrained vocabulary: never looked up
        tokens = jnp.where((batch["tokens"] >= 0) & (batch["tokens"] < vocab), batch["tokens"], 0)
        x = self.engine.embed(model.llm, tokens)  # ids and rows move, never the table
        x = self.engine.constrain(x, "batch", "seq", "embed")
        part = EncoderPart(model.encoders, model.projectors)
        if self.interleave:
            h, aux = self.engine.forward_embeddings(model.llm, x, batch["segment_ids"], batch["positions"],
                                                    feed=self.feed(part, batch), head=False,
                                                    rope=batch.get("rope_positions"))
        else:
            x = self.inject(part, x, batch)
            h, aux = self.engine.forward_embeddings(model.llm, x, batch["segment_ids"], batch["positions"], head=False,
                                                    rope=batch.get("rope_positions"))
        return h, aux
