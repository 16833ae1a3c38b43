"""The omnijax loader: mixing -> metadata -> grouped reordering -> payloads of this host's ranks -> packing.

Built on grain's dataset API: `MapDataset.range(step, ...)` mapped by `host_batch` (a pure function
of the step, given the config) and turned into an `IterDataset` with threaded prefetch. Per window
of G steps every host computes the same plan from metadata alone (`window_plan`), then reads and
packs only the samples of its own dp ranks. The state is (step, seed, schedule fingerprint):
resuming at a step gives the identical batches, with any number of hosts.

Nothing is lost to packing: a window's pool is its deferred samples (those the previous window's
plan had no room for, oldest first) plus fresh draws from the mixer that fill it up to
`samples_per_step * window`; what does not fit is deferred again, never dropped. So a window's plan
is a pure function of (config, seed, per-source draw counts, deferred samples) — its `WindowStart`,
which the loader state carries for exact resume — and the mix weights follow the training step.

The sample stream does not depend on the layout: a window's plan first chooses each step's samples
(and their rows) against the whole step's capacity (`dp * max_rows` rows, `encoder_rows` per encoder),
with no notion of ranks, so 1 device, 8 devices and 2 hosts x 4 train on the same samples in the same
order; only then are a step's samples spread over the dp ranks (`balance.spread_step`), which decides
where they run, never whether. A sample whose encoder rows exceed the step's capacity is not dropped:
its window plans at a larger bucket (the capacity doubled until it fits, a bounded set of programs).

Planning groups (`omnijax.data.groups`): a step of more than `LoaderConfig.plan_rows` rows (default 128) is
planned as independent groups of global rows, each with its own draws (a lane of the mixer), its own
deferred samples and its share of the step capacity; the step's samples are the union of the groups',
still the same on every layout. A host that plans only the groups its ranks hold (`plan_local`) does
work that does not grow with the number of hosts. A step of at most `plan_rows` rows is one group: the
plan described above, unchanged. With an `exchange` (the trainer's data plane on several processes) every
host sends its part of the window (`own_part`: its ranks' samples and rows, its groups' next starts) and
rebuilds the whole window from all parts (`merge`), identical on every host; the state then holds every
group's start, so one host's state resumes all of them.

Bad data: a sample whose metadata is invalid, or a sample with media that has more LLM tokens than a
row holds (it may not be split; `recipes convert` refuses such samples), is skipped at planning
(identically on every host and layout), counted in `dropped_total`, and reported once at WARNING with
the fix; an over-long text-only sample is split into row-sized pieces; a record that fails to decode
or validate is skipped by the host that reads it, counted, and logged with its source and index. A
missing shard fails at start (sources.open_sources).
"""
from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np

from omnijax.data import balance, packing
from omnijax.data.bins import Bin
from omnijax.data import tokenizer as tokenizer_mod
from omnijax.data.cost import CostModel, sample_cost
from omnijax.data.groups import Groups
from omnijax.data.mixing import Mixer, schedule_from_config
from omnijax.data.sample import BadSample, validate_meta
from omnijax.data.sources import Source, SourceSpec, open_sources
from omnijax.data.tokens import default_mm_config, modality_encoders, segment_tokens
from omnijax.errors import ConfigError, UserError

log = logging.getLogger("omnijax.data")


@dataclass
class LoaderConfig:
    sources: list[SourceSpec] = field(default_factory=lambda: [SourceSpec(name="world")])
    mix: Any = None                 # None (uniform) | {name: weight} | [{step, weights: {name: weight}}]
    seed: int = 0
    samples_per_step: int = 32      # global samples drawn per step (before drops)
    dp: int = 1                     # data-parallel ranks (TP/PP/CP peers share a rank's batch)
    microbatches: int = 1
    row_len: int = 256              # LLM tokens per row (largest bucket; a step uses the smallest that fits)
    max_rows: int = 8               # largest LLM row bucket per bin (rank x microbatch)
    max_encoder_rows: dict[str, int] = field(default_factory=dict)  # per encoder per bin; default rows*len*group
    encoder_rows: dict[str, int] = field(default_factory=dict)  # per encoder per step (all ranks); default dp x the above
    window: int = 4                 # G: global batches balanced together
    reorder: bool = True            # False: arrival order (baseline)
    fixed_shapes: bool = False      # every step at the largest buckets: one compiled training program
    plan_rows: int = 0              # rows per planning group (groups.Groups; 0: groups.PLAN_ROWS)
    host_ranks: int = 0             # ranks per host group (the multiplexer routes per group): spread by encoder cost first
    threads: int = 2                # grain prefetch threads
    prefetch: int = 2               # batches prefetched

    def check(self) -> "LoaderConfig":
        for name in ("samples_per_step", "dp", "microbatches", "row_len", "max_rows", "window", "threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name}={getattr(self, name)}: must be > 0")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch}: must be >= 0")
        if not self.sources:
            raise ConfigError("data.sources: needs at least one source")
        return self


@dataclass(frozen=True)
class Entry:
    """One planned sample (or a piece of a split one)."""
    source: int
    record: int
    piece: int = -1         # >= 0: row-sized piece of an over-long text sample
    drawn: int = 0          # step within the window the mixer drew it for


@dataclass(frozen=True)
class WindowStart:
    """What a window's plan depends on besides the config: draws of each source so far, deferred entries."""
    prefix: tuple[int, ...]
    deferred: tuple[Entry, ...] = ()

    def to_state(self) -> dict:
        return {"prefix": list(self.prefix), "deferred": [[e.source, e.record, e.piece] for e in self.deferred]}

    @classmethod
    def from_state(cls, d: dict) -> "WindowStart":
        return cls(tuple(int(x) for x in d["prefix"]), tuple(Entry(int(a), int(b), int(c)) for a, b, c in d["deferred"]))


@dataclass(frozen=True)
class WindowPlan:
    first_step: int
    entries: tuple[Entry, ...]              # by item key
    plan: balance.Plan                      # bins ordered (step in window, rank, microbatch)
    layouts: tuple[packing.Layout, ...]     # per step in window
    dropped: tuple[tuple[str, int, str], ...]  # (source, record, reason)
    split: int                              # samples split into pieces
    items: tuple[balance.Item, ...]
    start: WindowStart | None = None        # what this window began from
    deferred: tuple[Entry, ...] = ()        # entries with no room here: first in the next window
    next_prefix: tuple[int, ...] = ()       # draws of each source after this window
    metas: tuple = ()                       # SampleMeta by item key (read once, when planned)
    selection: balance.Plan | None = None   # layout-free: bins ordered (step in window, microbatch)
    encoder_rows: tuple[int, ...] = ()      # the step capacity per encoder this window planned with
    next_start: tuple = ()                  # per planning group: the WindowStart of the next window
    starts: tuple = ()                      # per planning group: this window's WindowStart (`start`: the first planned's)
    groups: tuple[int, ...] = (0,)          # the planning groups this plan holds (bins of other ranks empty)
    group_drops: tuple = ()                 # per planning group planned: (group, its dropped, its split)
    rank_docs: Any = None                   # layout_local: [window, dp, 3 + 3 x encoders] `Loader._rank_docs` per rank


class Loader:
    """Host-side loader for dp ranks `ranks` (default: all) of a `LoaderConfig`."""

    def __init__(self, cfg: LoaderConfig, mm_cfg: Any = None, ranks: list[int] | None = None,
                 cost_model: CostModel | None = None, world_cfg: Any = None, sources: list[Source] | None = None,
                 tokenizer: Any = None, lazy_media: bool = False, text_ranks: list[int] | None = None,
                 plan_local: bool = False, exchange: Callable[[int, bytes], list[bytes]] | None = None,
                 layout_local: bool = False, keep_state: bool = True):
        """lazy_media: encoder inputs come as `payload.LazyRows`, decoded only where a slice asks (the
        multiplexer slices the segments this host's devices encode), with the step's geometry as a few
        integers per segment (`packing.pack`'s step geometry). text_ranks: the ranks whose token rows
        this host reads and builds (the rows its devices hold); the other ranks' rows are laid out from
        metadata only and never built (needs lazy_media). None: every rank in `ranks`. plan_local: plan
        only the planning groups (`groups.Groups`) that hold rows of `ranks`, not the whole step: a
        host's planning then does not grow with the number of hosts (the other ranks' bins stay empty,
        and the layouts are those of the groups planned here). With `text_ranks`, the groups of those
        ranks (the host's own rows). exchange (with plan_local): `exchange(window, part) -> every host's
        part` (an all-gather of bytes, e.g. `train.data_plane.kv_exchange`); each host then plans its own
        groups and the window's plan is merged from every host's part (`merge_parts`): the whole step's
        samples, rows, layouts and next window starts, identical on every host and equal to the plan of a
        loader that plans every group.
        layout_local (with `text_ranks`): a host lays out only its own ranks' rows and their encoder
        segments (`packing.pack(sparse=True)`), not the whole step's geometry: what a multiplexer that
        routes per host group (`Multiplexer(route_local=...)`) needs, where every host of a group holds the
        same rows. With an exchange, the hosts' parts then carry only what every host must agree on (each
        group's next start, drops and splits, the step layouts, the own rows' documents, tokens and squared
        lengths per step): a merge of O(groups), no other host's samples. `row_docs` then gives the own
        rows exactly and the rest of the step's totals in the first row not held here, so sums over it
        (samples, tokens, FLOPs) stay the step's; the encoder segments are this host's own.
        keep_state (with layout_local and an exchange): read every group's next start, drops and splits from
        the parts (the checkpointed state, process 0's); False: only this host's own groups' (the others'
        sections are skipped, not parsed: every group's deferred samples are O(step) integers), so its
        `state()` is not a checkpoint and its drop counts are its own groups'."""
        self.cfg = cfg.check()
        self.lazy_media = bool(lazy_media)
        self.text_ranks = None if text_ranks is None else {int(r) for r in text_ranks}
        if self.text_ranks is not None and not self.lazy_media:
            raise ConfigError("Loader(text_ranks=...) lays rows out from metadata and needs lazy_media=True")
        self.layout_local, self.keep_state = bool(layout_local), bool(keep_state)
        if self.layout_local and (self.text_ranks is None or cfg.microbatches != 1):
            raise ConfigError("Loader(layout_local=True) lays out only the host's own rows: give text_ranks, "
                              "with data.microbatches=1 (the trainer's data plane)")
        self.tokenizer = tokenizer  # None: byte-level ids (the built-in world); else placeholders/pad/vocab from it
        self.mm_cfg = mm_cfg if mm_cfg is not None else default_mm_config()
        self.ranks = list(range(cfg.dp)) if ranks is None else sorted(int(r) for r in ranks)
        if not self.ranks or any(not 0 <= r < cfg.dp for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"loader ranks={ranks}: must be distinct dp ranks in [0, {cfg.dp})")
        self.sources = sources if sources is not None else open_sources(cfg.sources, world_cfg)  # once per host
        self.names = [s.name for s in self.sources]
        self.schedule = schedule_from_config(self.names, cfg.mix)
        self.mixer = Mixer([len(s) for s in self.sources], self.schedule, cfg.seed, cfg.samples_per_step)
        self.cost_model = cost_model or CostModel.from_flops(self.mm_cfg)
        self.specs = packing.encoder_specs(self.mm_cfg)
        self.enc_names = tuple(self.specs)
        self._doc_cols = 3 + 3 * len(self.enc_names)  # `_rank_docs` columns: documents, tokens, squares; per encoder 3
        for key in ("max_encoder_rows", "encoder_rows"):
            unknown = set(getattr(self.cfg, key)) - set(self.specs)
            if unknown:
                raise ConfigError(f"data.{key}: unknown encoder(s) {sorted(unknown)}; known: {list(self.specs)}")
        per_bin = {n: self.cfg.max_encoder_rows.get(n, cfg.max_rows * cfg.row_len * s.group)
                   for n, s in self.specs.items()}
        # the whole step's encoder rows: what a step's samples may hold, whatever the layout
        self.step_enc = {n: int(self.cfg.encoder_rows.get(n, per_bin[n] * cfg.dp)) for n in self.enc_names}
        for n, c in self.step_enc.items():
            if c <= 0:
                raise ConfigError(f"encoder rows per step for {n}={c}: must be > 0")
        # one rank's share (rounded up to whole encoder tokens): where the ranks' buffers start
        self.enc_cap = {n: -(-self.step_enc[n] // (cfg.dp * s.group)) * s.group for n, s in self.specs.items()}
        self.row_buckets = packing.buckets(cfg.max_rows)
        self.len_buckets = packing.buckets(cfg.row_len, min(16, cfg.row_len), smallest=min(64, cfg.row_len))
        self.enc_buckets = {n: packing.buckets(self.step_enc[n], self.specs[n].group,
                                               smallest=min(self.enc_cap[n], self.specs[n].group * 16))
                            for n in self.enc_names}
        self.capacity = balance.Capacity(cfg.max_rows, cfg.row_len, tuple(self.enc_cap[n] for n in self.enc_names))
        self.step_capacity = balance.Capacity(cfg.dp * cfg.max_rows, cfg.row_len,
                                              tuple(self.step_enc[n] for n in self.enc_names))
        self.groups = Groups.of(cfg.dp, cfg.max_rows, cfg.plan_rows)
        G = self.groups
        # a group's share of the step capacity (rows and encoder rows): one group is the step itself
        self.group_capacity = self.step_capacity if G.count == 1 else balance.Capacity(
            G.rows, cfg.row_len, tuple(-(-self.step_enc[n] // (G.count * s.group)) * s.group
                                       for n, s in self.specs.items()))
        own = self.ranks if self.text_ranks is None else sorted(self.text_ranks)
        self.plan_groups = tuple(G.of_ranks(own) if plan_local else range(G.count))
        if exchange is not None and not plan_local:
            raise ConfigError("Loader(exchange=...) merges the hosts' own plans: it needs plan_local=True")
        self.exchange, self.own_ranks = exchange, tuple(own)
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._planned: dict[int, tuple[int, int]] = {}
        self._plans: dict[int, WindowPlan] = {}
        self._first = tuple(WindowStart(tuple([0] * len(self.sources))) for _ in range(G.count))
        self._starts: dict[int, tuple] = {0: self._first}  # window -> its start per group (0 always kept)
        self.skipped = Counter()            # this host's decode failures per source
        self.shapes = packing.ShapeCounter()
        self.step = 0

    # ------------------------------------------------------------------------------ planning
    def _items(self, step0: int, start: WindowStart, group: int = 0,
               base: int = 0) -> tuple[list[Entry], list, list[balance.Item], list, int, tuple]:
        """Planning group `group`'s pool of the window: its deferred entries first (oldest first), then
        fresh draws (the group's lane of the mixer) up to its share of the pool; item keys from `base`;
        (entries, their metadata, items, dropped, split, next prefix)."""
        cfg = self.cfg
        entries, metas, items, dropped, split = [], [], [], [], 0
        key = lambda: base + len(entries)  # noqa: E731
        for e in start.deferred:  # already checked when first drawn; their metadata is recomputed, not stored
            meta = self.sources[e.source].meta(e.record)
            c = sample_cost(meta, self.cost_model, self.mm_cfg)
            enc = tuple(dict(c.encoder_rows).get(n, 0) for n in self.enc_names)
            if e.piece >= 0:
                n = min(cfg.row_len, c.llm_tokens - e.piece * cfg.row_len)
                items.append(balance.Item(key(), float(self.cost_model.llm(n)), n, enc))
            else:
                items.append(balance.Item(key(), c.total, c.llm_tokens, enc))
            entries.append(Entry(e.source, e.record, e.piece, 0))
            metas.append(meta)
        G = self.groups
        fresh = max(0, G.share(cfg.samples_per_step, group) * cfg.window - len(start.deferred))
        src, rec, prefix = self.mixer.draw(np.asarray(start.prefix), step0, fresh, group, G.count)
        for j, (s, r) in enumerate(zip(src.tolist(), rec.tolist())):
            g = j * cfg.window // max(fresh, 1)  # the step within the window it was drawn for (arrival baseline)
            source = self.sources[s]
            try:
                meta = validate_meta(source.meta(r))
                c = sample_cost(meta, self.cost_model, self.mm_cfg)
            except (BadSample, UserError) as exc:
                dropped.append((source.name, r, f"bad metadata: {exc}"))
                continue
            enc = tuple(dict(c.encoder_rows).get(n, 0) for n in self.enc_names)
            if (c.llm_tokens > cfg.row_len and not any(enc) and all(x.modality == "text" for x in meta.segments)
                    and not meta.is_pair):  # a preference pair is never split: both answers in one row
                pieces = math.ceil(c.llm_tokens / cfg.row_len)
                split += 1
                for p in range(pieces):
                    n = min(cfg.row_len, c.llm_tokens - p * cfg.row_len)
                    items.append(balance.Item(key(), float(self.cost_model.llm(n)), n, enc))
                    entries.append(Entry(s, r, p, g))
                    metas.append(meta)
                continue
            item = balance.Item(key(), c.total, c.llm_tokens, enc)
            if c.llm_tokens > cfg.row_len:  # media tokens may not be split over rows: no layout can take it
                dropped.append((source.name, r, f"longer than a row ({c.llm_tokens} LLM tokens with media > "
                                                 f"data.seq_len={cfg.row_len}); raise data.seq_len to "
                                                 f"{c.llm_tokens} or shorten the sample"))
                continue
            items.append(item)
            entries.append(Entry(s, r, -1, g))
            metas.append(meta)
        return entries, metas, items, dropped, split, tuple(int(x) for x in prefix)

    def window_plan(self, window: int) -> WindowPlan:
        """The plan of window `window` (steps [window*G, (window+1)*G)): identical on every host.

        Computed once per window even when several prefetch threads ask at the same time."""
        with self._plan_lock:
            wp = self._plans.get(window)
            if wp is None:
                # windows chain through their deferred samples: plan the missing ones in order
                known = max((w for w in self._starts if w <= window), default=0)
                for w in range(known, window + 1):
                    if w in self._plans and w + 1 in self._starts:
                        continue
                    wp = self._window_plan(w, self._starts[w])
                    if self.exchange is not None:  # every host's own groups -> the whole window, the same everywhere
                        wp = self.merge(wp, self.exchange(w, self.own_part(wp)))
                    self._plans[w] = wp
                    self._starts[w + 1] = wp.next_start
                    self._planned[w] = (len(wp.dropped), wp.split, len(wp.deferred))
                while len(self._plans) > 4:  # keep the few windows that prefetch threads may still read
                    self._plans.pop(next(iter(self._plans)))
                for w in sorted(self._starts)[1:-8]:  # window 0 and the recent starts
                    self._starts.pop(w)
                wp = self._plans[window]
            return wp

    def _window_plan(self, window: int, start: tuple) -> WindowPlan:
        """The window's plan over this loader's planning groups (`start`: a WindowStart per group)."""
        cfg = self.cfg
        step0 = window * cfg.window
        M, G, W = cfg.microbatches, self.groups, cfg.window
        entries, metas, items, dropped, split = [], [], [], [], 0
        bins: list = [()] * (W * cfg.dp * M)
        loads = [0.0] * len(bins)
        sel_bins: list = [()] * (W * M)
        unplaced, next_start, enc_rows, group_drops = [], list(start), [0] * len(self.enc_names), []
        for j in self.plan_groups:
            base = len(entries)
            e_j, m_j, items_j, d_j, s_j, prefix_j = self._items(step0, start[j], j, base)
            entries += e_j
            metas += m_j
            items += items_j
            dropped += d_j
            split += s_j
            group_drops.append((j, tuple(d_j), s_j))
            cap = self._window_capacity(window, items_j, entries, self.group_capacity)
            enc_rows = [a + b for a, b in zip(enc_rows, cap.enc)]
            selection = self._select(items_j, entries, cap)
            by_key = {it.key: it for it in items_j}
            # where they run: each step's samples over the dp ranks that hold the group's rows (never drops one)
            ranks = G.ranks(j)
            off = G.row_offset(j)
            for g in range(W):
                sel = selection.bins[g * M:(g + 1) * M]
                for m in range(M):  # the layout-free selection in the step's global rows
                    sel_bins[g * M + m] += tuple((k, r + j * G.rows) for k, r in sel[m])
                if not G.aligned:  # ranks hold parts of two groups: the selected rows in order onto the group's rows
                    for m in range(M):
                        for k, r in sel[m]:
                            row = j * G.rows + r
                            b = (g * cfg.dp + row // G.rank_rows) * M + m
                            bins[b] += ((k, row % G.rank_rows),)
                            loads[b] += by_key[k].cost
                    continue
                if G.rows >= G.rank_rows:  # the group holds whole ranks
                    p = self._spread(sel, by_key, len(ranks))
                else:  # a rank holds several groups: this one at its rows' offset
                    p = balance.spread_step(sel, by_key, 1, M, balance.Capacity(G.rows, cfg.row_len))
                    p = balance.Plan(tuple(tuple((k, r + off) for k, r in b) for b in p.bins), p.loads)
                for q, r in enumerate(ranks):
                    for m in range(M):
                        b = (g * cfg.dp + r) * M + m
                        bins[b] += p.bins[q * M + m]
                        loads[b] += p.loads[q * M + m]
            unplaced += selection.unplaced
            # oldest first into the group's next window
            next_start[j] = WindowStart(prefix_j, tuple(entries[k] for k in sorted(selection.unplaced)))
        by_key = {it.key: it for it in items}
        plan = balance.Plan(tuple(bins), tuple(loads), tuple(sorted(unplaced)))
        deferred = tuple(entries[k] for k in plan.unplaced)
        planned = sorted({r for j in self.plan_groups for r in G.ranks(j)})  # the other ranks' bins are empty
        layouts = []
        for g in range(cfg.window):
            rows_need, len_need, enc_need = 1, 1, {n: 0 for n in self.enc_names}
            for b in (plan.bins[(g * cfg.dp + r) * M + m] for r in planned for m in range(M)):
                rows_need = max(rows_need, 1 + max((r for _, r in b), default=0))
                fill: dict[int, int] = {}
                for k, r in b:
                    fill[r] = fill.get(r, 0) + by_key[k].tokens
                len_need = max([len_need, *fill.values()])
                for n_i, n in enumerate(self.enc_names):
                    enc_need[n] = max(enc_need[n], sum(by_key[k].enc[n_i] for k, _ in b))
            if cfg.fixed_shapes:  # rows at the largest bucket; encoder buffers at a rank's share unless more is placed
                rows_need, len_need = cfg.max_rows, cfg.row_len
                enc_need = {n: max(self.enc_cap[n], enc_need[n]) for n in self.enc_names}
            layouts.append(packing.Layout(packing.pick(self.row_buckets, rows_need), packing.pick(self.len_buckets, len_need),
                                          tuple((n, self._enc_bucket(n, enc_need[n])) for n in self.enc_names)))
        for name, rec, why in dropped:
            log.info("dropped %s[%d]: %s", name, rec, why)
            kind = why.split(" (")[0]
            if kind not in self._warned:  # once per kind, with the fix; every drop is counted in dropped_total
                self._warned.add(kind)
                log.warning("skipping samples the data plane cannot place on any layout (counted in dropped_total); "
                            "first: %s[%d]: %s", name, rec, why)
        selection = balance.Plan(tuple(sel_bins), tuple(sum(by_key[k].cost for k, _ in b) for b in sel_bins),
                                 plan.unplaced)
        first = self.plan_groups[0]
        return WindowPlan(step0, tuple(entries), plan, tuple(layouts), tuple(dropped), split, tuple(items),
                          start[first], deferred, next_start[first].prefix, tuple(metas), selection,
                          tuple(enc_rows), next_start=tuple(next_start), starts=tuple(start), groups=self.plan_groups,
                          group_drops=tuple(group_drops))

    # ------------------------------------------------------------------------------ hosts' parts
    def own_part(self, wp: WindowPlan) -> bytes:
        """This host's part of window plan `wp` (planned over its own groups) for the other hosts: its own
        ranks' samples and rows, the next starts, drops and splits of the groups whose first rank is its own
        (a group several hosts plan is sent once), and its step layouts, as a JSON header and one int64
        array of (bin, source, record, piece, row) (5 integers a sample)."""
        cfg, M = self.cfg, self.cfg.microbatches
        own = set(self.own_ranks)
        if self.layout_local:  # no samples: each host lays out its own rows; its ranks' totals for the metrics
            rows = []
            docs = self._rank_docs(wp)[:, sorted(own)]
        else:
            rows = [(b, e.source, e.record, e.piece, row) for b, bin_ in enumerate(wp.plan.bins)
                    if (b // M) % cfg.dp in own for e, row in ((wp.entries[k], row) for k, row in bin_)]
        src = {n: i for i, n in enumerate(self.names)}
        nxt = dict(zip(self.plan_groups, (wp.next_start[j] for j in self.plan_groups)))
        drops = {j: ([[src[name], int(rec), why] for name, rec, why in d], n) for j, d, n in wp.group_drops}
        groups = [[j, list(nxt[j].prefix), [[e.source, e.record, e.piece] for e in nxt[j].deferred], *drops[j]]
                  for j in self.plan_groups if self.groups.ranks(j)[0] in own]
        header = {"ranks": sorted(own), "layouts": [[lay.rows, lay.row_len, [c for _, c in lay.enc]] for lay in wp.layouts]}
        if self.layout_local:  # the groups' section apart: only the host that keeps the state parses it
            head = json.dumps(header, separators=(",", ":")).encode()
            sect = json.dumps(groups, separators=(",", ":")).encode()
            return (len(head).to_bytes(8, "little") + head + len(sect).to_bytes(8, "little") + sect
                    + docs.astype(np.int64).tobytes())
        head = json.dumps({**header, "groups": groups}, separators=(",", ":")).encode()
        body = (docs if self.layout_local else np.asarray(rows, np.int64).reshape(-1, 5)).astype(np.int64).tobytes()
        return len(head).to_bytes(8, "little") + head + body

    def merge(self, local: WindowPlan, parts: list[bytes]) -> WindowPlan:
        """The whole window's plan from every host's `own_part` (any order; this host's among them): every
        rank's samples and rows, the step layouts (per step the largest of the hosts': a bucket of the
        largest need), every group's next start. A pure function of the parts, so identical on every host;
        equal to a loader planning every group (`items` and `selection`, keyed by the local plan's entries,
        are left out; `encoder_rows` stays this host's groups')."""
        cfg, M = self.cfg, self.cfg.microbatches
        heads, bodies = [], []
        for part in parts:
            n = int.from_bytes(part[:8], "little")
            heads.append(json.loads(part[8:8 + n]))
            if self.layout_local:  # header, the groups' section (kept raw), the ranks' totals
                m = int.from_bytes(part[8 + n:16 + n], "little")
                heads[-1]["groups"] = part[16 + n:16 + n + m]
                bodies.append(np.frombuffer(part[16 + n + m:], np.int64).reshape(-1, self._doc_cols * cfg.window))
                continue
            bodies.append(np.frombuffer(part[8 + n:], np.int64).reshape(-1, 5))
        order = sorted(range(len(parts)), key=lambda h: heads[h]["ranks"])
        owner = np.full(cfg.dp, -1, np.int64)  # a rank several hosts hold (pp across hosts): the first one's part
        for h in reversed(order):
            owner[heads[h]["ranks"]] = h
        if (owner < 0).any():
            raise ConfigError(f"window plan parts miss dp ranks {np.flatnonzero(owner < 0)[:8].tolist()} of "
                              f"{cfg.dp}: every rank must be some host's own (the hosts' text_ranks)")
        if self.layout_local:
            return self._merge_local(local, heads, bodies, order, owner)
        rows = np.concatenate([bodies[h][owner[bodies[h][:, 0] // M % cfg.dp] == h] for h in order])
        rows = rows[np.argsort(rows[:, 0], kind="stable")]  # bin order; a bin's samples keep their order
        known = {(e.source, e.record): m for e, m in zip(local.entries, local.metas)}
        entries, metas = [], []
        bins: list = [[] for _ in range(cfg.window * cfg.dp * M)]
        for k, (b, s, r, piece, row) in enumerate(rows.tolist()):
            entries.append(Entry(s, r, piece))
            meta = known.get((s, r))
            metas.append(meta if meta is not None else self.sources[s].meta(r))
            bins[b].append((k, row))
        groups: dict[int, list] = {}
        for h in order:
            for g in heads[h]["groups"]:
                groups.setdefault(int(g[0]), g)  # a group planned by several hosts: the same part from each
        if sorted(groups) != list(range(self.groups.count)):
            raise ConfigError(f"window plan parts hold planning groups {sorted(groups)[:8]}... of {self.groups.count}")
        nxt = tuple(WindowStart(tuple(int(x) for x in groups[j][1]), tuple(Entry(*map(int, e)) for e in groups[j][2]))
                    for j in range(self.groups.count))
        dropped = tuple((self.names[d[0]], int(d[1]), str(d[2])) for j in sorted(groups) for d in groups[j][3])
        split = sum(int(groups[j][4]) for j in groups)
        layouts = []
        for g in range(cfg.window):
            ls = [heads[h]["layouts"][g] for h in order]
            caps = [max(x[2][i] for x in ls) for i in range(len(self.enc_names))]
            layouts.append(packing.Layout(max(x[0] for x in ls), max(x[1] for x in ls), tuple(zip(self.enc_names, caps))))
        deferred = tuple(e for st in nxt for e in st.deferred)
        plan = balance.Plan(tuple(tuple(b) for b in bins), tuple(0.0 for _ in bins), ())
        return WindowPlan(local.first_step, tuple(entries), plan, tuple(layouts), dropped, split, (),
                          local.starts[0], deferred, nxt[0].prefix, tuple(metas), None, local.encoder_rows,
                          next_start=nxt, starts=local.starts, groups=tuple(range(self.groups.count)),
                          group_drops=tuple((j, tuple((self.names[d[0]], int(d[1]), str(d[2])) for d in groups[j][3]),
                                             int(groups[j][4])) for j in sorted(groups)))

    def _spread(self, sel, by_key: dict, ranks: int) -> balance.Plan:
        """A step's selected samples over a planning group's `ranks` (`balance.spread_step`: LPT on cost).
        With `host_ranks` (k ranks a host group, whose encoder work the multiplexer places and routes
        inside the group: `Multiplexer(route_local=...)`): first over the groups of k consecutive ranks by
        encoder cost alone, so every host group encodes about its share of the step, then each group's
        samples over its k ranks by cost. Only where samples run changes, never which (layout-free)."""
        k, M = self.cfg.host_ranks, self.cfg.microbatches
        if k <= 0 or k >= ranks or ranks % k or M != 1:
            return balance.spread_step(sel, by_key, ranks, M, self.capacity)
        keys = {key for b in sel for key, _ in b}
        enc = {key: replace(by_key[key], cost=max(0.0, by_key[key].cost - float(self.cost_model.llm(by_key[key].tokens))))
               for key in keys}
        cap = self.capacity
        top = balance.spread_step(sel, enc, ranks // k, M, balance.Capacity(k * cap.rows, cap.row_len,
                                                                           tuple(k * e for e in cap.enc)))
        bins, loads = [], []
        for q in range(ranks // k):
            sub = balance.spread_step((top.bins[q],), by_key, k, M, cap)
            bins += sub.bins
            loads += sub.loads
        return balance.Plan(tuple(bins), tuple(loads), ())

    def _merge_local(self, local: WindowPlan, heads: list, bodies: list, order: list, owner: np.ndarray) -> WindowPlan:
        """`merge` where each host lays out only its own rows (`layout_local`): this host's own plan (its
        samples, rows, entries) with what every host must agree on from the parts: every group's next
        start, drops and splits, the step layouts (per step the largest), every rank's documents, tokens and
        squared lengths per step. O(groups + ranks) integers, no other host's samples."""
        cfg = self.cfg
        groups: dict[int, list] = {}
        if not self.keep_state:  # only this host's own groups: the others' sections are not read
            src = {n: i for i, n in enumerate(self.names)}
            drops = {j: ([[src[name], int(rec), why] for name, rec, why in d], n) for j, d, n in local.group_drops}
            for j in self.plan_groups:
                st = local.next_start[j]
                groups[j] = [j, list(st.prefix), [[e.source, e.record, e.piece] for e in st.deferred], *drops[j]]
            for j in range(self.groups.count):  # other groups: their start as this host knew it (not a checkpoint)
                if j not in groups:
                    st = local.starts[j]
                    groups[j] = [j, list(st.prefix), [[e.source, e.record, e.piece] for e in st.deferred], [], 0]
        for h in order if self.keep_state else ():
            for g in json.loads(heads[h]["groups"]):
                groups.setdefault(int(g[0]), g)
        if sorted(groups) != list(range(self.groups.count)):
            raise ConfigError(f"window plan parts hold planning groups {sorted(groups)[:8]}... of {self.groups.count}")
        nxt = tuple(WindowStart(tuple(int(x) for x in groups[j][1]), tuple(Entry(*map(int, e)) for e in groups[j][2]))
                    for j in range(self.groups.count))
        group_drops = tuple((j, tuple((self.names[d[0]], int(d[1]), str(d[2])) for d in groups[j][3]),
                             int(groups[j][4])) for j in sorted(groups))
        dropped = tuple(d for _, drops, _ in group_drops for d in drops)
        layouts = []
        for g in range(cfg.window):
            ls = [heads[h]["layouts"][g] for h in order]
            caps = [max(x[2][i] for x in ls) for i in range(len(self.enc_names))]
            layouts.append(packing.Layout(max(x[0] for x in ls), max(x[1] for x in ls), tuple(zip(self.enc_names, caps))))
        C = self._doc_cols
        docs = np.zeros((cfg.window, cfg.dp, C), np.int64)
        for h in order:
            mine = np.asarray(heads[h]["ranks"], np.int64)
            if mine.size:
                got = bodies[h].reshape(cfg.window, len(mine), C)
                take = owner[mine] == h
                docs[:, mine[take]] = got[:, take]
        return replace(local, layouts=tuple(layouts), dropped=dropped, split=sum(n for _, _, n in group_drops),
                       deferred=tuple(e for st in nxt for e in st.deferred), next_prefix=nxt[0].prefix,
                       next_start=nxt, groups=tuple(range(self.groups.count)), rank_docs=docs,
                       group_drops=group_drops)

    def _rank_docs(self, wp: WindowPlan) -> np.ndarray:
        """[window, dp, 3 + 3 x encoders]: documents, LLM tokens and sum of squared document lengths of every
        rank's samples in `wp` (the ranks it plans; `packing.pack`'s `row_docs`, summed per rank): one
        document per sample, a preference pair's two answers two; then per encoder (`enc_names` order) its
        segments, input rows and sum of squared segment rows (the segments `packing.pack` lays out: one per
        media segment with rows), from metadata."""
        cfg, M = self.cfg, self.cfg.microbatches
        E = len(self.enc_names)
        col = {n: 3 + 3 * i for i, n in enumerate(self.enc_names)}
        enc_of = modality_encoders(self.mm_cfg)
        seg_rows: dict[tuple, int] = {}
        out = np.zeros((cfg.window, cfg.dp, 3 + 3 * E), np.int64)
        for b, bin_ in enumerate(wp.plan.bins):
            if not bin_:
                continue
            g, r = b // (cfg.dp * M), b // M % cfg.dp
            for k, _ in bin_:
                meta, entry = wp.metas[k], wp.entries[k]
                segs: list[tuple[str, int]] = []
                if getattr(meta, "is_pair", False):
                    flat = self._load_lazy(entry, meta, False)
                    docs = flat.docs or (flat.size,)
                    segs = [(name, x.rows if hasattr(x, "rows") else int(np.shape(x)[0])) for name, x, _, _ in flat.enc]
                else:
                    docs = (wp.items[k].tokens,)
                    if entry.piece < 0:  # a row-sized piece of a long text sample has no media
                        for seg in meta.segments:
                            if seg.modality == "text":
                                continue
                            key = (seg.modality, tuple(seg.shape))
                            if key not in seg_rows:
                                seg_rows[key] = segment_tokens(seg, self.mm_cfg)[0]
                            segs.append((enc_of[seg.modality], seg_rows[key]))
                out[g, r, :3] += (len(docs), sum(docs), sum(m * m for m in docs))
                for name, m in segs:
                    if m:
                        out[g, r, col[name]:col[name] + 3] += (1, m, m * m)
        return out

    def _select(self, items: list[balance.Item], entries: list[Entry], cap: balance.Capacity) -> balance.Plan:
        """Which samples form each step of the window: a function of the items and the capacity only (no ranks)."""
        cfg = self.cfg
        if cfg.reorder:
            return balance.plan_window(items, cfg.window, 1, cfg.microbatches, cap)
        per_step: list[list[balance.Item]] = [[] for _ in range(cfg.window)]  # baseline: arrival order
        for it in items:
            per_step[entries[it.key].drawn].append(it)
        bins, loads, unplaced = [], [], []
        for group in per_step:
            p = _arrival_with_capacity(group, cfg.microbatches, cap)
            bins += p.bins
            loads += p.loads
            unplaced += p.unplaced
        return balance.Plan(tuple(bins), tuple(loads), tuple(sorted(unplaced)))

    def _window_capacity(self, window: int, items: list[balance.Item], entries: list[Entry],
                         cap: balance.Capacity) -> balance.Capacity:
        """The capacity of this window (of a planning group): `cap`, each encoder doubled until the
        window's largest sample fits alone (so no sample is ever dropped for its size; a bounded set of
        buckets)."""
        enc = list(cap.enc)
        for i, n in enumerate(self.enc_names):
            need = max((it.enc[i] for it in items), default=0)
            while enc[i] < need:
                enc[i] *= 2
            if enc[i] != cap.enc[i]:
                big = max(items, key=lambda it: (it.enc[i], -it.key))
                e = entries[big.key]
                log.info("window %d: %s rows per step grown %d -> %d for %s[%d] (%d rows alone)", window, n,
                         cap.enc[i], enc[i], self.names[e.source], e.record, big.enc[i])
        return balance.Capacity(cap.rows, cap.row_len, tuple(enc))

    def _enc_bucket(self, name: str, need: int) -> int:
        """The encoder buffer per rank that holds `need` rows: a bucket, or (past the step capacity, in a
        window grown for a large sample) the step capacity doubled until it holds them."""
        b = self.enc_buckets[name]
        if need <= b[-1]:
            return packing.pick(b, need)
        c = b[-1]
        while c < need:
            c *= 2
        return c

    # ------------------------------------------------------------------------------ loading
    def _load(self, entry: Entry):
        source = self.sources[entry.source]
        try:
            sample = source.get(entry.record)
            if self.tokenizer is None:
                sample = sample.validate()
                flat = packing.flatten(sample, self.mm_cfg, self.specs)
            else:
                sample = sample.validate(vocab_size=self.tokenizer.vocab_size)
                flat = packing.flatten(sample, self.mm_cfg, self.specs, self.tokenizer.placeholder)
            if entry.piece >= 0:
                flat = packing.text_piece(flat, entry.piece, self.cfg.row_len)
            return flat
        except (BadSample, UserError, ValueError, OSError) as exc:
            with self._lock:
                self.skipped[source.name] += 1
            log.warning("skipped bad record %s[%d]: %s", source.name, entry.record, exc)
            return None

    def _load_lazy(self, entry: Entry, meta, read_text: bool):
        """`_load` from metadata: text read only if `read_text` (else the sample's geometry alone, no token
        arrays: a row another host holds), media decoded later and only if sliced.

        A record whose text cannot be read keeps its layout (every host planned it) with no loss on it."""
        source = self.sources[entry.source]
        placeholder = None if self.tokenizer is None else self.tokenizer.placeholder
        vocab = tokenizer_mod.VOCAB_SIZE if self.tokenizer is None else self.tokenizer.vocab_size

        def skip(what: str) -> None:
            with self._lock:
                self.skipped[source.name] += 1

        text = None
        if read_text:
            try:
                text = source.text(entry.record)
                if any(np.asarray(t).min(initial=0) < 0 or np.asarray(t).max(initial=0) >= vocab for t in text.values()):
                    raise BadSample(f"token ids outside [0, {vocab})")
            except (BadSample, UserError, ValueError, OSError) as exc:
                skip(str(exc))
                log.warning("skipped bad record %s[%d]: %s (its rows carry no loss)", source.name, entry.record, exc)
                text = None
        fetch = lambda k: source.media(entry.record, k)  # noqa: E731
        if not read_text:
            flat = packing.flatten_meta(meta, None, fetch, self.mm_cfg, self.specs, placeholder, on_error=skip,
                                        layout_only=True)
            return packing.text_piece(flat, entry.piece, self.cfg.row_len) if entry.piece >= 0 else flat
        try:
            flat = packing.flatten_meta(meta, text, fetch, self.mm_cfg, self.specs, placeholder, on_error=skip)
        except BadSample as exc:  # text lengths disagree with the metadata: lay the sample out blind
            skip(str(exc))
            log.warning("skipped bad record %s[%d]: %s (its rows carry no loss)", source.name, entry.record, exc)
            flat = packing.flatten_meta(meta, None, fetch, self.mm_cfg, self.specs, placeholder, on_error=skip)
        if entry.piece >= 0:
            flat = packing.text_piece(flat, entry.piece, self.cfg.row_len)
        return flat

    def host_batch(self, step: int) -> dict[str, Any]:
        """This host's part of global batch `step`: one packed dict per microbatch (local ranks concatenated).

        With `text_ranks`, the token arrays hold only those ranks' rows (`rows` names their global
        indices); the other ranks' samples are laid out from metadata (the step's geometry: encoder
        segments, destinations, `row_docs`) and never become arrays here, so a host's arrays grow
        with its own ranks, not with the step."""
        cfg = self.cfg
        wp = self.window_plan(step // cfg.window)
        g = step % cfg.window
        layout = wp.layouts[g]
        local = None if self.text_ranks is None else [i for i, r in enumerate(self.ranks) if r in self.text_ranks]
        pad = [] if self.tokenizer is None else [self.tokenizer.pad]
        micro = []
        for m in range(cfg.microbatches):
            def bins(m=m):  # one rank at a time: a remote rank's geometry is consumed, never kept
                for i, r in enumerate(self.ranks):
                    if self.layout_local and r not in self.text_ranks:
                        continue  # another host's rows: not laid out here (sparse)
                    b = (g * cfg.dp + r) * cfg.microbatches + m
                    entries = []
                    read_text = self.text_ranks is None or r in self.text_ranks
                    for key, row in wp.plan.bins[b]:
                        flat = (self._load_lazy(wp.entries[key], wp.metas[key], read_text) if self.lazy_media
                                else self._load(wp.entries[key]))
                        if flat is not None:
                            entries.append((flat, row))
                    yield (i, entries) if self.layout_local else entries
            if self.lazy_media:
                batch = packing.pack(bins(), layout, self.specs, *pad, local=local, lazy=True, n_bins=len(self.ranks),
                                     sparse=self.layout_local)
                if self.layout_local:
                    self._step_docs(batch, wp, g)
            else:
                batch = packing.pack(list(bins()), layout, self.specs, *pad)
            with self._lock:
                self.shapes.add(layout, batch)
            micro.append(batch)
        return {"step": step, "microbatches": micro, "layout": layout, "ranks": tuple(self.ranks)}

    def _step_docs(self, batch: dict, wp: WindowPlan, g: int) -> None:
        """A layout-local batch's `row_docs`: its own rows as laid out, the rest of the step's documents,
        tokens and squared lengths (every rank's, from the parts, or the ranks planned here) summed into
        the first row not held here, so a sum over `row_docs` is the step's. `enc_docs`: per encoder the
        step's (segments, input rows, sum of squared segment rows), every host's, where the batch's own
        encoder segments are this host's share only (what FLOPs and the step's payload bytes count)."""
        docs = wp.rank_docs if wp.rank_docs is not None else self._rank_docs(wp)
        rows = batch["row_docs"]
        step = docs[g][self.ranks].sum(axis=0)
        batch["enc_docs"] = {n: step[3 + 3 * i:6 + 3 * i].copy() for i, n in enumerate(self.enc_names)}
        R = len(rows) // len(self.ranks)
        held = np.zeros(len(rows), bool)
        for i, r in enumerate(self.ranks):
            if r in self.text_ranks:
                held[i * R:(i + 1) * R] = True
        if held.all():
            return
        rest = step[:3] - rows[held].sum(axis=0)
        rows[int(np.flatnonzero(~held)[0])] += rest

    # ------------------------------------------------------------------------------ iteration
    def dataset(self, start_step: int = 0):
        """grain IterDataset of host batches from `start_step` on (threaded prefetch)."""
        import grain
        ds = grain.MapDataset.range(start_step, 1 << 40).map(self.host_batch)
        return ds.to_iter_dataset(grain.ReadOptions(num_threads=self.cfg.threads, prefetch_buffer_size=self.cfg.prefetch))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataset(self.step):
            self.step = batch["step"] + 1
            yield batch

    def state(self, lazy: bool = False) -> "dict[str, Any] | LoaderState":
        """Small and host-independent: saved with the model checkpoint. Holds the start of the window
        of the next step (draw counts + deferred entries, one per planning group), so resume needs no
        replay of earlier windows. A loader that plans only its own groups (`plan_local`) knows only
        theirs: its state resumes the same groups (the other groups' entries are their first window's).

        lazy: the position captured now (the step and its window's starts, immutable: O(1)) as a
        `LoaderState`, serialized only when read. Every group's deferred samples are O(step) integers, so
        the trainer's prefetcher, which takes the state after every batch, serializes it only for the
        batches a checkpoint saves (`lazy_state`)."""
        window = self.step // self.cfg.window
        with self._plan_lock:
            known = window in self._starts
        if not known:
            self.window_plan(max(window - 1, 0))  # makes sure the window's start is known
        with self._plan_lock:
            start = self._starts[window]
        step = int(self.step)

        def make() -> dict[str, Any]:
            out = {"step": step, "seed": int(self.cfg.seed), "schedule": self.schedule.fingerprint(), "window": window}
            if len(start) == 1:
                return {**out, "start": start[0].to_state()}
            return {**out, "starts": [s.to_state() for s in start]}
        return LoaderState(make) if lazy else make()

    def lazy_state(self) -> "LoaderState":
        """`state(lazy=True)`: what the trainer's prefetcher takes after every batch."""
        return self.state(lazy=True)

    def restore(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.cfg.seed or state["schedule"] != self.schedule.fingerprint():
            raise UserError(f"loader state was saved with seed {state['seed']} and schedule {state['schedule']}; "
                            f"this run has seed {self.cfg.seed} and schedule {self.schedule.fingerprint()}: "
                            f"resume with the same data config")
        self.step = int(state["step"])
        with self._plan_lock:
            self._plans.clear()
            self._starts = {0: self._first}
            saved = state["starts"] if "starts" in state else [state["start"]] if "start" in state else None
            if saved is not None:  # older states without it replay the windows from 0 (same result, slower)
                start = tuple(WindowStart.from_state(s) for s in saved)
                if len(start) != self.groups.count:
                    raise UserError(f"loader state has {len(start)} planning groups, this run has {self.groups.count} "
                                    "(data.batch_size changed): resume with the same data config")
                if any(len(s.prefix) != len(self.sources) for s in start):
                    raise UserError(f"loader state has {len(start[0].prefix)} sources, this run has "
                                    f"{len(self.sources)}: resume with the same data config")
                self._starts[int(state["window"])] = start

    # the trainer's loader protocol
    get_state = state
    set_state = restore

    def metrics(self, step: int | None = None) -> dict[str, Any]:
        """Counters: this host's skipped records; drops/splits of the current window and of all windows planned."""
        wp = self.window_plan((self.step if step is None else step) // self.cfg.window)
        return {"skipped_bad_records": int(sum(self.skipped.values())),
                "skipped_shards": sum(getattr(s, "skipped_shards", 0) for s in self.sources),
                "skipped_by_source": dict(self.skipped),
                "dropped_in_window": len(wp.dropped), "split_in_window": wp.split,
                "deferred_in_window": len(wp.deferred),
                "dropped_total": sum(d for d, _, _ in self._planned.values()),
                "split_total": sum(x for _, x, _ in self._planned.values()),
                "distinct_shapes": len(self.shapes.shapes), "padded_fraction": self.shapes.padded_fraction}


class LoaderState(Mapping):
    """A loader state captured cheaply and built on first read (then kept): a read-only mapping equal to
    the `Loader.state()` dict of the position it was captured at."""

    def __init__(self, make: Callable[[], dict[str, Any]]):
        self._make: Callable[[], dict[str, Any]] | None = make
        self._state: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _get(self) -> dict[str, Any]:
        with self._lock:
            if self._state is None:
                self._state, self._make = self._make(), None
            return self._state

    @property
    def built(self) -> bool:
        """Whether it has been read (serialized) yet."""
        return self._state is not None

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class TrainerBatches:
    """The trainer's loader protocol over a `Loader`: each step's host batch (this host's ranks'
    rows concatenated) as one dict, and the loader's small state for the checkpoint."""

    def __init__(self, loader: Loader):
        if loader.cfg.microbatches != 1:
            raise ConfigError(f"data.microbatches={loader.cfg.microbatches}: the trainer splits a step into "
                              "microbatches itself (trainer.grad_accum); use data.microbatches=1")
        self.loader = loader
        self._batches: Iterator[dict[str, Any]] | None = None

    def __iter__(self) -> "TrainerBatches":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._batches is None:
            self._batches = iter(self.loader)
        return next(self._batches)["microbatches"][0]

    @property
    def window(self) -> int:
        """Steps planned together: the trainer reserves their buffers at once (one compiled program)."""
        return self.loader.cfg.window

    def get_state(self) -> dict[str, Any]:
        return self.loader.state()

    def lazy_state(self) -> "LoaderState":
        """The position now, serialized only if a checkpoint reads it (`Loader.state(lazy=True)`)."""
        return self.loader.state(lazy=True)

    def set_state(self, state: dict[str, Any]) -> None:
        self.loader.restore(state)
        self._batches = None  # restart the prefetching iterator at the restored step

    def metrics(self) -> dict[str, Any]:
        m = self.loader.metrics()
        return {k: v for k, v in m.items() if not isinstance(v, dict)}


def _arrival_with_capacity(items: list[balance.Item], n_bins: int, cap: balance.Capacity) -> balance.Plan:
    """Arrival order into equal consecutive chunks, rows first-fit; what does not fit is unplaced."""
    order = sorted(items, key=lambda it: it.key)
    chunks = np.array_split(np.arange(len(order)), n_bins)
    bins, loads, unplaced = [], [], []
    for idx in chunks:
        b = Bin(cap)
        load = 0.0
        for i in idx:
            it = order[i]
            row = b.row_for(it, cap)
            if row < 0:
                unplaced.append(it.key)
                continue
            b.add(it, row, cap)
            load += it.cost
        bins.append(tuple(b.items))
        loads.append(load)
    return balance.Plan(tuple(bins), tuple(loads), tuple(unplaced))
