"""Stale data parallelism: apply the all-reduced gradient one step late, with optional compensation.

Synchronous DP waits for the gradient all-reduce before the update. With staleness 1, step t+1
issues the all-reduce of step t's *local* gradients (kept unreduced, per device, in
``TrainState.extra``) inside its own ``shard_map`` over the data axes, next to its forward/backward,
which does not depend on it: XLA can overlap the collective with compute. Update rules, with
ḡ_{t-1} the all-reduced gradient of step t-1 (computed at w_{t-1}, or at ŵ_{t-1} under ``wp``):

- ``sync``:          w_{t+1} = Opt(w_t, ḡ_t(w_t))                        (the lead's step is used)
- ``stale1``:        w_{t+1} = Opt(w_t, ḡ_{t-1})                          ("PipeSGD" baseline)
- ``+dc``:           g̃ = ḡ_{t-1} + λ·ḡ_{t-1}⊙ḡ_{t-1}⊙(w_t − w_{t-1})      (delay compensation)
                     adaptive: λ_t = λ / sqrt(v_t + ε), v_t = m·v_{t-1} + (1−m)·ḡ²   (DC-ASGD-a)
- ``+wp``:           the local gradient of step t is taken at ŵ_t = Opt(w_t, R·g^local_{t-1}) — the
                     device's own freshest gradient, scaled to the global mean, predicts the
                     in-flight update; the optimizer state of that prediction is discarded.

The first ``warmup_steps`` steps are synchronous (a ``lax.cond`` on ``state.step`` selects the
branch, both inside one program). The first stale step applies the last warm-up gradient again:
every stale update uses the gradient of the previous step, with no special case.
All of it (local gradients, w_{t-1}, v) lives in ``TrainState.extra`` so checkpoints resume exactly.
Layouts: any mesh whose parameters are sharded only over ``dp``/``fsdp`` (other axes of size 1);
under FSDP the stale reduction is a reduce-scatter over ``fsdp`` plus an all-reduce over ``dp``, and
each device keeps its full-size local gradient for one step (inherent to delaying the reduction).
The loss runs inside this module's own ``shard_map`` on whole local rows, so placements whose loss
needs TP/CP/PP/EP collectives are rejected (``data_axes``), not silently mis-run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.train.state import TrainState
from omnijax.train.step import LossFn, apply_update, loss_and_grads

MODES = ("sync", "stale1", "stale1+dc", "stale1+wp", "stale1+dc+wp")
DATA_AXES = ("dp", "fsdp")


@dataclass(frozen=True)
class StalenessSpec:
    """What a stale step does; built from TrainerConfig by `from_trainer`."""

    mode: str = "stale1"
    dc_lambda: float = 0.04
    dc_adaptive: bool = False
    warmup_steps: int = 10
    dc_momentum: float = 0.95   # DC-ASGD-a's moving average of ḡ²
    dc_eps: float = 1e-7

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"trainer.staleness={self.mode!r}: must be one of {', '.join(MODES)}")
        if self.dc_lambda < 0 or self.warmup_steps < 0:
            raise ConfigError("trainer.dc_lambda and trainer.stale_warmup_steps must be >= 0")

    @property
    def stale(self) -> bool:
        return self.mode != "sync"

    @property
    def dc(self) -> bool:
        return "+dc" in self.mode

    @property
    def wp(self) -> bool:
        return "+wp" in self.mode

    @classmethod
    def from_trainer(cls, tcfg: Any) -> "StalenessSpec":
        return cls(mode=tcfg.staleness, dc_lambda=tcfg.dc_lambda, dc_adaptive=tcfg.dc_adaptive,
                   warmup_steps=tcfg.stale_warmup_steps)


# ------------------------------------------------------------------------------ layout helpers
def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes the batch is split over; other axes must be trivial (size 1)."""
    bad = [a for a in mesh.axis_names if a not in DATA_AXES and mesh.shape[a] > 1]
    if bad:
        raise ConfigError(f"trainer.staleness needs a data-parallel layout (dp/fsdp only); mesh has {bad} > 1: "
                          "set parallel.llm to e.g. dp8 or dp2xfsdp4, or trainer.staleness=sync")
    axes = tuple(a for a in mesh.axis_names if a in DATA_AXES)
    if not axes:
        raise ConfigError(f"trainer.staleness: mesh axes {mesh.axis_names} have no 'dp' or 'fsdp' axis")
    return axes


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _pad_spec(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def gather_full(x: jax.Array, spec: P) -> jax.Array:
    """Inside shard_map: the whole array from its shard (tiled all-gather on each sharded dim)."""
    for dim, entry in enumerate(_pad_spec(spec, x.ndim)):
        axes = _spec_axes(entry)
        if axes:
            x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
    return x


def reduce_to_shard(g: jax.Array, spec: P, axes: tuple[str, ...]) -> jax.Array:
    """Inside shard_map: sum a full local gradient over `axes`, leaving it sharded as `spec` says
    (reduce-scatter over the axes that shard it, all-reduce over the rest)."""
    padded = _pad_spec(spec, g.ndim)
    sharding_axes = {a for e in padded for a in _spec_axes(e)}
    rest = tuple(a for a in axes if a not in sharding_axes)
    for dim, entry in enumerate(padded):
        names = _spec_axes(entry)
        if names:
            g = jax.lax.psum_scatter(g, names if len(names) > 1 else names[0], scatter_dimension=dim, tiled=True)
    if rest:
        g = jax.lax.psum(g, rest)
    return g


# ------------------------------------------------------------------------------ the step
def init_extra(params: Any, spec: StalenessSpec, replicas: int) -> dict:
    """Stale state: per-replica local gradients [R, ...], w_{t-1} (dc), mean square of ḡ (adaptive dc)."""
    zeros = lambda x, lead=(): jnp.zeros(lead + x.shape, x.dtype)
    extra = {"local_grads": jax.tree.map(lambda x: zeros(x, (replicas,)), params)}
    if spec.dc:
        extra["prev_params"] = jax.tree.map(jnp.copy, params)
    if spec.dc and spec.dc_adaptive:
        extra["grad_sq"] = jax.tree.map(zeros, params)
    return extra


def compensate(g: Any, params: Any, prev_params: Any, lam: Any) -> Any:
    """Delay compensation g + λ·g⊙g⊙(w_t − w_{t−1}); `lam` is a tree like g (per-element λ)."""
    return jax.tree.map(lambda gi, w, wp, l: gi + l * gi * gi * (w - wp), g, params, prev_params, lam)


def make_stale_step(graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    mesh: Mesh, param_specs: Any, opt_specs: Any, spec: StalenessSpec, *,
                    grad_accum: int = 1, compute_dtype: jnp.dtype = jnp.float32,
                    aux_weights: dict[str, float] | None = None,
                    reduce_fn: Callable[[Any, Any], Any] | None = None,
                    state_shardings: Any = None) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Build `step(state, batch) -> (state, metrics)` for a stale mode (`state.extra` from `init_extra`).

    With mode "sync" it is the explicit-collective synchronous step (every step reduces its own fresh
    gradients through `reduce_fn`): the baseline for scheduled communication. The Trainer's sync mode
    keeps the lead's GSPMD step.

    `param_specs`/`opt_specs`: PartitionSpec trees of params / optimizer state on `mesh`.
    `reduce_fn(local_grads, param_specs)`: the gradient reduction used inside shard_map (default:
    per-tensor psum / psum_scatter; `omnijax.parallel.comm` supplies bucketed, ordered schedules).
    """
    axes = data_axes(mesh)
    replicas = 1
    for a in axes:
        replicas *= mesh.shape[a]
    aux_weights = aux_weights or {}
    reduce_fn = reduce_fn or (lambda g, specs: jax.tree.map(lambda x, s: reduce_to_shard(x, s, axes), g, specs))
    batch_spec = P(axes)
    lead_specs = jax.tree.map(lambda s: P(axes), param_specs)

    def local_grads(w, batch):
        """Local gradient of this device's rows of the global-mean loss (sums over devices to ḡ)."""
        total = jnp.maximum(jax.lax.psum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), axes), 1.0)
        return loss_and_grads(graphdef, rest, loss_fn, w, batch, grad_accum=grad_accum, compute_dtype=compute_dtype,
                              aux_weights={k: v / replicas for k, v in aux_weights.items()}, total=total)

    def body(stale: bool):
        def run(params, opt_state, prev_local, batch):
            w = jax.tree.map(gather_full, params, param_specs)
            prev = jax.tree.map(lambda x: x[0], prev_local)
            w_eval = w
            if stale and spec.wp:
                opt_full = jax.tree.map(gather_full, opt_state, opt_specs)
                guess = jax.tree.map(lambda x: x * replicas, prev)
                updates, _ = optimizer.update(guess, opt_full, w)   # prediction's state discarded
                w_eval = optax.apply_updates(w, updates)
            loss, g, aux = local_grads(w_eval, batch)
            # The stale reduction reads only last step's buffer: nothing here waits for this step's compute.
            reduced = reduce_fn(prev if stale else g, param_specs)
            loss = jax.lax.psum(loss, axes)
            aux = jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)
            return loss, aux, jax.tree.map(lambda x: x[None], g), reduced

        return jax.shard_map(run, mesh=mesh, in_specs=(param_specs, opt_specs, lead_specs, batch_spec),
                             out_specs=(P(), P(), lead_specs, param_specs), check_vma=False)

    def branch(stale: bool):
        sm = body(stale)

        def fn(state: TrainState, batch: dict):
            extra = state.extra
            loss, aux, new_local, g = sm(state.params, state.opt_state, extra["local_grads"], batch)
            new_extra = {"local_grads": new_local}
            if spec.dc:
                if spec.dc_adaptive:
                    m = spec.dc_momentum
                    sq = jax.tree.map(lambda v, x: m * v + (1 - m) * x * x, extra["grad_sq"], g)
                    new_extra["grad_sq"] = sq
                    lam = jax.tree.map(lambda v: spec.dc_lambda / jnp.sqrt(v + spec.dc_eps), sq)
                else:
                    lam = jax.tree.map(lambda _: jnp.float32(spec.dc_lambda), g)
                if stale:
                    g = compensate(g, state.params, extra["prev_params"], lam)
                new_extra["prev_params"] = state.params
            grad_norm = optax.tree.norm(g)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            new_state = apply_update(state, g, optimizer, finite).replace(extra=new_extra)
            metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": jnp.sum(batch["loss_mask"]),
                       "update_skipped": 1 - finite.astype(jnp.int32),
                       "nonfinite_in_row": new_state.nonfinite_in_row,
                       "stale": jnp.asarray(int(stale), jnp.int32), **aux}
            return new_state, metrics

        return fn

    stale_fn, sync_fn = branch(True), branch(False)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if not spec.stale:
            new_state, metrics = sync_fn(state, batch)
        elif spec.warmup_steps == 0:
            new_state, metrics = stale_fn(state, batch)
        else:
            new_state, metrics = jax.lax.cond(state.step < spec.warmup_steps, sync_fn, stale_fn, state, batch)
        if state_shardings is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
        return new_state, metrics

    return step


def stale_state_shardings(state: TrainState, mesh: Mesh, param_specs: Any, opt_specs: Any) -> TrainState:
    """NamedShardings for a stale TrainState: params/opt as given, local gradients split on their lead axis."""
    axes = data_axes(mesh)
    ns = lambda s: NamedSharding(mesh, s)
    extra = {"local_grads": jax.tree.map(lambda s: ns(P(axes)), param_specs)}
    for key in ("prev_params", "grad_sq"):
        if key in state.extra:
            extra[key] = jax.tree.map(ns, param_specs)
    return TrainState(step=ns(P()), params=jax.tree.map(ns, param_specs), opt_state=jax.tree.map(ns, opt_specs),
                      nonfinite_in_row=ns(P()), skipped_updates=ns(P()), extra=extra)


def _specs_of(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec if isinstance(s, NamedSharding) else P(), shardings)


def make_stale_train_step(tcfg: Any, graphdef: nnx.GraphDef, rest: Any, loss_fn: LossFn,
                          optimizer: optax.GradientTransformation, placement: Any, state: TrainState, *,
                          compute_dtype: jnp.dtype = jnp.float32, aux_weights: dict[str, float] | None = None,
                          reduce_fn: Callable | None = None) -> tuple[TrainState, Callable]:
    """The Trainer's entry: (placed state with stale `extra`, step) for `tcfg.staleness`.

    `placement` gives the mesh and the parameter/optimizer shardings (DataParallel or a dp/fsdp layout).
    """
    spec = StalenessSpec.from_trainer(tcfg)
    mesh = placement.mesh
    axes = data_axes(mesh)
    replicas = 1
    for a in axes:
        replicas *= mesh.shape[a]
    base = placement.state_shardings(state)
    param_specs = _specs_of(state.params, base.params)
    opt_specs = _specs_of(state.opt_state, base.opt_state)
    state = state.replace(extra=init_extra(state.params, spec, replicas))
    shardings = stale_state_shardings(state, mesh, param_specs, opt_specs)
    placed = jax.device_put(state, shardings)
    step = make_stale_step(graphdef, rest, loss_fn, optimizer, mesh, param_specs, opt_specs, spec,
                           grad_accum=tcfg.grad_accum, compute_dtype=compute_dtype, aux_weights=aux_weights,
                           reduce_fn=reduce_fn, state_shardings=shardings)
    return placed, step
