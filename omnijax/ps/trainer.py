"""Parameter-server training on Ray: the cluster of actors and the driver loop.

`PSCluster` holds the actors (a pool of servers, the workers) so several runs can reuse them.
`PSTrainer` is generic over an NNX model factory, `loss_fn(model, batch) -> scalar`, an element-wise
optax optimizer and `batch_fn(step, worker, num_workers) -> batch`:

- sync mode: every step each worker pulls the blocks at version `step`, pushes its gradient; a server
  applies the mean gradient of a block once all workers' chunks arrived. The driver keeps
  `pipeline_depth` steps submitted; placement changes take effect at an agreed future step.
- async mode (bounded staleness): workers run their own iterations; a server applies each worker's
  gradient as soon as it is complete; a pull for iteration k waits until every live worker's iteration
  k-1-staleness is applied (optionally with delay compensation).

Faults: a dead worker is reported; sync mode rolls the servers back to the last consistent version and
restarts the worker; async mode retires it and continues. A dead server loses its blocks: training stops
with `PSFailure` naming the server, the step and the last checkpoint to restore from.
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from omnijax.errors import ConfigError
from omnijax.ps.blocks import checksum, forward_order, make_blocks, param_layout
from omnijax.ps.config import PSConfig, validate
from omnijax.ps.distributor import Distributor, plan_placement
from omnijax.ps.server import ParameterServer, ServerKnobs
from omnijax.ps.worker import PSWorker


class PSFailure(RuntimeError):
    """An actor died and training cannot continue from the servers' state; see `checkpoint`."""

    def __init__(self, message: str, checkpoint: str | None):
        super().__init__(message)
        self.checkpoint = checkpoint


def ensure_ray(address: str = "") -> None:
    """Connect to `address` (a cluster, `auto`, `ray://...`) or start a small local Ray."""
    import ray
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


class PSCluster:
    """The actors of one PS job: server pool `0..num_servers-1` and workers `0..num_workers-1`."""

    def __init__(self, num_workers: int, num_servers: int, address: str = ""):
        import ray
        ensure_ray(address)
        self._server_cls = ray.remote(num_cpus=0, max_concurrency=1000)(ParameterServer)
        self._worker_cls = ray.remote(num_cpus=0)(PSWorker)
        self.servers: dict[int, Any] = {}
        self.workers: list[Any] = []
        self.ensure(num_workers, num_servers)

    def ensure(self, num_workers: int, num_servers: int) -> None:
        import ray
        new = []
        for sid in range(num_servers):
            if sid not in self.servers:
                self.servers[sid] = self._server_cls.remote(sid)
                new.append(self.servers[sid].ping.remote())
        while len(self.workers) < num_workers:
            self.workers.append(self._worker_cls.remote(len(self.workers)))
            new.append(self.workers[-1].ping.remote())
        ray.get(new)

    def replace_worker(self, index: int) -> Any:
        import ray
        self.workers[index] = self._worker_cls.remote(index)
        ray.get(self.workers[index].ping.remote())
        return self.workers[index]

    def replace_server(self, sid: int) -> Any:
        import ray
        self.servers[sid] = self._server_cls.remote(sid)
        ray.get(self.servers[sid].ping.remote())
        return self.servers[sid]

    def dead(self, timeout: float = 10.0) -> tuple[list[int], list[int]]:
        """(dead worker indices, dead server ids), by pinging every actor."""
        import ray
        out: tuple[list[int], list[int]] = ([], [])
        for kind, actors in ((0, dict(enumerate(self.workers))), (1, self.servers)):
            for key, actor in actors.items():
                try:
                    ray.get(actor.ping.remote(), timeout=timeout)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    out[kind].append(key)
        return out

    def shutdown(self) -> None:
        import ray
        for actor in [*self.workers, *self.servers.values()]:
            try:
                ray.kill(actor)
            except Exception:  # already dead
                pass
        self.workers, self.servers = [], {}


class PSTrainer:
    """Drives one PS training run; see the module docstring."""

    def __init__(self, cfg: PSConfig, model_fn: Callable[[], Any], loss_fn: Callable[[Any, Any], Any],
                 optimizer: Any, batch_fn: Callable[[int, int, int], Any], cluster: PSCluster | None = None,
                 log: Callable[[str], None] | None = None):
        import cloudpickle
        import jax
        import ray
        from flax import nnx

        self.cfg = validate(cfg)
        self.log = log or (lambda msg: print(f"[ps] {msg}", flush=True))
        pool = cfg.max_servers or cfg.num_servers
        self._own_cluster = cluster is None
        self.cluster = cluster or PSCluster(cfg.num_workers, pool, cfg.address)
        self.cluster.ensure(cfg.num_workers, pool)
        self.pool = list(range(pool))
        self.optimizer = optimizer
        graphdef, params, rest = nnx.split(model_fn(), nnx.Param, ...)
        batch0 = batch_fn(0, 0, cfg.num_workers)
        order = forward_order(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch0), params)
        self.layout = param_layout(params, order)
        self.blocks = make_blocks(self.layout.total, cfg.num_blocks)
        self.block_bytes = tuple(b.nbytes for b in self.blocks)
        flat0 = self.layout.flatten(params)
        self._opt_blob = cloudpickle.dumps(optimizer)
        self._spec_blob = cloudpickle.dumps((model_fn, loss_fn, batch_fn))
        servers = self.cluster.servers
        try:
            ray.get([servers[s].configure.remote(self._opt_blob, self._knobs(s)) for s in self.pool])
        except ray.exceptions.RayActorError as exc:
            dead = self.cluster.dead()[1]
            raise PSFailure(f"ps: server(s) {dead} of the pool {self.pool} are dead; replace them with "
                            "PSCluster.replace_server(sid) or lower ps.max_servers", None) from exc
        placement = plan_placement(self.block_bytes, None, {s: 1.0 for s in self.pool}, self.pool[:cfg.num_servers])
        ray.get([servers[placement[b.index]].init_block.remote(b.index, flat0[b.start:b.stop]) for b in self.blocks])
        self.workers = list(self.cluster.workers[:cfg.num_workers])
        self.live_workers = list(range(cfg.num_workers))
        ray.get([self._configure_worker(w) for w in self.workers])
        self.schedule: dict[int, tuple[int, ...]] = {0: placement}
        self.step = 0
        self.metrics: list[dict] = []
        self.events: list[dict] = []
        self.last_checkpoint: str | None = None
        self._change_at = -1
        self._next_submit = 0
        self.distributor = None
        if cfg.balance or cfg.explore_every:
            self.distributor = Distributor(
                self.block_bytes, tuple(self.pool), rebalance=cfg.balance, rebalance_every=cfg.rebalance_every,
                explore_every=cfg.explore_every, trial_steps=cfg.trial_steps, min_gain=cfg.min_gain,
                min_servers=cfg.min_servers, max_servers=pool, processing_in_cost=cfg.cost_source == "measured")

    # ------------------------------------------------------------------------------- helpers
    def _knobs(self, sid: int) -> ServerKnobs:
        c = self.cfg
        slow = sid == c.slow_server
        return ServerKnobs(mode=c.mode, num_workers=c.num_workers, staleness=c.staleness,
                           staleness_mode=c.staleness_mode, dc_lambda=c.dc_lambda,
                           link_bytes_per_s=c.link_mb_per_s * 1e6,
                           slowdown=c.slowdown if slow and c.straggler_kind == "delay" else 1.0,
                           neighbour=slow and c.straggler_kind == "neighbour")

    def _configure_worker(self, worker: Any) -> Any:
        worker.set_servers.remote(self.cluster.servers)
        predict = self._opt_blob if self.cfg.staleness_mode.endswith("weight_pred") else None
        return worker.configure.remote(self._spec_blob, self.layout, self.blocks, self.cfg.num_workers,
                                       self.cfg.chunk_bytes, self.cfg.credit_bytes, predict)

    def placement_for(self, step: int) -> tuple[int, ...]:
        return self.schedule[max(s for s in self.schedule if s <= step)]

    @property
    def placement(self) -> tuple[int, ...]:
        """The newest placement (possibly scheduled for a future step)."""
        return self.schedule[max(self.schedule)]

    def active_servers(self) -> list[int]:
        return sorted(set(self.placement_for(self.step)) | set(self.placement))

    # ----------------------------------------------------------------------- placement changes
    def _schedule(self, placement: tuple[int, ...], at_step: int, reason: str) -> int:
        """Move blocks so that step `at_step` runs with `placement`; owners hand blocks over at that version."""
        import ray
        if self.cfg.mode != "sync":
            raise ConfigError("block moves and scale out/in happen at an agreed step: they need ps.mode=sync")
        if len(placement) != len(self.blocks) or any(s not in self.cluster.servers for s in placement):
            raise ConfigError(f"placement must name a server of the pool for each of {len(self.blocks)} blocks")
        old = self.placement
        servers = self.cluster.servers
        refs = [servers[old[b]].schedule_move.remote(b, at_step, servers[placement[b]], placement[b])
                for b in range(len(placement)) if old[b] != placement[b]]
        ray.get(refs)
        self.schedule[at_step] = tuple(placement)
        self._change_at = at_step
        moved = len(refs)
        self.events.append(dict(kind=reason, at_step=at_step, moved_blocks=moved, servers=sorted(set(placement))))
        self.log(f"{reason}: {moved} block(s) move at step {at_step}; servers {sorted(set(placement))}")
        return at_step

    def move_blocks(self, placement: tuple[int, ...], reason: str = "move") -> int:
        """Schedule a new placement at the next step not yet submitted (training keeps running)."""
        return self._schedule(tuple(placement), self._next_submit, reason)

    def add_server(self, sid: int | None = None) -> int:
        """Scale out: bring a pool server in and move blocks to it (balanced by bytes)."""
        current = self.placement
        spare = [s for s in self.pool if s not in set(current)]
        sid = spare[0] if sid is None else sid
        if sid in set(current) or sid not in self.pool:
            raise ConfigError(f"server {sid} is not a spare server of the pool {self.pool}")
        servers = sorted(set(current) | {sid})
        plan = plan_placement(self.block_bytes, current, {s: 1.0 for s in servers}, servers)
        return self._schedule(plan, self._next_submit, f"add_server:{sid}")

    def remove_server(self, sid: int) -> int:
        """Scale in: move every block off server `sid`; it goes back to the spare pool."""
        current = self.placement
        servers = sorted(set(current) - {sid})
        if sid not in set(current) or not servers:
            raise ConfigError(f"server {sid} is not active or is the last one")
        plan = plan_placement(self.block_bytes, [s if s != sid else -1 for s in current],
                              {s: 1.0 for s in servers}, servers)
        return self._schedule(plan, self._next_submit, f"remove_server:{sid}")

    def set_comm(self, chunk_bytes: int, credit_bytes: int) -> None:
        """Change the push chunk size and credit window (between `run`s; see ps.tuning)."""
        import dataclasses

        import ray
        if chunk_bytes < 4 or credit_bytes < chunk_bytes:
            raise ConfigError(f"chunk_bytes={chunk_bytes} must be >= 4 and credit_bytes={credit_bytes} >= chunk_bytes")
        ray.get([w.set_comm.remote(chunk_bytes, credit_bytes) for w in self.workers])
        self.cfg = dataclasses.replace(self.cfg, chunk_bytes=chunk_bytes, credit_bytes=credit_bytes)

    def set_straggler(self, sid: int, slowdown: float, neighbour: bool = False) -> None:
        import ray
        ray.get(self.cluster.servers[sid].set_straggler.remote(slowdown, neighbour))

    # -------------------------------------------------------------------------------- state
    def snapshot(self) -> dict[int, dict]:
        """Every block's params/optimizer state/version (call between `run`s: nothing in flight)."""
        import ray
        out: dict[int, dict] = {}
        for part in ray.get([self.cluster.servers[s].snapshot.remote() for s in self.active_servers()]):
            out.update(part)
        missing = [b.index for b in self.blocks if b.index not in out]
        if missing:
            raise RuntimeError(f"blocks {missing} are on no server")
        return out

    def flat_params(self) -> np.ndarray:
        snap = self.snapshot()
        out = np.empty(self.layout.total, np.float32)
        for b in self.blocks:
            out[b.start:b.stop] = snap[b.index]["param"]
        return out

    def params(self) -> Any:
        """The current parameters as the model's pytree (nnx.State of Params)."""
        import jax.numpy as jnp
        return self.layout.unflatten(jnp.asarray(self.flat_params()))

    def checksum(self) -> str:
        return checksum(self.flat_params())

    def save_checkpoint(self, path: str | None = None) -> str:
        """Save params + optimizer state of every block with orbax at the current (consistent) step."""
        import jax
        import orbax.checkpoint as ocp
        path = os.path.abspath(path or os.path.join(self.cfg.checkpoint_dir, f"step_{self.step:08d}"))
        snap = self.snapshot()
        tree = {"step": np.asarray(self.step), "params": self.flat_params(),
                "opt": {str(b): jax.device_get(snap[b]["opt"]) for b in sorted(snap)}}
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(path, tree, force=True)
        ckpt.wait_until_finished()
        self.last_checkpoint = path
        return path

    def restore(self, path: str) -> int:
        """Load a checkpoint into the servers (current placement); training resumes at its step."""
        import jax
        import jax.numpy as jnp
        import orbax.checkpoint as ocp
        import ray
        if not os.path.exists(path):
            raise ConfigError(f"checkpoint not found: {path}")
        target = {"step": np.asarray(0), "params": np.zeros(self.layout.total, np.float32),
                  "opt": {str(b.index): jax.device_get(self.optimizer.init(jnp.zeros(b.size, jnp.float32)))
                          for b in self.blocks}}
        tree = ocp.StandardCheckpointer().restore(os.path.abspath(path), target)
        step = int(tree["step"])
        servers = self.cluster.servers
        ray.get([servers[s].configure.remote(self._opt_blob, self._knobs(s)) for s in self.pool])
        placement = self.placement
        workers = {w: step for w in range(self.cfg.num_workers)}
        ray.get([servers[placement[b.index]].install.remote(
            b.index, tree["params"][b.start:b.stop], tree["opt"][str(b.index)], step, workers, {})
            for b in self.blocks])
        self.schedule = {step: placement}
        self.step = step
        self._change_at = -1
        self.log(f"restored step {step} from {path}")
        return step

    # ---------------------------------------------------------------------------------- run
    def run(self, steps: int, on_step: Callable[["PSTrainer", int], None] | None = None) -> list[dict]:
        """Train `steps` more steps (iterations per worker in async mode); returns their metrics."""
        if steps <= 0:
            raise ConfigError(f"steps={steps}: must be > 0")
        if self.cfg.mode == "async":
            return self._run_async(steps, on_step)
        return self._run_sync(steps, on_step)

    def _run_sync(self, steps: int, on_step) -> list[dict]:
        import ray
        target = self.step + steps
        first = len(self.metrics)
        depth, ce = self.cfg.pipeline_depth, self.cfg.checkpoint_every
        inflight: deque = deque()
        self._next_submit = self.step
        last = time.perf_counter()
        while self.step < target:
            stop = min(target, (self.step // ce + 1) * ce) if ce else target
            while len(inflight) < depth and self._next_submit < stop:
                s = self._next_submit
                placement = self.placement_for(s)
                inflight.append((s, [w.step.remote(s, placement) for w in self.workers]))
                self._next_submit += 1
            s, refs = inflight[0]
            try:
                results = ray.get(refs)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                self._recover_sync(inflight, exc)
                inflight.clear()
                self._next_submit = self.step
                last = time.perf_counter()
                continue
            inflight.popleft()
            self.step = s + 1
            now = time.perf_counter()
            row = dict(step=s, loss=float(np.mean([r["loss"] for r in results])), step_s=now - last,
                       servers=len(set(self.placement_for(s))),
                       compute_s=max(r["compute_s"] for r in results),
                       pull_s=max(r["pull_s"] for r in results), push_s=max(r["push_s"] for r in results))
            last = now
            self.metrics.append(row)
            if self.distributor is not None:
                self._distribute(s, row)
            if on_step is not None:
                on_step(self, s)
            if ce and self.step % ce == 0 and not inflight:
                self.save_checkpoint()
        self._next_submit = self.step
        return self.metrics[first:]

    def _distribute(self, s: int, row: dict) -> None:
        import ray
        d = self.distributor
        stats = []
        if s % self.cfg.rebalance_every == 0 or d._trial is not None:
            stats = ray.get([self.cluster.servers[sid].stats.remote() for sid in sorted(set(self.placement))])
            stats = [st for st in stats if st["blocks"]]
        d.observe(s, row["step_s"], stats)
        if self._change_at > s:  # a change is still on its way: one at a time
            return
        decision = d.decide(s, self.placement, self._next_submit)
        if decision is not None and decision.placement != self.placement:
            self._schedule(decision.placement, self._next_submit, f"{decision.reason} ({decision.detail})")
        elif decision is not None:
            self.events.append(dict(kind=decision.reason, at_step=s, detail=decision.detail))
            self.log(f"{decision.reason}: {decision.detail}")

    def _recover_sync(self, inflight: deque, exc: Exception) -> None:
        import ray
        servers = self.cluster.servers
        for sid in self.pool:
            try:
                ray.get(servers[sid].abort.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                pass
        for _, refs in inflight:  # let every in-flight step end (they fail fast now)
            ray.wait(refs, num_returns=len(refs), timeout=30)
        dead_workers, dead_servers = self.cluster.dead()
        dead_workers = [w for w in dead_workers if w < self.cfg.num_workers]
        dead_servers = [s for s in dead_servers if s in self.pool]
        step = inflight[0][0] if inflight else self.step
        if dead_servers:
            self._server_failure(dead_servers, step, exc)
        if not dead_workers:
            raise RuntimeError(f"ps: step {step} failed without a dead actor: {exc}") from exc
        versions: dict[int, int] = {}
        for part in ray.get([servers[s].versions.remote() for s in self.active_servers()]):
            versions.update(part)
        consistent = min(versions.values())
        self.log(f"worker(s) {dead_workers} died during step {step} ({type(exc).__name__}); "
                 f"rolling servers back to step {consistent} and restarting the worker(s)")
        ray.get([servers[s].rollback.remote(consistent) for s in self.active_servers()])
        for w in dead_workers:
            self.workers[w] = self.cluster.replace_worker(w)
            ray.get(self._configure_worker(self.workers[w]))
        self.events.append(dict(kind="worker_died", workers=dead_workers, at_step=step, resumed_from=consistent))
        self.step = consistent

    def _server_failure(self, dead: list[int], step: int, exc: Exception) -> None:
        lost = [b for b, s in enumerate(self.placement_for(step)) if s in dead]
        where = (f"restore the last checkpoint {self.last_checkpoint} with PSTrainer.restore()"
                 if self.last_checkpoint else "no checkpoint was saved (set ps.checkpoint_every and ps.checkpoint_dir)")
        msg = (f"ps: server(s) {dead} died during step {step}; their blocks {lost[:8]}{'...' if len(lost) > 8 else ''} "
               f"are lost, training stopped; {where}")
        self.events.append(dict(kind="server_died", servers=dead, at_step=step, checkpoint=self.last_checkpoint))
        self.log(msg)
        raise PSFailure(msg, self.last_checkpoint) from exc

    def _run_async(self, steps: int, on_step) -> list[dict]:
        import ray
        first = len(self.metrics)
        start = self.step
        target = start + steps
        placement = self.placement_for(self.step)
        next_iter = {w: start for w in self.live_workers}
        running: dict[Any, int] = {}
        t0 = time.perf_counter()

        def submit(w: int) -> None:
            if next_iter[w] < target:
                running[self.workers[w].step.remote(next_iter[w], placement)] = w
                next_iter[w] += 1

        for w in self.live_workers:
            submit(w)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            w = running.pop(done[0])
            try:
                r = ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                dead_workers, dead_servers = self.cluster.dead()
                if [s for s in dead_servers if s in set(placement)]:
                    self._server_failure(dead_servers, next_iter[w] - 1, exc)
                if w not in dead_workers:
                    raise
                self.live_workers.remove(w)
                ray.get([self.cluster.servers[s].retire_worker.remote(w) for s in sorted(set(placement))])
                self.events.append(dict(kind="worker_died", workers=[w], at_step=next_iter[w] - 1))
                self.log(f"worker {w} died at iteration {next_iter[w] - 1}; async mode continues with "
                         f"workers {self.live_workers}")
                if not self.live_workers:
                    raise PSFailure("ps: every worker died", self.last_checkpoint) from exc
                continue
            now = time.perf_counter()
            self.metrics.append(dict(step=r["step"], worker=w, loss=r["loss"], wall_s=now - t0,
                                     compute_s=r["compute_s"], pull_s=r["pull_s"], push_s=r["push_s"]))
            if on_step is not None:
                on_step(self, r["step"])
            submit(w)
        self.step = target
        return self.metrics[first:]

    def close(self) -> None:
        """Stop the actors if this trainer started them (a cluster passed in stays up for reuse)."""
        if self._own_cluster:
            self.cluster.shutdown()
