"""The multimodal trainer's data plane, from the user's data paths: sources, step capacities, the loader.

Shared by the multimodal recipes (tiny_omni, finetune, omni_8b, omni_moe) and `dryrun`. It sits in
`train` rather than `data` because it reads the job's devices (one dp rank per device, process 0 logs).
The step capacities (encoder input rows per step) are sized here from the sources' metadata
(`data_bounds`, `step_capacities`): they are the trainer's buffer sizes, which the loader then fills.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from omnijax.config import MMDataConfig
from omnijax.data import packing
from omnijax.data.loader import Loader, LoaderConfig
from omnijax.data.sample import BadSample
from omnijax.data.sources import Source, SourceSpec, open_sources, source_specs
from omnijax.data.tokens import modality_encoders, segment_tokens
from omnijax.errors import ConfigError, UserError
from omnijax.mm_config import MMConfig, encoder_configs


@dataclass(frozen=True)
class DataBounds:
    """What the sources' metadata say about sample sizes (read without decoding a payload)."""
    scanned: int                                     # records whose metadata was read
    complete: bool                                   # every record of every source was read
    largest: dict[str, tuple[int, str, int]]         # encoder -> (input rows, source, record) of its largest sample
    mean_rows: dict[str, float]                      # encoder -> input rows per sample (all samples)
    mean_tokens: float                               # LLM tokens per sample
    var_rows: dict[str, float] = field(default_factory=dict)  # encoder -> variance of input rows per sample


def data_bounds(sources: list[Source], mm_cfg: Any, prefix: int = 2048) -> DataBounds:
    """Sample sizes from metadata: every record of a source whose metadata is in memory (ArrayRecord
    shards' sidecars), the first `prefix` records of the others (the built-in world, JSONL, Parquet:
    a sample larger than any seen still trains, its window planning at a larger bucket)."""
    names = packing.encoder_specs(mm_cfg)
    enc_of = modality_encoders(mm_cfg)
    cache: dict[tuple, tuple[int, int]] = {}
    largest: dict[str, tuple[int, str, int]] = {}
    total, total_sq = Counter(), Counter()
    tokens, scanned, complete = 0, 0, True
    for src in sources:
        n = len(src) if src.metadata_in_memory else min(len(src), prefix)
        complete = complete and n == len(src)
        for i in range(n):
            try:
                meta = src.meta(i)
            except (BadSample, UserError):
                continue  # counted when drawn (bad metadata is skipped at planning)
            rows: dict[str, int] = {}
            try:
                for seg in meta.segments:
                    key = (seg.modality, tuple(seg.shape))
                    if key not in cache:
                        cache[key] = segment_tokens(seg, mm_cfg)
            except BadSample:
                continue  # e.g. a modality this model has no encoder for: skipped (and counted) when drawn
            for seg in meta.segments:
                r, t = cache[(seg.modality, tuple(seg.shape))]
                tokens += t
                if seg.modality != "text" and seg.modality in enc_of:
                    rows[enc_of[seg.modality]] = rows.get(enc_of[seg.modality], 0) + r
            for e, r in rows.items():
                total[e] += r
                total_sq[e] += r * r
                if r > largest.get(e, (0, "", -1))[0]:
                    largest[e] = (r, src.name, i)
            scanned += 1
    n = max(scanned, 1)
    return DataBounds(scanned, complete, {e: largest[e] for e in names if e in largest},
                      {e: total[e] / n for e in names}, tokens / n,
                      {e: max(0.0, total_sq[e] / n - (total[e] / n) ** 2) for e in names})


def step_capacities(bounds: DataBounds, rows: int, row_len: int, mm_cfg: Any,
                    explicit: dict[str, int] | None = None, key: str = "capacity") -> dict[str, int]:
    """Encoder input rows per step: `explicit` where given (checked: it must hold the largest sample),
    else sized from the data: a step of rows x row_len LLM tokens holds n = rows x row_len / mean tokens
    samples, whose rows sum to n x mean +- sqrt(n x variance); the capacity is that mean plus two
    standard deviations (a heavy-tailed encoder, e.g. few long clips, gets more room than its mean), or
    the largest sample if that is more, in multiples of the encoder's reduction. The packer fills a step
    up to it; what does not fit waits for the next step (never dropped), so padding stays bounded.

    An explicit value below the largest sample is a ConfigError naming `key` and the value that fits."""
    out = {}
    for name, spec in packing.encoder_specs(mm_cfg).items():
        big, src, rec = bounds.largest.get(name, (0, "", -1))
        fit = -(-big // spec.group) * spec.group
        given = (explicit or {}).get(name)
        if given is not None:
            if given < fit:
                raise ConfigError(f"{key}.{name}={given} is below the {fit} {name} input rows of sample {src}[{rec}]: "
                                  f"set {key}.{name}={fit} or more, or auto (or unset) to size it from the data")
            out[name] = int(given)
            continue
        n = rows * row_len / max(bounds.mean_tokens, 1e-9)
        need = n * bounds.mean_rows.get(name, 0.0) + 2.0 * math.sqrt(n * bounds.var_rows.get(name, 0.0))
        out[name] = max(fit, -(-math.ceil(need) // spec.group) * spec.group, spec.group)
    unknown = set(explicit or {}) - set(out)
    if unknown:
        raise ConfigError(f"{key}: unknown encoder(s) {sorted(unknown)}; this model's encoders: {sorted(out)}")
    return out


def host_ranks(dp_index_of_local_devices) -> list[int]:
    """The dp ranks a process loads: one per distinct data-parallel coordinate among its devices.

    Devices that differ only in tensor/pipeline/context/expert coordinates share their dp rank's
    batch, which this host reads once (the placement code broadcasts it to those devices)."""
    ranks = sorted({int(i) for i in dp_index_of_local_devices})
    if not ranks or ranks[0] < 0:
        raise ConfigError(f"dp indices {list(dp_index_of_local_devices)}: need at least one, all >= 0")
    return ranks


def plane_config(specs: list[SourceSpec], mix: Any, seed: int, batch_size: int, seq_len: int,
                 capacity: dict[str, int]) -> LoaderConfig:
    """The data plane's config: one dp rank per device, fixed shapes (one compiled program).

    A step's samples are chosen against the whole batch (`batch_size` rows, `capacity` encoder rows), not
    a device's share: the same samples on every layout. Each window draws 4 samples per row (more than
    fit: the packer picks, the rest wait for the next window)."""
    ranks = jax.device_count()
    if batch_size % ranks:
        raise ConfigError(f"data.batch_size={batch_size} must split over {ranks} data-parallel ranks "
                          f"(one per device): use a multiple of {ranks}")
    return LoaderConfig(sources=specs, mix=mix, samples_per_step=4 * batch_size, dp=ranks, microbatches=1,
                        window=4, row_len=seq_len, max_rows=batch_size // ranks, fixed_shapes=True,
                        encoder_rows=dict(capacity), seed=seed)


def capacities_known(capacity: dict[str, Any], mm_cfg: MMConfig) -> bool:
    """Every encoder has an explicit integer capacity (nothing left to size from the data)."""
    return all(isinstance(capacity.get(n), int) for n in encoder_configs(mm_cfg))


def size_capacities(capacity: dict[str, Any], sources: list[Source], mm_cfg: MMConfig, batch_size: int,
                    seq_len: int, key: str) -> dict[str, int]:
    """`capacity` completed from the sources' metadata: encoders left out (or `auto`) are sized, explicit
    values are checked (one that cannot hold the largest sample is a ConfigError naming the value that
    fits). Process 0 prints what was sized, and from which config key's sources."""
    bounds = data_bounds(sources, mm_cfg)
    given = {k: v for k, v in capacity.items() if v != "auto"}
    sized = step_capacities(bounds, batch_size, seq_len, mm_cfg, explicit=given)
    derived = {k: v for k, v in sized.items() if k not in given}
    if derived and jax.process_index() == 0:
        largest = {k: v[0] for k, v in bounds.largest.items()}
        print(f"capacity sized from {key} ({bounds.scanned} records' metadata{'' if bounds.complete else ', a prefix'}; "
              f"largest sample {largest}): {derived}", file=sys.stderr)
    return sized


def open_plane(key: str, paths: list[str], split: str, *, data: MMDataConfig, mm_cfg: MMConfig, world_cfg: Any,
               capacity: dict[str, Any], tok: Any = None, mix: Any = None, seed: int = 0, steps: int = 0,
               placement: Any = None) -> tuple[Loader, dict[str, Any]]:
    """A data-plane Loader over `paths` (config key `key`; sources opened once, checked against the
    tokenizer), and the capacity it plans with.

    The capacity is sized from these sources when they are the training sources (`key == "data.sources"`)
    or when some encoder's is still unknown. steps > 0: the loader serves only `steps` steps and draws
    no more than the sources hold, so no record repeats (the held-out set). With a joint-step
    `placement`, a host reads only the token rows its devices hold and decodes only the media segments
    the plan places on its devices. One process lays the whole step out from metadata; with several,
    each plans only its own planning groups and the window is merged from every process's part
    (`kv_exchange`), and where the placement routes per host group each lays out only its own rows
    (`Loader(layout_local=True)`: the batch carries the step's totals, `row_docs` and `enc_docs`, for the
    metrics), with process 0 alone keeping every group's state (`keep_state`)."""
    specs = source_specs(key, paths, split)
    sources = open_sources(specs, world_cfg, tokenizer=tok, media_cfg=data.media, bad_shards=data.bad_shards)
    if key == "data.sources" or not capacities_known(capacity, mm_cfg):
        capacity = size_capacities(capacity, sources, mm_cfg, data.batch_size, data.seq_len, key)
    plane = plane_config(specs, mix, seed, data.batch_size, data.seq_len, capacity)
    if steps:
        windows = -(-steps // plane.window)
        plane.samples_per_step = max(1, min(plane.samples_per_step,
                                            sum(len(s) for s in sources) // (plane.window * windows)))
    if placement is None:
        return Loader(plane, mm_cfg=mm_cfg, world_cfg=world_cfg, sources=sources, tokenizer=tok), capacity
    rows = plane.max_rows  # bin r holds global rows [r*rows, (r+1)*rows)
    text_ranks = sorted({int(r) // rows for r in placement.host_rows(data.batch_size)})
    # several processes: each plans only the planning groups of its own rows, and the window's plan is merged
    # from every process's part (the same on all; the state holds every group, so process 0's resumes all)
    several = jax.process_count() > 1
    if several and text_ranks == list(range(text_ranks[0], text_ranks[0] + len(text_ranks))):
        # the multiplexer routes per host group (issue 47): spread each step's encoder cost over the hosts'
        # ranks first, so every group encodes about its share (where the samples run, never which)
        plane.host_ranks = len(text_ranks)
    # and where the placement routes per host group (`Multiplexer(route_local=...)`, on by default with several
    # processes), each host lays out only its own rows and their segments: the exchanged parts carry no samples
    # (the step's totals for the metrics instead), and only process 0, whose state is the checkpoint, reads every
    # group's next start
    groups = getattr(placement, "host_groups", None)
    local = several and callable(groups) and groups() is not None
    if local and jax.process_index() == 0:
        print(f"{key}: each of {jax.process_count()} processes lays out only its own rows "
              f"({len(text_ranks)} of {plane.dp} dp ranks; step totals exchanged)", file=sys.stderr)
    return Loader(plane, mm_cfg=mm_cfg, world_cfg=world_cfg, sources=sources, tokenizer=tok, lazy_media=True,
                  text_ranks=text_ranks, plan_local=several, layout_local=local,
                  keep_state=not local or jax.process_index() == 0,
                  exchange=kv_exchange(f"omnijax_plan/{key}") if several else None), capacity


def kv_exchange(prefix: str, timeout_s: float = 900.0, keep: int = 16) -> Callable[[int, bytes], list[bytes]]:
    """`exchange(window, part) -> every process's part` over the coordination service's key-value store
    (`Loader(exchange=...)`; `parallel.hosts.kv_exchange`, which the multiplexer's host groups also use to
    agree capacities). Every process reads every part: fine for tens of hosts and small parts."""
    from omnijax.parallel import hosts

    if jax.process_count() == 1:
        raise ConfigError("data_plane.kv_exchange needs a multi-process job (jax.distributed initialized)")
    return hosts.kv_exchange(prefix, timeout_s, keep)


def cached_batches(loader: Loader, batches: int) -> Callable[[], list[dict]]:
    """() -> the loader's first `batches` host batches (first microbatch each), planned and packed at the
    first call, then kept: the held-out set is evaluated on the same batches every time."""
    cache: list[dict] = []

    def get() -> list[dict]:
        if not cache:
            cache.extend(loader.host_batch(step)["microbatches"][0] for step in range(batches))
        return cache
    return get
