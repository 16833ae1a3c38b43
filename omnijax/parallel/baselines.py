"""The baselines' encoder placements (what trainers without decoupled encoders do), beside omnijax's.

Both bolt the encoders onto the first pipeline stage: each batch shard's segments (the shard that holds
their LLM rows) are encoded on the `pp=0` devices of that shard, in arrival order, and no other device
encodes, so stage 0 carries all encoder time while later stages wait at the barrier.

- `coupled` (the baseline users run today): the work is split over that stage's tp·cp ranks, as
  Megatron shards its ViT over the tensor-parallel group: each rank encodes a disjoint share of the
  shard's segments (whole segments, each onto the least-loaded rank, in arrival order), then its
  outputs travel to every replica holding their LLM positions (pp > 0 stages and the other tp/cp ranks).
  No work is replicated.
- `coupled_replicated`: every tp/cp rank of stage 0 encodes the shard's whole set (encoders replicated
  inside the LLM mesh); each replica takes its outputs from the stage-0 device with its own (cp, tp).

Each returns `(Assignment, source_of)`: `source_of(segment, destination device)` picks the replica a
destination reads from, or None when every segment is held by one device.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from omnijax.parallel.device_grid import DeviceGrid
from omnijax.parallel.encoder_placement import Assignment, Segment

SourceOf = Callable[[int, int], int]


def _owner_shard(segment: Segment, shard_of: np.ndarray) -> int:
    """The batch shard holding a segment's LLM positions (its first real output token's row)."""
    valid = segment.dests[segment.dests >= 0]
    return int(shard_of[valid[0]]) if valid.size else 0


def coupled(segments: list[Segment], grid: DeviceGrid, shard_of: np.ndarray) -> tuple[Assignment, None]:
    """Each batch shard's segments split over its pp=0 devices (tp·cp ranks), whole segments in arrival
    order onto the least-loaded rank (ties: lowest device); nothing replicated."""
    D = grid.num_devices
    shard, pp = grid.batch_shard(), grid.axis("pp")
    stage0 = {s: np.flatnonzero((shard == s) & (pp == 0)) for s in range(grid.batch_shards)}
    short: list[list[int]] = [[] for _ in range(D)]
    load = np.zeros(D)
    for i, s in enumerate(segments):
        ranks = stage0[_owner_shard(s, shard_of)]
        d = int(ranks[np.argmin(load[ranks])])
        short[d].append(i)
        load[d] += s.cost
    return Assignment(short, [[] for _ in range(grid.edp)], load, 0.0), None


def coupled_replicated(segments: list[Segment], grid: DeviceGrid,
                       shard_of: np.ndarray) -> tuple[Assignment, SourceOf]:
    """Each batch shard's segments on every pp=0 device of that shard (replicated over cp and tp), in
    arrival order; `redundant_cost` counts the replicas' work."""
    D = grid.num_devices
    shard, pp, cp, tp = grid.batch_shard(), grid.axis("pp"), grid.axis("cp"), grid.axis("tp")
    short: list[list[int]] = [[] for _ in range(D)]
    load = np.zeros(D)
    owners = {}
    for i, s in enumerate(segments):
        sh = _owner_shard(s, shard_of)
        for d in np.flatnonzero((shard == sh) & (pp == 0)):
            short[int(d)].append(i)
            load[int(d)] += s.cost
        owners[i] = sh
    replicas = grid.size("cp") * grid.size("tp")
    redundant = sum(s.cost for s in segments) * (replicas - 1)
    lookup = {(int(shard[d]), int(cp[d]), int(tp[d])): int(d) for d in range(D) if pp[d] == 0}

    def source_of(i: int, dst: int) -> int:
        return lookup[(owners[i], int(cp[dst]), int(tp[dst]))]

    return Assignment(short, [[] for _ in range(grid.edp)], load, redundant), source_of


PLACEMENTS = {"coupled": coupled, "coupled_replicated": coupled_replicated}


def place(mode: str, segments: list[Segment], grid: DeviceGrid,
          shard_of: np.ndarray) -> tuple[Assignment, SourceOf | None]:
    """The baseline placement named `mode` (a key of PLACEMENTS)."""
    if mode not in PLACEMENTS:
        raise ValueError(f"no baseline placement {mode!r}; known: {', '.join(PLACEMENTS)}")
    return PLACEMENTS[mode](segments, grid, shard_of)
