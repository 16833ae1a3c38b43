"""SPMD pipeline parallelism over the ``pp`` mesh axis.

All stages run the same program: stage parameters are stacked on a leading ``stage`` axis sharded on
``pp``; every iteration each device runs its stage on the microbatch it holds, then the activations move
one stage forward with ``ppermute``. The whole schedule is one ``lax.scan``, differentiated by JAX (the
backward pass is the reversed rotation), so it compiles once whatever the number of steps.

Schedules:
- ``gpipe``: ``L`` layers split into ``S`` contiguous stages; ``M + S - 1`` iterations.
- ``circular`` (interleaved): device ``s`` holds virtual stages ``s, s+S, ..., s+(R-1)S`` of ``L/(S*R)``
  layers each; a microbatch loops ``R`` times around the ring; ``R*M + S - 1`` iterations with the same
  ``S - 1`` fill/drain, so the bubble shrinks by ``R``. Needs ``M >= S``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.models.llm import remat_mode, remat_policy


@dataclass(frozen=True)
class Schedule:
    """Static pipeline schedule; pure, so it can be checked without devices."""

    stages: int
    microbatches: int
    repeats: int = 1  # > 1: circular / interleaved

    @property
    def kind(self) -> str:
        return "circular" if self.repeats > 1 else "gpipe"

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Idle share of stage-iterations: (S-1) / (R*M + S-1)."""
        return (self.stages - 1) / self.iterations

    def item(self, t: int, s: int) -> tuple[int, int] | None:
        """(microbatch, repeat) that stage ``s`` works on at iteration ``t``, or None in the bubble."""
        k = t - s
        if k < 0 or k >= self.repeats * self.microbatches:
            return None
        return k % self.microbatches, k // self.microbatches

    def virtual_stage(self, s: int, r: int) -> int:
        return r * self.stages + s


def make_schedule(kind: Literal["gpipe", "circular"], stages: int, microbatches: int, num_layers: int,
                  repeats: int = 2) -> Schedule:
    """Validate and build a schedule; ``repeats`` only applies to ``circular``."""
    if microbatches < 1:
        raise ConfigError(f"parallel.microbatches={microbatches}: must be >= 1")
    r = repeats if kind == "circular" else 1
    if kind not in ("gpipe", "circular"):
        raise ConfigError(f"parallel.pipeline_schedule={kind!r}: must be 'gpipe' or 'circular'")
    if num_layers % (stages * r):
        raise ConfigError(f"model.num_layers={num_layers} is not divisible by pp={stages}"
                          + (f" x circular repeats={r}" if r > 1 else ""))
    if r > 1 and microbatches < stages:
        raise ConfigError(f"parallel.microbatches={microbatches}: the circular schedule needs at least "
                          f"pp={stages} microbatches")
    return Schedule(stages, microbatches, r)


def stack_layers(layers: list[Any], schedule: Schedule) -> Any:
    """Stack per-layer pytrees into ``[S, R, L/(S*R), ...]`` so device s, repeat r holds virtual stage rS+s."""
    S, R = schedule.stages, schedule.repeats
    per = len(layers) // (S * R)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)  # [L, ...], layer v*per+j
    return jax.tree.map(lambda a: a.reshape(R, S, per, *a.shape[1:]).swapaxes(0, 1), stacked)


def unstack_layers(stacked: Any, schedule: Schedule) -> list[Any]:
    """Inverse of :func:`stack_layers` (for gradients and checkpoints)."""
    flat = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), stacked)
    n = jax.tree.leaves(flat)[0].shape[0]
    return [jax.tree.map(lambda a: a[i], flat) for i in range(n)]


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]``, microbatch j = rows j, j+M, ... (keeps batch shards in place)."""
    b = x.shape[0]
    if b % m:
        raise ConfigError(f"batch of {b} sequences is not divisible by parallel.microbatches={m}")
    return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _varies(x: jax.Array, axis: str) -> bool:
    """Whether `x` is typed as varying over the manual `axis` (shard_map's per-device typing)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return axis in (mat.varying if mat is not None else getattr(t, "vma", ()))


def spmd_pipeline(stage_fn: Callable[..., tuple[jax.Array, jax.Array]], stage_params: Any, xs: jax.Array,
                  extras: Any, *, mesh: Mesh, schedule: Schedule, axis: str = "pp", remat: bool | str = True,
                  feed: tuple[Callable[[Any, jax.Array, jax.Array], jax.Array], Any, Any] | None = None,
                  skip_bubbles: bool = True) -> tuple[jax.Array, jax.Array]:
    """Run ``stage_fn(params, x, extras) -> (x, aux)`` as a pipeline; returns (outputs [M, ...], sum aux).

    ``stage_params`` leaves are ``[S, R, ...]`` (from :func:`stack_layers`); ``xs`` is ``[M, ...]`` and
    ``extras`` a pytree of ``[M, ...]`` arrays that every stage reads for its current microbatch
    (segment ids, positions). Other mesh axes stay automatic (GSPMD) inside each stage.

    ``feed = (fn, operands, specs)`` completes each microbatch's input inside the loop:
    ``fn(operands, xs[m], m) -> input of microbatch m`` (e.g. encoders writing their outputs into the
    text embeddings) runs one iteration ahead of stage 0, so microbatch ``m+1`` is prepared during
    iteration ``m``, on every device, beside the stage work instead of as a serial phase before the
    pipeline. ``specs`` are the operands' in_specs over ``axis``; ``fn`` sees this axis as manual.

    ``skip_bubbles``: a stage outside its microbatch window (pipeline fill/drain) skips its layers
    (``lax.cond`` per device), forward and backward, instead of computing on a placeholder; the
    devices it frees are what interleaved encoder work can use.
    """
    S, R, M = schedule.stages, schedule.repeats, schedule.microbatches
    if int(mesh.shape.get(axis, 1)) != S:
        raise ConfigError(f"pipeline has {S} stages but mesh axis '{axis}' has size {mesh.shape.get(axis, 1)}")
    if xs.shape[0] != M:
        raise ConfigError(f"pipeline expects {M} microbatches, got {xs.shape[0]}")
    mode = remat_mode(remat)  # none | full | save_dots (a bool reads as full / none)
    fn = stage_fn if mode == "none" else jax.checkpoint(stage_fn, policy=remat_policy(mode))
    perm = [(j, (j + 1) % S) for j in range(S)]
    T = schedule.iterations

    feed_fn, feed_ops, feed_specs = feed if feed is not None else (None, (), ())

    def body(params, xs, extras, feed_ops):
        params = jax.tree.map(lambda a: a[0], params)  # this device's [R, ...]
        s = lax.axis_index(axis)

        def prepare(m):
            return feed_fn(feed_ops, xs[m], m).astype(xs.dtype)

        def step(carry, t):
            cur, loop, aux, fed = carry
            k = t - s
            valid = (k >= 0) & (k < R * M)
            kc = jnp.clip(k, 0, R * M - 1)
            m, r = kc % M, kc // M
            if feed_fn is None:
                fresh = xs[jnp.minimum(t, M - 1)]
            else:  # this iteration's microbatch was prepared during the previous one; prepare the next
                fresh = fed
                nxt_m = jnp.minimum(t + 1, M - 1)
                fed = lax.cond(t + 1 < M, lambda: prepare(nxt_m), lambda: fed)
            first = jnp.where(t < M, fresh, loop[t % M]) if R > 1 else fresh
            inp = jnp.where(s == 0, first, cur)
            p = jax.tree.map(lambda a: a[r], params)
            ex = jax.tree.map(lambda a: a[m], extras)
            if skip_bubbles:  # a stage with no microbatch this iteration does no work (frees its devices)
                vary = lambda x: x if _varies(x, axis) else lax.pcast(x, (axis,), to="varying")  # noqa: E731
                y, a = lax.cond(valid, lambda: jax.tree.map(vary, fn(p, inp, ex)),
                                lambda: (vary(inp), vary(jnp.zeros(aux_shape.shape, aux_shape.dtype))))
            else:
                y, a = fn(p, inp, ex)
            aux = aux + jnp.where(valid, a, 0.0)
            nxt = lax.ppermute(y, axis, perm)
            if R > 1:  # stage 0 keeps what comes back from the last stage until its next lap
                back = t - (S - 1)
                slot = jnp.clip(back, 0, None) % M
                keep = (s == 0) & (back >= 0)
                loop = loop.at[slot].set(jnp.where(keep, nxt, loop[slot]))
            return (nxt, loop, aux, fed), y

        p0 = jax.tree.map(lambda a: a[0], params)
        ex0 = jax.tree.map(lambda a: a[0], extras)
        aux_shape = jax.eval_shape(lambda *a: fn(*a)[1], p0, xs[0], ex0)
        init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs) if R > 1 else jnp.zeros((1,), xs.dtype),
                jnp.zeros(aux_shape.shape, aux_shape.dtype))
        init = jax.tree.map(lambda a: lax.pcast(a, (axis,), to="varying"), init)
        if feed_fn is not None:
            fed0 = prepare(jnp.int32(0))
        else:  # an unused slot in the carry
            fed0 = lax.pcast(jnp.zeros((1,), xs.dtype), (axis,), to="varying")
        (_, _, aux, _), ys = lax.scan(step, (*init, fed0), jnp.arange(T))
        start = (R - 1) * M + S - 1  # iteration at which the last stage finishes microbatch 0's final lap
        out = jnp.where(s == S - 1, ys[start:start + M], 0.0)
        return lax.psum(out, axis), lax.psum(aux, axis)

    spec_params = jax.tree.map(lambda _: P(axis), stage_params)
    spec_extras = jax.tree.map(lambda _: P(), extras)
    # with a feed, per-device typing is off: the feed's nested shard_map (all axes manual) cannot be
    # typed against this one, and the transposes then sum every stage's cotangents as untyped SPMD does
    return jax.shard_map(body, mesh=mesh, in_specs=(spec_params, P(), spec_extras, feed_specs),
                         out_specs=(P(), P()), axis_names={axis}, check_vma=feed is None)(stage_params, xs, extras, feed_ops)
