"""Cluster, jobs and their resource shapes (PS: p servers + w workers; SPMD: n devices), plus placement.

A job carries its own online performance models (loss curve, speed); the simulator or the executor feed
them, schedulers read them. Placement is a pure function of (allocation, current placements, cluster).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from omnijax.cluster.perf_model import LossModel, SpeedModel

# CPU cores each GPU replica needs (data loading/augmentation), per application; used by DRF's second
# resource. Image and detection pipelines decode and augment on the host; NCF/BERT barely do.
CPUS_PER_REPLICA = {"bert": 2, "cifar10": 4, "deepspeech2": 4, "imagenet": 8, "ncf": 2, "yolov3": 8}


@dataclass(frozen=True)
class Cluster:
    num_nodes: int = 16
    gpus_per_node: int = 4
    cpus_per_node: int = 32

    def __post_init__(self):
        if min(self.num_nodes, self.gpus_per_node, self.cpus_per_node) <= 0:
            raise ValueError(f"cluster sizes must be positive: {self}")

    @property
    def gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def cpus(self) -> int:
        return self.num_nodes * self.cpus_per_node


@dataclass(frozen=True)
class PSShape:
    """A parameter-server job's resources: `servers` server tasks and `workers` worker tasks."""
    servers: int
    workers: int


Kind = Literal["spmd", "ps"]


@dataclass
class Job:
    """A job's static description plus the state a scheduler may look at."""
    name: str
    arrival: float
    application: str
    batch_size: int
    requested: int                      # devices the user asked for (baselines honour it)
    total_steps: float                  # ground truth, hidden from schedulers (they see loss_model)
    kind: Kind = "spmd"
    cpus_per_replica: int = 4
    max_replicas: int = 1 << 30         # beyond this the local batch gets too small
    progress: float = 0.0               # steps done
    allocation: int = 0                 # devices now
    placement: tuple[int, ...] = ()     # devices per node now ((): not running)
    attained_service: float = 0.0       # device-seconds received so far
    started: float | None = None
    finished: float | None = None
    last_run: float = 0.0               # seconds of running since last queued (Tiresias promotion)
    waiting_since: float = 0.0
    restarts: int = 0
    resize_penalty_s: float | None = None   # this job's resize cost for the fitted model (None: its default)
    observed_step_s: float | None = None    # the last measured step time (at the placement it ran on)
    loss_model: LossModel = field(default_factory=LossModel)
    speed_model: SpeedModel = field(default_factory=SpeedModel)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)   # (time, devices, nodes)

    @property
    def nodes(self) -> int:
        return sum(1 for c in self.placement if c > 0)

    @property
    def done(self) -> bool:
        return self.finished is not None


def cap_for(job: Job, cluster: Cluster) -> int:
    return max(1, min(job.max_replicas, cluster.gpus))


def check_allocation(alloc: Mapping[str, int], jobs: Mapping[str, Job], cluster: Cluster) -> None:
    """Raise ValueError if an allocation exceeds GPU or CPU capacity, gives a job more than its
    `max_replicas`, or names unknown jobs."""
    unknown = set(alloc) - set(jobs)
    if unknown:
        raise ValueError(f"allocation names unknown jobs {sorted(unknown)}")
    if any(n < 0 for n in alloc.values()):
        raise ValueError(f"negative allocation {alloc}")
    over = {j: n for j, n in alloc.items() if n > cap_for(jobs[j], cluster)}
    if over:
        raise ValueError(f"allocation {over} exceeds those jobs' max_replicas (or the cluster): their local batch "
                         f"would fall below the smallest measured one")
    gpus = sum(alloc.values())
    cpus = sum(n * jobs[j].cpus_per_replica for j, n in alloc.items())
    if gpus > cluster.gpus or cpus > cluster.cpus:
        raise ValueError(f"allocation uses {gpus} GPUs / {cpus} CPUs > capacity {cluster.gpus} / {cluster.cpus}")


def place(alloc: Mapping[str, int], current: Mapping[str, tuple[int, ...]], cluster: Cluster,
          pack: bool = True, cpus: Mapping[str, int] | None = None,
          order: Sequence[int] | None = None) -> dict[str, tuple[int, ...]]:
    """Per-node device counts for every job with a positive allocation.

    Jobs whose count did not change keep their placement (no restart). The others are placed largest
    first: `pack` puts each on as few nodes as possible (best fit: the fullest node that still holds it,
    else the emptiest nodes first); otherwise first fit in node order. Placement never fails when the
    allocation fits the cluster's GPUs in total. CPU demand (`cpus`, per replica) is checked only in
    total (check_allocation); per-node CPU is not a placement constraint here. `order`: node preference
    among equally free nodes (a scheduler's, e.g. fast nodes first; None: node index).
    """
    free = [cluster.gpus_per_node] * cluster.num_nodes
    out: dict[str, tuple[int, ...]] = {}
    for name, n in alloc.items():
        cur = current.get(name, ())
        if n > 0 and len(cur) == cluster.num_nodes and sum(cur) == n:
            out[name] = tuple(cur)
            for i, c in enumerate(cur):
                free[i] -= c
    if any(f < 0 for f in free):
        raise ValueError("kept placements overlap")
    todo = sorted(((n, name) for name, n in alloc.items() if n > 0 and name not in out), key=lambda x: (-x[0], x[1]))
    for n, name in todo:
        counts = place_one(free, n, pack, order)
        if counts is None:
            raise ValueError(f"cannot place {name} ({n} devices): allocation exceeds capacity")
        free = [f - c for f, c in zip(free, counts)]
        out[name] = tuple(counts)
    return out


def place_one(free: Sequence[int], n: int, pack: bool = True, order: Sequence[int] | None = None) -> list[int] | None:
    """Devices per node for one job of n devices on the free-per-node list `free`; None if they do not fit.

    `pack`: the tightest single node that holds all n, else the emptiest nodes first; otherwise first fit
    in node order. `place` uses it for every job it (re)places; schedulers use it to foresee placements."""
    if n > sum(free):
        return None
    rank = list(range(len(free)))
    if order is not None:
        for r, i in enumerate(order):
            rank[i] = r
    counts = [0] * len(free)
    fits = [i for i in range(len(free)) if free[i] >= n] if pack else []
    if fits:
        counts[min(fits, key=lambda i: (free[i], rank[i]))] = n
        return counts
    left = n
    for i in sorted(range(len(free)), key=lambda i: (-free[i], rank[i])) if pack else range(len(free)):
        take = min(free[i], left)
        counts[i] += take
        left -= take
        if not left:
            break
    return counts


def nodes_for(n: int, cluster: Cluster) -> int:
    """Nodes a packed placement of n devices spans."""
    return max(1, math.ceil(n / cluster.gpus_per_node))
