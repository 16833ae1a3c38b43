"""Scheduled gradient communication: partitioned, fused, priority-ordered, credit-bounded collectives.

Planning is pure and host-side (property-testable):
- `partition`: tensors larger than `partition_bytes` are cut into chunks of at most that size, so a
  huge embedding does not hold the link while small, urgent tensors wait behind it;
- `dp_buckets`: consecutive chunks (in the order they become ready) are fused into buckets chosen by
  dynamic programming. With one link, bucket k can start at max(link free, its last chunk ready) and
  takes α + β·bytes; the DP over prefixes minimises the finish time of the last collective, i.e. the
  communication exposed after the backward pass (prefix finish times are monotone, so the prefix
  optimum is optimal);
- issue order = (ready time, priority): with equal readiness (stale DP: everything is ready at the
  start of the step) the tensors the next forward needs first go first.

Execution (`scheduled_psum`, inside `shard_map`): each bucket is one flat all-reduce; a chain of
ties (a data dependency, or an `optimization_barrier`) makes bucket k's input depend on the *result*
of bucket k−`in_flight`: at most
`in_flight` collectives are outstanding, and bucket k cannot start before bucket k−`in_flight` is done
(with in_flight=1 the plan's order is exactly the program's order; data dependencies cannot force the
order of *starts* inside a wider window). The result is the same sum as a plain per-tensor `psum`,
element by element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.errors import ConfigError


# --------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class LinkModel:
    """Ring all-reduce over `n` ranks: α + 2(n−1)/n · bytes / bandwidth."""

    n: int = 8
    bandwidth_Bps: float = 50e9
    latency_s: float = 10e-6

    def allreduce_s(self, nbytes: float) -> float:
        if self.n <= 1:
            return 0.0
        return self.latency_s + 2.0 * (self.n - 1) / self.n * nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class TensorInfo:
    """One gradient tensor: size, when the backward produces it, and where the forward uses it."""

    name: str
    size: int                 # elements
    itemsize: int = 4
    dtype: str = "float32"
    ready_s: float = 0.0      # time (from the start of the backward) when the gradient is complete
    fwd_index: int = 0        # position of its first use in the forward (0 = needed first)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(frozen=True)
class Chunk:
    leaf: int                 # index of the tensor (in the plan's tensor list)
    start: int                # element range [start, stop) of the flattened tensor
    stop: int
    itemsize: int
    dtype: str
    ready_s: float
    fwd_index: int

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.itemsize


@dataclass(frozen=True)
class Bucket:
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def size(self) -> int:
        return sum(c.stop - c.start for c in self.chunks)

    @property
    def ready_s(self) -> float:
        return max(c.ready_s for c in self.chunks)

    @property
    def priority(self) -> int:
        return min(c.fwd_index for c in self.chunks)


@dataclass(frozen=True)
class CommConfig:
    """Knobs of the schedule (what the tuner searches)."""

    bucket_bytes: int = 4 << 20      # largest fused bucket (0 = unbounded)
    partition_bytes: int = 16 << 20  # split tensors above this (0 = never)
    in_flight: int = 2               # collectives outstanding at once (0 = unbounded)
    priority: bool = True            # order equal-readiness buckets by forward use
    tie: str = "data"                # how the in-flight bound is enforced: "data" | "barrier" (see _tie)

    def __post_init__(self):
        if min(self.bucket_bytes, self.partition_bytes, self.in_flight) < 0:
            raise ConfigError(f"comm: bucket_bytes, partition_bytes, in_flight must be >= 0, got {self}")
        if self.tie not in ("data", "barrier"):
            raise ConfigError(f"comm.tie={self.tie!r}: must be 'data' or 'barrier'")


@dataclass(frozen=True)
class CommPlan:
    tensors: tuple[TensorInfo, ...]
    buckets: tuple[Bucket, ...]      # in issue order
    config: CommConfig
    finish_s: float                  # predicted end of the last collective
    exposed_s: float                 # finish_s − end of compute (≥ 0)

    def bucket_sizes(self) -> list[int]:
        return [b.size for b in self.buckets]


# ------------------------------------------------------------------------------ pure planning
def partition(tensors: Sequence[TensorInfo], partition_bytes: int) -> list[Chunk]:
    """Chunks of every tensor, at most `partition_bytes` each (0: whole tensors). Chunks of one tensor
    inherit its readiness and priority."""
    out = []
    for i, t in enumerate(tensors):
        if t.size <= 0:
            raise ConfigError(f"comm: tensor {t.name!r} has size {t.size}")
        per = t.size if partition_bytes <= 0 else max(1, partition_bytes // t.itemsize)
        for start in range(0, t.size, per):
            out.append(Chunk(i, start, min(t.size, start + per), t.itemsize, t.dtype, t.ready_s, t.fwd_index))
    return out


def issue_order(chunks: Sequence[Chunk], priority: bool = True) -> list[Chunk]:
    """Order in which chunks can go: by readiness, ties by forward use (if `priority`), then position."""
    key = (lambda c: (c.ready_s, c.fwd_index, c.leaf, c.start)) if priority else (lambda c: (c.ready_s, c.leaf, c.start))
    return sorted(chunks, key=key)


def dp_buckets(chunks: Sequence[Chunk], cost: Callable[[float], float], max_bytes: int = 0
               ) -> tuple[list[tuple[int, int]], float]:
    """Split `chunks` (already in issue order) into contiguous buckets minimising the finish time of
    the last collective on one link. Returns ([(begin, end), ...], finish time). Buckets never mix
    dtypes and never exceed `max_bytes` (0 = unbounded; a single chunk may exceed it)."""
    n = len(chunks)
    if n == 0:
        return [], 0.0
    nbytes = np.array([c.nbytes for c in chunks], np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(nbytes)])
    best = [0.0] + [math.inf] * n
    arg = [0] * (n + 1)
    for k in range(1, n + 1):
        ready = chunks[k - 1].ready_s
        for j in range(k - 1, -1, -1):
            size = prefix[k] - prefix[j]
            if j < k - 1 and ((max_bytes and size > max_bytes) or chunks[j].dtype != chunks[k - 1].dtype):
                break
            t = max(best[j], ready) + cost(size)
            if t < best[k]:
                best[k], arg[k] = t, j
    segs, k = [], n
    while k > 0:
        segs.append((arg[k], k))
        k = arg[k]
    return segs[::-1], best[n]


def simulate(buckets: Sequence[Bucket], cost: Callable[[float], float]) -> float:
    """Finish time of buckets issued in order on one link, each when ready and the link is free."""
    t = 0.0
    for b in buckets:
        t = max(t, b.ready_s) + cost(b.nbytes)
    return t


def plan_comm(tensors: Sequence[TensorInfo], link: LinkModel, config: CommConfig = CommConfig()) -> CommPlan:
    """Partition, order and fuse gradient tensors into a deterministic schedule."""
    chunks = issue_order(partition(tensors, config.partition_bytes), config.priority)
    segs, finish = dp_buckets(chunks, link.allreduce_s, config.bucket_bytes)
    buckets = tuple(Bucket(tuple(chunks[a:b])) for a, b in segs)
    compute_end = max((t.ready_s for t in tensors), default=0.0)
    return CommPlan(tuple(tensors), buckets, config, finish, max(0.0, finish - compute_end))


def per_tensor_plan(tensors: Sequence[TensorInfo], link: LinkModel) -> CommPlan:
    """Reference: one collective per tensor in readiness order (no fusion, no partitioning)."""
    chunks = issue_order(partition(tensors, 0), priority=False)
    buckets = tuple(Bucket((c,)) for c in chunks)
    finish = simulate(buckets, link.allreduce_s)
    end = max((t.ready_s for t in tensors), default=0.0)
    return CommPlan(tuple(tensors), buckets, CommConfig(0, 0, 0, False), finish, max(0.0, finish - end))


# ----------------------------------------------------------------------- describing a model
def forward_use_order(loss_of_params: Callable[[Any], Any], params: Any) -> list[int]:
    """Leaf indices of `params` sorted by the first equation of the traced loss that reads them."""
    leaves, treedef = jax.tree.flatten(params)
    closed = jax.make_jaxpr(lambda *ls: loss_of_params(jax.tree.unflatten(treedef, list(ls))))(*leaves)
    jaxpr = closed.jaxpr
    position = {id(v): i for i, v in enumerate(jaxpr.invars)}
    first: dict[int, int] = {}
    for n, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            i = position.get(id(v))
            if i is not None and i not in first:
                first[i] = n
    return sorted(range(len(leaves)), key=lambda i: (first.get(i, len(jaxpr.eqns)), i))


def describe_grads(params: Any, *, fwd_order: Sequence[int] | None = None, backward_s: float = 0.0,
                   all_ready: bool = False) -> list[TensorInfo]:
    """TensorInfo per leaf of `params` (flatten order). Backward time is spread over tensors in
    proportion to their size (dense layers: backward FLOPs ∝ parameters), last-used first; with
    `all_ready` every gradient is ready at 0 (the stale step: last step's local gradients)."""
    leaves = jax.tree.leaves(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    order = list(fwd_order) if fwd_order is not None else list(range(len(leaves)))
    rank = {leaf: r for r, leaf in enumerate(order)}
    sizes = [int(np.prod(x.shape)) for x in leaves]
    total = float(sum(sizes)) or 1.0
    ready = {}
    t = 0.0
    for leaf in reversed(order):           # the backward visits the last-used tensor first
        t += backward_s * sizes[leaf] / total
        ready[leaf] = 0.0 if all_ready else t
    return [TensorInfo(paths[i], sizes[i], jnp.dtype(leaves[i].dtype).itemsize, str(jnp.dtype(leaves[i].dtype)),
                       ready[i], rank[i]) for i in range(len(leaves))]


# -------------------------------------------------------------------------------- execution
def _tie(buf: jax.Array, done: jax.Array, how: str) -> jax.Array:
    """`buf`, made to depend on the finished collective `done`.

    "barrier": an optimization_barrier over both, with the result routed through it so the tie stays
    live; XLA:GPU keeps it, but XLA:CPU expands barriers away before scheduling (checked with jaxlib
    0.10.2). "data": buf + 0·done[0], a true data dependency every backend schedules by; it changes no
    finite value (a non-finite `done` poisons `buf`, and the step's finite guard skips the update anyway).
    """
    if how == "barrier":
        buf, _ = jax.lax.optimization_barrier((buf, done))
        return buf
    return buf + jnp.zeros((), buf.dtype) * done[0].astype(buf.dtype)


def scheduled_psum(grads: Any, plan: CommPlan, axes: str | tuple[str, ...]) -> Any:
    """Inside shard_map: psum of every leaf of `grads`, executed as `plan` says. Same values as
    `jax.tree.map(lambda g: psum(g, axes), grads)`."""
    leaves, treedef = jax.tree.flatten(grads)
    if len(leaves) != len(plan.tensors):
        raise ConfigError(f"comm plan has {len(plan.tensors)} tensors, gradients have {len(leaves)}")
    for x, t in zip(leaves, plan.tensors):
        if int(np.prod(x.shape)) != t.size:
            raise ConfigError(f"comm plan tensor {t.name!r} has {t.size} elements, gradient has shape {x.shape}")
    flat = [x.reshape(-1) for x in leaves]
    results: list[jax.Array] = []
    credit = plan.config.in_flight
    for k, bucket in enumerate(plan.buckets):
        parts = [flat[c.leaf][c.start:c.stop] for c in bucket.chunks]
        buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        if credit and k >= credit:
            buf = _tie(buf, results[k - credit], plan.config.tie)
        results.append(jax.lax.psum(buf, axes))
    pieces: dict[int, list[tuple[int, jax.Array]]] = {i: [] for i in range(len(leaves))}
    for bucket, red in zip(plan.buckets, results):
        offset = 0
        for c in bucket.chunks:
            n = c.stop - c.start
            pieces[c.leaf].append((c.start, red[offset:offset + n]))
            offset += n
    out = []
    for i, x in enumerate(leaves):
        got = [p for _, p in sorted(pieces[i], key=lambda s: s[0])]
        out.append((got[0] if len(got) == 1 else jnp.concatenate(got)).reshape(x.shape))
    return jax.tree.unflatten(treedef, out)


def make_reduce_fn(plan: CommPlan, axes: str | tuple[str, ...]) -> Callable[[Any, Any], Any]:
    """A `reduce_fn(grads, specs)` for `omnijax.train.staleness.make_stale_step` (replicated params)."""
    from jax.sharding import PartitionSpec as P

    def reduce_fn(grads: Any, specs: Any) -> Any:
        if any(tuple(s) for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
            raise ConfigError("scheduled gradient communication needs replicated parameters (dp layout); "
                              "FSDP layouts reduce-scatter per tensor")
        return scheduled_psum(grads, plan, axes)

    return reduce_fn


CPU_INSPECT_OPTIONS = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
"""Compiler options that keep XLA:CPU from merging our buckets (for HLO inspection in tests)."""


def load_tuned(path: str) -> tuple[CommConfig, dict]:
    """(CommConfig, XLA flags) from a `comm_tuned.yaml` written by `python -m recipes tune_comm`."""
    from pathlib import Path

    import yaml

    from omnijax.config import from_dict

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"comm settings file {path} not found: run `python -m recipes tune_comm` first")
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw.get("comm"), dict):
        raise ConfigError(f"{path}: expected a 'comm:' mapping (bucket_bytes, partition_bytes, in_flight)")
    return from_dict(CommConfig, raw["comm"], prefix="comm."), dict(raw.get("xla_flags") or {})
