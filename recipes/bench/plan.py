"""The loader's own planner at real batch sizes: seconds per step per host and memory, from metadata.

What is timed is `omnijax.data.loader.Loader.window_plan` (the layout-free selection of each step's
samples, the spread over the dp ranks, the step layouts) exactly as training runs it, on a source of
metadata only: samples drawn from `bench scale`'s distributions (`omnijax.perfmodel.scale`: images
224-896 px, clips 2-60 s, speech 1-30 s, text to 4k tokens) under its image / video / audio_text mixes,
shaped for `omni_8b`'s encoders (SigLIP/14 with a 2x2 merge, Whisper-style audio). A global batch is
`rows_per_device` rows of `row_len` tokens per device (2 x 4k, as `bench scale`), one dp rank per
device as the trainer's data plane has. A host (`devices_per_host` devices) plans only the planning
groups (`omnijax.data.groups`, `plan_rows` rows each) its own ranks hold (`Loader(plan_local=True)`):
rows `loader_plan_host` for the first and the last host of each size, with `plan_s_per_step` (wall
time, mean over the timed windows, the first one's start-up included), `plan_cpu_s_per_step` (the
process's CPU time over the same: what the plan costs a host's core, whatever else shares the machine;
the growth row compares it), `plan_peak_mb` (the peak of Python's
allocations while planning a window) and the samples and items it planned; `whole_up_to=N` adds, up
to N devices, the whole step's plan (every group, as a host without `plan_local` does) and the whole
step as one group (the loader's plan before planning groups, what every host did), side by side. Then
the growth from the smallest to the largest size. Nothing is decoded; no device is used.

Rows `trainer_plan_host` (`trainer=1`, the default): the whole-geometry multi-host data path on host 0, what
`data_plane.open_plane` builds with several processes where the placement does not route per host group
(interleaved encoders; every multi-process run before issue 47): its own groups planned, every host's part merged
(`Loader.merge`; the other hosts' parts are host 0's moved to their ranks and groups, `_tiled_parts`, so no
host but one is planned here), each step's host batch laid out (the whole step's geometry from metadata, its
own token rows read), CPU s per step of each part, and (`memory=1`) the peak of Python's allocations
while a window is planned and laid out again. With `route_up_to=N`, up to N devices, also the step's
routing plan on that geometry (`routing.build_plan`, what `Multiplexer.plan` runs; a fsdp x ep4 grid with
esp4 groups): the capacity search a window's sizing runs, and one step inside the found capacities.

Rows `trainer_local_host` (`local=1`, the default; issue 47): the per-host path (`local_row`), what
`data_plane.open_plane` builds with several processes by default (the placement routes per host group): host 0's own
groups, parts that carry no samples and their merge (`Loader(layout_local=True)`, the keeper's merge apart, and the
keeper's state serialized once against the prefetcher's per-batch `lazy_state`),
its own rows laid out, its host group's window sizing and routing plans (`Multiplexer(route_local=...)`,
planning only its own group), with `host_ranks` (the data plane's spread of encoder cost over hosts) unless
`host_ranks=0`; up to `balance_up_to` devices also the encoder max/mean over every device with every group
planned against one global plan of the same step. Then `trainer_local_growth`: 1,024 -> 16,384 devices.
"""
from __future__ import annotations

import math
import time
from typing import Iterator

import numpy as np

DESCRIPTION = "loader planner at 1k-16k devices (2 rows of 4k tokens each): seconds per step per host, memory"


def _options(overrides: list[str]) -> dict:
    from recipes.bench.scale import _options as scale_options

    at_scale = scale_options([])  # the devices and mixes of `bench scale`, planned here by the loader itself
    opts = {"devices": at_scale["devices"], "mixes": at_scale["mixes"], "rows_per_device": 2, "row_len": 4096,
            "window": 4, "windows": 1, "samples_per_row": 4, "seed": 0, "devices_per_host": 8, "plan_rows": 0,
            "whole_up_to": 0, "trainer": 1, "route_up_to": 0, "memory": 1, "local": 1, "balance_up_to": 1024,
            "host_ranks": 1}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.removeprefix("bench.")
        if key not in opts:
            from omnijax.errors import ConfigError

            raise ConfigError(f"bench plan: unknown option '{key}'; known: {', '.join(opts)}")
        opts[key] = type(opts[key])(value)
    return opts


class MetaSource:
    """Metadata of a synthetic source (a mix phase of `bench scale`'s distributions): `size` records drawn
    once at construction (outside the timed planning; a real source reads them from its shards'
    sidecars), so `meta` is a lookup; `get` is never needed."""

    CHUNK = 4096

    def __init__(self, name: str, shares: dict[str, float], seed: int, row_len: int, size: int = 32768):
        self.name, self.shares, self.seed, self.row_len = name, shares, seed, row_len
        self.metadata_in_memory = False
        self._metas = [m for c in range(-(-size // self.CHUNK)) for m in self._draw(c)][:size]

    def __len__(self) -> int:
        return len(self._metas)

    def meta(self, index: int):
        return self._metas[index]

    def _draw(self, chunk: int) -> list:
        """One chunk of records: a modality per record by the phase's shares, then `bench scale`'s own
        distributions (`perfmodel.scale.media_draws`) as the record's metadata: pixels, frames, samples."""
        from omnijax.data.sample import SampleMeta, SegmentMeta
        from omnijax.perfmodel.scale import PATCH, VIDEO_FPS, media_draws

        rng = np.random.default_rng([self.seed, chunk])
        n = self.CHUNK
        mods = list(self.shares)
        p = np.array([self.shares[m] for m in mods], np.float64)
        kind = rng.choice(len(mods), n, p=p / p.sum())
        drawn = {m: media_draws(m, int((kind == k).sum()), rng, self.row_len) for k, m in enumerate(mods)}
        nth = {m: 0 for m in mods}
        out = []
        for i in range(n):
            mod = mods[kind[i]]
            d, j = drawn[mod], nth[mod]
            nth[mod] += 1
            t = int(d["text"][j])
            if mod == "image":
                seg = SegmentMeta("image", (int(d["h"][j]), int(d["w"][j]), 3))
            elif mod == "video":  # whole 2-frame tubes, as many as fit one LLM row beside the text
                side = int(d["side"][j]) // (2 * PATCH) * 2 * PATCH
                per = (side // (2 * PATCH)) ** 2      # LLM tokens per tube after the 2x2 merge
                frames = min(2 * math.ceil(d["seconds"][j] * VIDEO_FPS / 2), 2 * max(1, (self.row_len - t) // per))
                seg = SegmentMeta("video", (frames, side, side, 3))
            elif mod == "audio":
                seg = SegmentMeta("audio", (int(d["seconds"][j] * 16000),))
            else:
                seg = None
            text = SegmentMeta("text", (t,), loss=True)
            out.append(SampleMeta((text,) if seg is None else (seg, text), self.name, chunk * n + i))
        return out

    def text(self, index: int) -> dict[int, np.ndarray]:
        """Token ids of the record's text segments (zeros): what a host reads for its own rows."""
        return {k: np.zeros(seg.length, np.int32) for k, seg in enumerate(self._metas[index].segments)
                if seg.modality == "text"}

    def get(self, index: int):  # pragma: no cover - planning never reads payloads
        raise NotImplementedError("bench plan's source holds metadata only")


def _mm_config():
    from omnijax.config import build
    from recipes.common import CONFIGS
    from omnijax.train.multimodal import MultimodalConfig as OmniConfig, check

    return build(OmniConfig, CONFIGS / "omni_8b.yaml", [], check=check).model


def _sources(mix_name: str, opts: dict) -> list[MetaSource]:
    from omnijax.perfmodel.scale import MIXES

    mix = MIXES[mix_name]
    return [MetaSource(f"{mix_name}{k}", mix.phases[k], opts["seed"] + k, opts["row_len"]) for k in range(len(mix.phases))]


def _loader(devices: int, sources: list[MetaSource], opts: dict, mm_cfg, host: int | None, one_group: bool = False):
    """The trainer's data plane (one dp rank per device, fixed shapes) for `devices`; `host`: the loader
    of that host's ranks planning only its own groups (None: the whole step, every group). `one_group`:
    the whole step as one planning group, the loader's plan before planning groups."""
    from omnijax.data.loader import Loader, LoaderConfig
    from omnijax.data.sources import SourceSpec

    W, names = opts["window"], [s.name for s in sources]
    rows = devices * opts["rows_per_device"]
    schedule = [{"step": k * W, "weights": {n: float(j == k) for j, n in enumerate(names)}} for k in range(len(names))]
    cfg = LoaderConfig(sources=[SourceSpec(name=n, kind="world") for n in names], mix=schedule, seed=opts["seed"],
                       samples_per_step=opts["samples_per_row"] * rows, dp=devices, microbatches=1, window=W,
                       row_len=opts["row_len"], max_rows=opts["rows_per_device"], fixed_shapes=True,
                       plan_rows=rows if one_group else opts["plan_rows"])
    per = opts["devices_per_host"]
    ranks = None if host is None else list(range(host * per, (host + 1) * per))
    return Loader(cfg, mm_cfg=mm_cfg, sources=sources, ranks=ranks, plan_local=host is not None)


def plan_row(devices: int, mix_name: str, opts: dict, mm_cfg, sources: list[MetaSource],
             host: int | None, one_group: bool = False) -> dict:
    """Time one host's window plans (`host`; None: the whole step's) for one global batch size and mix,
    then its memory: the peak of Python's allocations while planning the first window again, afresh."""
    import tracemalloc

    loader = _loader(devices, sources, opts, mm_cfg, host, one_group)
    W = opts["window"]
    t0, c0 = time.perf_counter(), time.process_time()
    samples = items = 0
    for w in range(opts["windows"]):
        wp = loader.window_plan(w)
        samples += sum(len(b) for b in wp.plan.bins)
        items += len(wp.items)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = opts["windows"] * W
    loader = _loader(devices, sources, opts, mm_cfg, host, one_group)
    tracemalloc.start()
    wp = loader.window_plan(0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    variant = "loader_plan_host" if host is not None else "loader_plan_one_group" if one_group else "loader_plan_step"
    return {"variant": variant, "devices": devices,
            "mix": mix_name, "global_rows": devices * opts["rows_per_device"], "row_len": opts["row_len"],
            "window": W, "steps": steps, "host": host, "plan_groups": len(wp.groups),
            "groups_per_step": loader.groups.count, "group_rows": loader.groups.rows,
            "plan_s_per_step": round(secs / steps, 3), "plan_cpu_s_per_step": round(cpu / steps, 3),
            "samples_per_step": round(samples / steps, 1),
            "items_per_window": round(items / opts["windows"], 1), "plan_peak_mb": round(peak / 2**20, 1),
            "plans_on": (f"host {host} of {devices // opts['devices_per_host']}: its own groups" if host is not None
                         else "every host, the whole step as one group (before planning groups)" if one_group
                         else "the whole step (every group)")}


def _tiled_parts(loader, host: int, hosts: int, per: int, local: bool = False):
    """exchange(window, part) for `loader` (host `host`): every host's part, each host's made from this
    host's own by moving its ranks and planning groups to that host's (the same samples at every host's
    rows: the sizes of a real step, parts of the real size, without planning every group here). `local`:
    layout-local parts (a header, the groups' section, the ranks' totals: nothing in the body to move).
    The tiling itself is bench scaffolding: `exchange.start_s` / `exchange.parts_s` bracket it, so the
    callers time the host's own work before it and the merge after it."""
    import json

    G, M = loader.groups, loader.cfg.microbatches

    def exchange(window: int, part: bytes) -> list[bytes]:
        exchange.start_s = time.process_time()  # noqa: B023 - the host's own part is done
        n = int.from_bytes(part[:8], "little")
        head = json.loads(part[8:8 + n])
        if local:
            m = int.from_bytes(part[8 + n:16 + n], "little")
            own_groups, body = json.loads(part[16 + n:16 + n + m]), np.frombuffer(part[16 + n + m:], np.int64)
        else:
            own_groups, body = head["groups"], np.frombuffer(part[8 + n:], np.int64).reshape(-1, 5)
        out = []
        for h in range(hosts):
            shift = (h - host) * per
            ranks = [r + shift for r in head["ranks"]]
            groups = G.of_ranks(ranks)  # a group's next start comes from the host of its first rank only
            moved = [[j, *g[1:]] for j, g in zip(groups, own_groups) if G.ranks(j)[0] in ranks]
            b = body.copy()
            if local:
                h_head = json.dumps({**head, "ranks": ranks}, separators=(",", ":")).encode()
                sect = json.dumps(moved, separators=(",", ":")).encode()
                out.append(len(h_head).to_bytes(8, "little") + h_head + len(sect).to_bytes(8, "little") + sect
                           + b.tobytes())
                continue
            b[:, 0] += shift * M
            h_head = json.dumps({**head, "ranks": ranks, "groups": moved}, separators=(",", ":")).encode()
            out.append(len(h_head).to_bytes(8, "little") + h_head + b.tobytes())
        exchange.parts_s = time.process_time()  # noqa: B023 - when the parts were in: the merge starts
        return out

    return exchange


def trainer_row(devices: int, mix_name: str, opts: dict, mm_cfg, sources: list[MetaSource], host: int,
                route: bool = False) -> dict:
    """The trainer's multi-host data path for one host (`data_plane.open_plane` with several processes): its
    own groups planned (`plan_local`), every host's part merged (`Loader.merge`), then each step's host batch
    (the whole step's geometry from metadata, its own token rows): CPU s per step of each part. `route`: also
    the step's routing plan from that geometry (`routing.build_plan`, what `Multiplexer.plan` runs) on a
    fsdp x ep4 grid with esp4 groups: once choosing capacities (a window's sizing runs this search) and once
    inside them (a step of a sized window), no payload decoded."""
    from dataclasses import replace

    from omnijax.data.loader import Loader

    per = opts["devices_per_host"]
    base = _loader(devices, sources, opts, mm_cfg, None)
    own = list(range(host * per, (host + 1) * per))
    exchange = _tiled_parts(base, host, devices // per, per)
    loader = Loader(base.cfg, mm_cfg=mm_cfg, sources=sources, lazy_media=True, text_ranks=own, plan_local=True,
                    exchange=lambda w, part: exchange(w, part))
    merge = loader.merge
    loader.merge = lambda wp, parts: merge(replace(wp, entries=(), metas=()), parts)  # every sample's metadata read
    W = opts["window"]
    c0 = time.process_time()
    loader.window_plan(0)
    c1 = time.process_time()
    local_s, merge_s = exchange.parts_s - c0, c1 - exchange.parts_s
    batches = [loader.host_batch(g)["microbatches"][0] for g in range(W)]
    geometry_s = time.process_time() - c1
    wp = loader.window_plan(0)
    peak = None
    if opts["memory"]:  # the peak of Python's allocations over a window planned and laid out again, afresh
        import tracemalloc

        again = Loader(base.cfg, mm_cfg=mm_cfg, sources=sources, lazy_media=True, text_ranks=own, plan_local=True,
                       exchange=lambda w, part: exchange(w, part))
        tracemalloc.start()
        [again.host_batch(g) for g in range(W)]
        peak = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        tracemalloc.stop()
    row = {"variant": "trainer_plan_host", "devices": devices, "mix": mix_name, "host": host,
           "hosts": devices // per, "global_rows": devices * opts["rows_per_device"],
           "samples_per_step": round(sum(len(b) for b in wp.plan.bins) / W, 1),
           "own_groups_cpu_s_per_step": round(local_s / W, 3), "merge_cpu_s_per_step": round(merge_s / W, 3),
           "geometry_cpu_s_per_step": round(geometry_s / W, 3),
           "cpu_s_per_step": round((local_s + merge_s + geometry_s) / W, 3),
           "parts_mb_per_window": round(sum(len(p) for p in exchange(0, loader.own_part(wp))) / 2**20, 2),
           "peak_mb": peak}
    if route:
        from omnijax.data import packing
        from omnijax.data.cost import CostModel
        from omnijax.parallel import context, routing

        specs = packing.encoder_specs(mm_cfg)
        red, dims = {n: s.group for n, s in specs.items()}, {n: s.dim for n, s in specs.items()}
        flops = CostModel.from_flops(mm_cfg)
        cost = lambda n, rows: float(flops.encoders[n](rows // red[n] if n == "audio" else rows))  # noqa: E731
        grid = routing.DeviceGrid((1, 1, devices // 4, 4, 1, 1), 4)
        kw = dict(order=context.balanced_order, fill_devices=(), host_of=np.arange(devices) // per)
        c0 = time.process_time()
        plan = routing.build_plan(batches[0], grid, red, dims, cost, **kw)
        c1 = time.process_time()
        routing.build_plan(batches[0], grid, red, dims, cost, capacities=dict(plan.capacities), **kw)
        c2 = time.process_time()
        row.update({"route_plan_search_cpu_s": round(c1 - c0, 3), "route_plan_cpu_s": round(c2 - c1, 3),
                    "route_segments": sum(len(batches[0][f"{n}_segment_ids"].starts) for n in red
                                          if f"{n}_segment_ids" in batches[0])})
    return row


def _planner(mm_cfg, devices: int, per: int, own_host: int | None, route_local: bool = True):
    """The planning half of the trainer's `Multiplexer` on a fsdp x ep4 grid with esp4 groups (hosts of `per`
    devices, contiguous): routing per host group (`route_local`), planning only `own_host`'s group (None:
    every group), capacities agreed through an exchange that hands back this host's need once per host
    (the other hosts' needs are its own: the max is what a real exchange of a few ints per host costs)."""
    from omnijax.data import packing
    from omnijax.data.cost import CostModel
    from omnijax.parallel import routing
    from omnijax.parallel.multiplex import Multiplexer

    specs = packing.encoder_specs(mm_cfg)
    flops = CostModel.from_flops(mm_cfg)
    mx = Multiplexer.__new__(Multiplexer)  # no mesh or model: the host side the trainer runs
    mx.grid = routing.DeviceGrid((1, 1, devices // 4, 4, 1, 1), 4)
    mx.reductions, mx.dims = {n: s.group for n, s in specs.items()}, {n: s.dim for n, s in specs.items()}
    red = mx.reductions
    mx.cost_fn = lambda n, rows: float(flops.encoders[n](rows // red[n] if n == "audio" else rows))
    mx.mode, mx.long_short, mx.capacities, mx.interleave, mx.balance_rows = "balanced", True, None, False, False
    mx.hosts, mx.programs, mx.route_local, mx.own_host = devices // per, [], route_local, own_host
    hosts = devices // per
    mx.exchange = lambda r, b: [b] * hosts
    return mx


def local_row(devices: int, mix_name: str, opts: dict, mm_cfg, sources: list[MetaSource], host: int,
              balance: bool = False) -> dict:
    """The per-host path (issue 47) for one host, the functions the trainer calls: its own planning groups
    (`Loader(plan_local=True, layout_local=True)`), the exchange of parts that carry no samples and their
    merge (`Loader._merge_local`: every group's next start, the layouts, per-rank totals), its own rows laid
    out (`host_batch`: its rows and their segments only), the window's capacities for its host group
    (`Multiplexer.size_window` with `route_local`: the group's own fit, maxima agreed through the exchange)
    and each step's routing plan for its group (`Multiplexer.plan(fill=False)`: placement and routing
    tables; no payload decoded, no buffer built, as `bench plan` decodes nothing anywhere). CPU s per step
    of each part; memory the peak of Python's allocations over a fresh window of all of it. `balance`: also
    the encoder cost max/mean over every device when every host group plans its own rows (all groups
    simulated here, the whole step laid out) beside the one global plan's, on the same step."""
    from omnijax.data.loader import Loader

    from dataclasses import replace

    per, W = opts["devices_per_host"], opts["window"]
    base = _loader(devices, sources, opts, mm_cfg, None)
    if opts["host_ranks"]:  # as data_plane.open_plane sets it with several processes: encoder cost over hosts first
        base = Loader(replace(base.cfg, host_ranks=per), mm_cfg=mm_cfg, sources=sources)
    own = list(range(host * per, (host + 1) * per))
    exchange = _tiled_parts(base, host, devices // per, per, local=True)

    def make():
        lo = Loader(base.cfg, mm_cfg=mm_cfg, sources=sources, lazy_media=True, text_ranks=own, plan_local=True,
                    exchange=lambda w, part: exchange(w, part), layout_local=True, keep_state=False)
        return lo, _planner(mm_cfg, devices, per, host)

    loader, mx = make()
    t0 = time.process_time()
    mx.host_groups()  # once per run: the job's host groups and their sub-grids
    setup_s = time.process_time() - t0
    c0 = time.process_time()
    loader.window_plan(0)
    c1 = time.process_time()
    batches = [loader.host_batch(g)["microbatches"][0] for g in range(W)]
    c2 = time.process_time()
    mx.size_window(batches)
    c3 = time.process_time()
    plans = [mx.plan(b, fill=False) for b in batches]
    c4 = time.process_time()
    own_s, merge_s = exchange.start_s - c0, c1 - exchange.parts_s
    total = own_s + merge_s + (c4 - c1)  # the tiling of the other hosts' parts (bench scaffolding) left out
    wp = loader.window_plan(0)
    # process 0 keeps the state: it alone parses every group's next start (timed on the same parts)
    parts = exchange(0, loader.own_part(wp))
    loader.keep_state = True
    k0 = time.process_time()
    kept = loader.merge(wp, parts)
    keeper_s = time.process_time() - k0
    loader.keep_state = False
    # its state holds every group's next start: serialized per batch (`state()`, what the prefetcher took
    # before) against the position the prefetcher now takes per batch (`lazy_state`), read only when saved
    k0 = time.process_time()
    [s.to_state() for s in kept.next_start]
    state_s = time.process_time() - k0
    k0 = time.process_time()
    for _ in range(W):
        loader.lazy_state()
    lazy_s = (time.process_time() - k0) / W
    row = {"variant": "trainer_local_host", "devices": devices, "mix": mix_name, "host": host,
           "hosts": devices // per, "global_rows": devices * opts["rows_per_device"],
           "own_samples_per_step": round(sum(len(wp.plan.bins[g * base.cfg.dp + r]) for g in range(W) for r in own) / W, 1),
           "group_segments_per_step": round(sum(p.stats["segments"] for p in plans) / W, 1),
           "own_groups_cpu_s_per_step": round(own_s / W, 3), "merge_cpu_s_per_step": round(merge_s / W, 3),
           "keeper_merge_cpu_s_per_step": round(keeper_s / W, 3), "keeper_state_cpu_s": round(state_s, 4),
           "lazy_state_cpu_s": round(lazy_s, 6), "layout_cpu_s_per_step": round((c2 - c1) / W, 3), "size_window_cpu_s_per_step": round((c3 - c2) / W, 3),
           "route_cpu_s_per_step": round((c4 - c3) / W, 3), "cpu_s_per_step": round(total / W, 3),
           "host_groups_setup_cpu_s": round(setup_s, 3),
           "parts_mb_per_window": round(sum(len(p) for p in parts) / 2**20, 3),
           "capacities": dict(mx.capacities), "peak_mb": None}
    if opts["memory"]:
        import tracemalloc

        loader, mx = make()
        mx.host_groups()
        tracemalloc.start()
        loader.window_plan(0)
        bs = [loader.host_batch(g)["microbatches"][0] for g in range(W)]
        mx.size_window(bs)
        [mx.plan(b, fill=False) for b in bs]
        row["peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        tracemalloc.stop()
    if balance:
        from omnijax.parallel import routing
        from omnijax.parallel.context import balanced_order

        whole = Loader(base.cfg, mm_cfg=mm_cfg, sources=sources, lazy_media=True, text_ranks=own)
        batch = whole.host_batch(0)["microbatches"][0]
        groups = _planner(mm_cfg, devices, per, None)
        grouped = groups.plan(batch, fill=False)
        if opts["host_ranks"]:  # the same step spread over the ranks without host_ranks: the groups' balance before
            plain = Loader(replace(base.cfg, host_ranks=0), mm_cfg=mm_cfg, sources=sources, lazy_media=True,
                           text_ranks=own)
            before = _planner(mm_cfg, devices, per, None).plan(plain.host_batch(0)["microbatches"][0], fill=False)
            row["enc_max_over_mean_groups_plain_spread"] = round(before.stats["enc_cost_max_over_mean"], 3)
        one = _planner(mm_cfg, devices, per, None, route_local=False)
        c0 = time.process_time()
        glob = routing.build_plan(batch, one.grid, one.reductions, one.dims, one.cost_fn,
                                  order=balanced_order,
                                  capacities=dict(groups.capacities), fill_devices=(), host_of=one.host_of())
        row.update({"enc_max_over_mean_groups": round(grouped.stats["enc_cost_max_over_mean"], 3),
                    "enc_max_over_mean_worst_group": round(grouped.stats["enc_cost_max_over_mean_in_group"], 3),
                    "enc_max_over_mean_global": round(glob.stats["enc_cost_max_over_mean"], 3),
                    "padded_fraction_groups": round(grouped.stats["padded_fraction"], 4),
                    "padded_fraction_global": round(glob.stats["padded_fraction"], 4),
                    "global_plan_cpu_s": round(time.process_time() - c0, 3)})
    return row


def run(overrides: list[str]) -> Iterator[dict]:
    opts = _options(overrides)
    mm_cfg = _mm_config()
    rows, local_rows = [], []
    for mix in [m for m in opts["mixes"].split(",") if m]:
        sources = _sources(mix, opts)
        for devices in [int(d) for d in opts["devices"].split(",") if d]:
            hosts = devices // opts["devices_per_host"]
            for host in sorted({0, hosts - 1}):
                row = plan_row(devices, mix, opts, mm_cfg, sources, host)
                rows.append(row)
                yield row
            if opts["local"]:
                row = local_row(devices, mix, opts, mm_cfg, sources, 0, balance=devices <= opts["balance_up_to"])
                local_rows.append(row)
                yield row
            if opts["trainer"]:
                yield trainer_row(devices, mix, opts, mm_cfg, sources, 0, route=devices <= opts["route_up_to"])
            if devices <= opts["whole_up_to"]:
                yield plan_row(devices, mix, opts, mm_cfg, sources, None)
                yield plan_row(devices, mix, opts, mm_cfg, sources, None, one_group=True)
    for mix in dict.fromkeys(r["mix"] for r in rows):
        rs = sorted((r for r in rows if r["mix"] == mix), key=lambda r: (r["devices"], r["host"]))
        if rs[-1]["devices"] > rs[0]["devices"]:
            top = max(r["plan_cpu_s_per_step"] for r in rs if r["devices"] == rs[-1]["devices"])
            low = max(r["plan_cpu_s_per_step"] for r in rs if r["devices"] == rs[0]["devices"])
            mem = [max(r["plan_peak_mb"] for r in rs if r["devices"] == d) for d in (rs[-1]["devices"], rs[0]["devices"])]
            yield {"variant": "loader_plan_growth", "mix": mix, "devices": f"{rs[0]['devices']}->{rs[-1]['devices']}",
                   "plan_cpu_s_growth": round(top / max(low, 1e-9), 2),
                   "plan_mem_growth": round(mem[0] / max(mem[1], 1e-9), 2)}
    for mix in dict.fromkeys(r["mix"] for r in local_rows):
        rs = sorted((r for r in local_rows if r["mix"] == mix), key=lambda r: r["devices"])
        if rs[-1]["devices"] > rs[0]["devices"]:
            lo, hi = rs[0], rs[-1]
            yield {"variant": "trainer_local_growth", "mix": mix, "devices": f"{lo['devices']}->{hi['devices']}",
                   "cpu_s_growth": round(hi["cpu_s_per_step"] / max(lo["cpu_s_per_step"], 1e-9), 2),
                   "mem_growth": (round(hi["peak_mb"] / max(lo["peak_mb"], 1e-9), 2)
                                  if hi["peak_mb"] and lo["peak_mb"] else None)}
