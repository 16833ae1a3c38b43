"""The multimodal trainer's data plane, from the user's data paths: sources, step capacities, the loader.

Shared by the multimodal recipes (tiny_omni, finetune, omni_8b, omni_moe) and `dryrun`. It sits in
`train` rather than `data` because it reads the job's devices (one dp rank per device, process 0 logs).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import jax

from omnijax.config import MMDataConfig
from omnijax.data.loader import Loader, LoaderConfig, data_bounds, step_capacities
from omnijax.data.sources import Source, SourceSpec, open_sources, source_specs
from omnijax.errors import ConfigError
from omnijax.mm_config import MMConfig, encoder_configs


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
    `placement`, every host lays the whole step out from metadata but reads only the token rows its
    devices hold and decodes only the media segments the plan places on its devices."""
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
    return Loader(plane, mm_cfg=mm_cfg, world_cfg=world_cfg, sources=sources, tokenizer=tok, lazy_media=True,
                  text_ranks=text_ranks), capacity


def cached_batches(loader: Loader, batches: int) -> Callable[[], list[dict]]:
    """() -> the loader's first `batches` host batches (first microbatch each), planned and packed at the
    first call, then kept: the held-out set is evaluated on the same batches every time."""
    cache: list[dict] = []

    def get() -> list[dict]:
        if not cache:
            cache.extend(loader.host_batch(step)["microbatches"][0] for step in range(batches))
        return cache
    return get
