"""The training loop: step, progress bar, metrics, evaluation, checkpoints, preemption, guards."""
from __future__ import annotations

import functools
import json
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax import allocator
from omnijax.config import Config, to_dict
from omnijax.errors import UserError
from omnijax.train import metrics as metrics_lib
from omnijax.train.checkpoint import Checkpointer, CheckpointSaveError, abstract_like
from omnijax.train.distributed import EXIT_DIVERGED, EXIT_PREEMPTED
from omnijax.models import adapters
from omnijax.train.optimizer import learning_rate_schedule, make_optimizer
from omnijax.train.parts import Partition
from omnijax.train.placement import DataParallel
from omnijax.data.payload import global_layout
from omnijax.layers.remat import use_remat
from omnijax.train.prefetch import Prefetcher
from omnijax.train.watchdog import HangWatch

HOST_KEYS = ("payload_bytes_decoded", "payload_bytes_step", "host_wait_s", "skipped_bad_records", "samples",
             "model_tflops")
from omnijax.train.state import TrainState, sharded_init, sharded_opt_init
from omnijax.train.step import LossFn, make_train_step
from omnijax.utils import runs_root


class Loader(Protocol):
    """What the trainer needs from a data loader: host batches plus a small resumable state."""

    def __next__(self) -> dict: ...
    def get_state(self) -> dict: ...
    def set_state(self, state: dict) -> None: ...


class NonFiniteError(UserError):
    """trainer.max_nonfinite_in_row skipped updates in a row: the run diverged. Exits EXIT_DIVERGED, which
    `recipes launch` does not restart (the same command would diverge the same way)."""

    exit_code = EXIT_DIVERGED

    def __init__(self, message: str, step: int = 0, first_bad: int = 0):
        super().__init__(message)
        self.step, self.first_bad = step, first_bad


@dataclass
class FitResult:
    state: TrainState
    history: list[dict] = field(default_factory=list)
    status: str = "finished"     # finished | preempted
    eval: dict | None = None

    @property
    def exit_code(self) -> int:
        """What the process should exit with: 0 only for a run that finished. A preempted run saved and
        stopped early; EXIT_PREEMPTED tells Kubernetes, Slurm and `recipes launch` that it did not finish."""
        return 0 if self.status == "finished" else EXIT_PREEMPTED


class _Preemption:
    """Turns SIGTERM/SIGINT into a flag the loop checks between steps (then it saves and stops).

    With several processes the stop must come at the same step everywhere (the save is collective; a
    process that stopped alone would leave the others waiting in the next step's collectives), and the
    signal may reach the processes at different steps, or only some of them. The first process to see it
    writes a step AHEAD of its own to the coordination service; every process reads it between steps and
    all stop at that step. A process's loop is at most 2 steps ahead of another's (each keeps one step in
    flight, and reading a step's results waits for every process's part of it), so AHEAD=4 reaches them
    all before they pass it."""

    AHEAD = 4
    KEY = "omnijax_preempt_at"

    def __init__(self, client: Any = None):
        self.requested = False
        self._old = {}
        self.client, self.target = client, None

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def stop_at(self, step: int) -> bool:
        """Whether the loop stops (saving) after `step`: at once in one process; at the agreed step in several."""
        if self.client is None:
            return self.requested
        if self.target is None:
            got = self._read()
            if got is None and self.requested:
                try:
                    self.client.key_value_set(self.KEY, str(step + self.AHEAD))  # the first writer wins
                except Exception:  # noqa: BLE001 - another process set it first
                    pass
                got = self._read()
            self.target = int(got) if got is not None else None
        return self.target is not None and step >= self.target

    def _read(self) -> str | None:
        try:
            return self.client.key_value_try_get(self.KEY)
        except Exception:  # noqa: BLE001 - not set
            return None


def _with_remat(loss_fn: LossFn, mode: Any) -> LossFn:
    """`loss_fn` traced with `parallel.remat` in force, so encoder blocks rematerialise on every path
    (plain data parallelism too, not only where a placement enters it)."""
    @functools.wraps(loss_fn)
    def traced(model, batch):
        with use_remat(mode):
            return loss_fn(model, batch)
    return traced


class Trainer:
    """Runs `loss_fn` on `model` over batches from `loader` as the config says.

    Hooks are `hook(trainer, step, metrics)` called after each logged step (Levanter-style).
    """

    clock: Callable[[], float] = staticmethod(time.monotonic)  # what the hang watch judges by (tests inject one)

    def __init__(self, cfg: Config, model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, loader: Loader, *,
                 placement: Any | None = None, eval_fn: Callable[[Any], dict] | None = None,
                 aux_weights: dict[str, float] | None = None,
                 hooks: tuple[Callable, ...] = (), run_dir: Path | None = None,
                 eval_data: Callable[[], Any] | None = None, step_flops: Callable[[dict], float] | None = None):
        self.cfg = cfg
        if jax.process_index() == 0:
            print(f"omnijax: {cfg.trainer.run_name} on {jax.device_count()} {jax.devices()[0].platform} device(s) in "
                  f"{jax.process_count()} process(es), {allocator.describe()}", file=sys.stderr)
        self.loader = loader
        self.eval_fn = eval_fn
        self.eval_data = eval_data  # () -> iterable of held-out host batches: `eval_loss` in the metrics
        self.step_flops = step_flops  # host batch -> model FLOPs on its real segment lengths (metrics.FlopCounter)
        loss_fn = _with_remat(loss_fn, cfg.parallel.remat)
        self.loss_fn = loss_fn
        self._eval_step = None
        self._consumed: Mapping | None = None  # loader state after the last consumed batch (maybe lazy)
        self._placed: dict = {}  # placement state (e.g. encoder capacities) once the last consumed batch was placed
        self.hooks = hooks
        self.placement = placement or DataParallel()
        self.run_dir = run_dir or runs_root() / cfg.trainer.run_name
        model = adapters.attach(model, getattr(cfg.trainer, "lora", None), cfg.trainer.seed)  # trainer.lora
        self.partition = self._partition(model)
        self.optimizer = make_optimizer(cfg.optimizer, cfg.trainer.steps, self.partition)
        self.lr_schedule = learning_rate_schedule(cfg.optimizer, cfg.trainer.steps)
        state = self._initial_state(model)
        trainable = None if self.partition.is_trivial else self.partition.mask()
        if cfg.trainer.staleness != "sync":  # stale data parallelism: omnijax/train/staleness.py
            if self.partition.frozen:
                raise UserError(f"trainer.staleness={cfg.trainer.staleness} with frozen parts "
                                f"({', '.join(self.partition.frozen)}) is not supported; use trainer.staleness=sync")
            from omnijax.train.staleness import make_stale_train_step

            self.state, step = make_stale_train_step(
                cfg.trainer, self.graphdef, self.rest, loss_fn, self.optimizer, self.placement, state,
                compute_dtype=jnp.dtype(cfg.trainer.compute_dtype), aux_weights=aux_weights)
        else:
            self.state = state
            step = make_train_step(self.graphdef, self.rest, loss_fn, self.optimizer,
                                   grad_accum=cfg.trainer.grad_accum, aux_weights=aux_weights,
                                   compute_dtype=jnp.dtype(cfg.trainer.compute_dtype),
                                   state_shardings=self.placement.state_shardings(state),
                                   grads_fn=getattr(self.placement, "grads_fn", lambda _: None)(loss_fn),
                                   trainable=trainable)
        self._step = jax.jit(step, donate_argnums=0)
        self.checkpointer = (Checkpointer(self.run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
                             if cfg.trainer.checkpoint_every else None)
        self.peer_watch = None
        if jax.process_count() > 1:  # losing a peer: one line per survivor, native dumps into the run folder
            from omnijax.train.distributed import native_log, peer_watch, redirect_native_stderr

            redirect_native_stderr(native_log(self.run_dir, jax.process_index()))
            self.peer_watch = peer_watch()

    def _last_checkpoint(self) -> str:
        """Where a rerun would resume from (for the lost-peer line)."""
        folder = self.run_dir / "checkpoints"
        steps = sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.exists() else []
        return f"step {steps[-1]} in {folder}" if steps else "none (the run starts again from step 0)"

    # ------------------------------------------------------------------------------ utilities
    def _partition(self, model: nnx.Module | Callable[[], nnx.Module]) -> Partition:
        """The parts of the model (abstractly, nothing allocated), which train (`trainer.trainable`) and
        their learning-rate scales (`optimizer.lr_scale`); printed once per run."""
        if not isinstance(model, nnx.Module) and not callable(model):   # checked before anything traces it
            raise UserError(f"Trainer(model=...) takes an nnx.Module or a function that builds one, got {type(model).__name__}")
        abstract = model if isinstance(model, nnx.Module) else nnx.eval_shape(model)
        tcfg, ocfg = self.cfg.trainer, self.cfg.optimizer
        partition = Partition(nnx.state(abstract, nnx.Param), getattr(tcfg, "trainable", None),
                              getattr(ocfg, "lr_scale", None))
        if jax.process_index() == 0 and (len(partition.parts) > 1 or partition.frozen):
            print(partition.summary(), file=sys.stderr)
        return partition

    def _initial_state(self, model: nnx.Module | Callable[[], nnx.Module]) -> TrainState:
        """Parameters and optimizer state in the placement's shardings; sets graphdef and rest.

        A constructor (`() -> module`, the module in the placement's form) is traced abstractly and
        initialised shard by shard on the devices, so nothing full-size ever sits on one device (an
        8B model's state does not fit one). A ready module's parameters are placed as they are, and only
        its optimizer state is created in place."""
        if isinstance(model, nnx.Module):
            self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
            return sharded_opt_init(self.placement.put_state(params), self.optimizer, self.placement.state_shardings)
        self.graphdef, self.rest, state = sharded_init(model, self.optimizer, self.placement.state_shardings,
                                                       self.placement.mesh)
        return state

    @property
    def model(self) -> nnx.Module:
        """The current model (fp32 master weights)."""
        return nnx.merge(self.graphdef, self.state.params, self.rest)

    def compiled_programs(self) -> int:
        size = getattr(self._step, "_cache_size", None)
        return int(size()) if callable(size) else -1

    def _restore(self) -> int:
        """Resume from trainer.resume_step, or the newest checkpoint whose checksums hold (damaged newer
        ones are set aside with one warning line each)."""
        wanted = self.cfg.trainer.resume_step
        if not self.checkpointer or self.checkpointer.latest_step() is None:
            if wanted > 0:
                raise UserError(f"trainer.resume_step={wanted}: {self.run_dir / 'checkpoints'} holds no checkpoint")
            return 0
        target = abstract_like(self.state)  # shapes and this layout's shardings
        self.state = None  # drop the fresh state before the restored one arrives: one copy on the devices
        self.state, loader_state, step = self.checkpointer.restore_good(target, wanted if wanted > 0 else None,
                                                                        config=to_dict(self.cfg))
        if loader_state:
            self.loader.set_state(loader_state)
        placed = self.checkpointer.placement_state(step)
        if placed and hasattr(self.placement, "set_state"):
            self.placement.set_state(placed)
        self._mend_metrics()
        checked = (f" (checksums verified in {self.checkpointer.verify_s:.2f} s)"
                   if self.checkpointer.has_checksums(step) else "")
        print(f"resumed from {self.checkpointer.directory} at step {step}{checked}", file=sys.stderr)
        return step

    def _mend_metrics(self) -> None:
        """Before the resumed run appends to metrics.jsonl (process 0 writes it): `metrics.mend_metrics`."""
        if jax.process_index() == 0:
            metrics_lib.mend_metrics(self.run_dir / "metrics.jsonl")

    def _save(self, step: int, force: bool = False) -> None:
        if self.checkpointer:  # the consumed position (batches prefetched beyond it are read again on resume)
            state = self._consumed if self._consumed is not None else self.loader.get_state()
            state = dict(state)  # a prefetched position (`LoaderState`) is serialized here, when it is saved
            self.checkpointer.save(step, self.state, state, placement_state=self._placed, force=force)

    # ----------------------------------------------------------------------------------- loop
    def fit(self) -> FitResult:
        tcfg = self.cfg.trainer
        start = self._restore()
        is_main = jax.process_index() == 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if is_main:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
        writer = metrics_lib.MetricsWriter(self.run_dir, enabled=is_main, append=start > 0)
        peak, device_kind = metrics_lib.device_peak_flops()
        n_dev = jax.device_count()
        history: list[dict] = []
        result = FitResult(self.state)
        bar = _progress(tcfg.steps, start, enabled=tcfg.progress and is_main)
        window_tokens = window_samples = 0
        window_flops = 0.0
        global_tokens: list = []  # the steps' own token counts (global batch, counted once), read at log time
        window_start = time.perf_counter()
        window_wait = 0.0
        pending: tuple[int, dict] | None = None
        prefetch = Prefetcher(self.loader, self.placement.put_batch, tcfg.prefetch,
                              getattr(self.placement, "metrics", None), reserve=getattr(self.placement, "reserve", None),
                              window=getattr(self.loader, "window", 1), start=start,
                              placement_state=getattr(self.placement, "get_state", None))
        if self.peer_watch is not None:
            self.peer_watch.arm(tcfg.peer_timeout_s, self._last_checkpoint)
        hang_watch = HangWatch(tcfg.hang_timeout_s, self._last_checkpoint, clock=self.clock,
                               process=jax.process_index())
        failed, diverged = False, None
        try:
            with _Preemption(self.peer_watch.client if self.peer_watch is not None else None) as preempt:
                for step in range(start + 1, tcfg.steps + 1):
                    item = next(prefetch)  # read, decoded, planned and on the devices ahead of time
                    if step == start + 1:
                        _compile_together(self._step, "train_step", self.state, item.batch)
                        hang_watch.start()  # from here a step must finish every trainer.hang_timeout_s
                    hang_watch.beat(step)
                    host_batch, self._consumed, self._placed = item.host_batch, item.loader_state, item.placement_state
                    window_wait += prefetch.wait_s
                    window_samples += (int(np.asarray(host_batch["row_docs"])[:, 0].sum()) if global_layout(host_batch)
                                       else int(np.asarray(host_batch["segment_ids"]).max(axis=-1).sum()))
                    self.state, step_metrics = self._step(self.state, item.batch)
                    if pending is not None:  # read the previous step's scalars: keeps one step in flight
                        self._check_finite(*pending)
                    pending = (step, step_metrics)
                    window_tokens += int(np.asarray(host_batch["loss_mask"]).sum())
                    global_tokens.append(step_metrics["tokens"])
                    if self.step_flops is not None:
                        window_flops += self.step_flops(host_batch)
                    last = step == tcfg.steps
                    eval_now = bool(tcfg.eval_every) and step % tcfg.eval_every == 0 and not last
                    if step % tcfg.log_every == 0 or last or eval_now:
                        m = jax.device_get(step_metrics)
                        elapsed = time.perf_counter() - window_start
                        steps_in_window = step - (history[-1]["step"] if history else start)
                        total_tokens = float(np.sum(jax.device_get(global_tokens)))
                        tok_s = total_tokens / max(elapsed, 1e-9)
                        # this host's share of the global batch (1 where every host holds it all, or carries
                        # the whole step's geometry from metadata: then its FLOPs and samples are already global)
                        share = 1.0 if global_layout(host_batch) else window_tokens / max(total_tokens, 1.0)
                        flops_s = window_flops / max(share, 1e-9) / max(elapsed, 1e-9)
                        row = {
                            "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                            "lr": float(self.lr_schedule(step - 1)),
                            "tokens_per_s": tok_s,
                            "samples_per_s": window_samples / max(share, 1e-9) / max(elapsed, 1e-9),
                            # the logged steps' samples and model TFLOPs (the whole step's, on every process)
                            "samples": window_samples / max(share, 1e-9),
                            "model_tflops": window_flops / max(share, 1e-9) / 1e12,
                            "step_time_s": elapsed / max(steps_in_window, 1),
                            "model_tflops_per_s": flops_s / 1e12,
                            "mfu": metrics_lib.mfu(flops_s, 1.0, n_dev, peak),
                            "device": device_kind,
                            "skipped_updates": int(self.state.skipped_updates),
                            "compiled_programs": self.compiled_programs(),
                            "bubble_fraction": float(getattr(self.placement, "bubble_fraction", 0.0)),
                            "host_wait_s": window_wait / max(steps_in_window, 1),
                        }
                        row.update({k: float(v) for k, v in m.items()
                                    if k not in {"loss", "grad_norm", "tokens", "update_skipped", "nonfinite_in_row"}})
                        if hasattr(self.loader, "metrics"):  # padding, skipped records
                            row.update(self.loader.metrics())
                        row.update(item.metrics)  # this batch's plan: imbalance, padding
                        if eval_now:  # beats no steps: not judged
                            hang_watch.pause(True)
                            row.update(self.evaluate(self.state.params))
                            hang_watch.pause(False)
                        writer.write(step, row)
                        if not is_main:  # per-host figures (payload bytes decoded, waits) of the other hosts
                            with open(self.run_dir / f"host{jax.process_index()}.metrics.jsonl", "a") as f:
                                f.write(json.dumps({"step": step, **{k: row[k] for k in HOST_KEYS if k in row}}) + "\n")
                        history.append({"step": step, **row})
                        for hook in self.hooks:
                            hook(self, step, row)
                        bar.update(step - bar.n)
                        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
                        window_tokens = window_samples = 0
                        window_flops = window_wait = 0.0
                        global_tokens = []
                        window_start = time.perf_counter()
                    saved = False
                    if self.checkpointer and (step % tcfg.checkpoint_every == 0 or last):
                        self._save(step, force=last)
                        saved = True
                    if preempt.stop_at(step) and not last:
                        if not saved:  # a periodic save of this very step is already under way
                            self._save(step, force=True)
                        result.status = "preempted"
                        print(f"\npreempted: saved step {step} to {self.checkpointer.directory if self.checkpointer else '(checkpointing off)'}; "
                              "run the same command again to resume", file=sys.stderr)
                        break
            if pending is not None:
                self._check_finite(*pending)
        except Exception as exc:
            failed = True
            self._peer_verdict(exc)
            diverged = exc if isinstance(exc, NonFiniteError) else None
            raise
        finally:
            hang_watch.stop()
            prefetch.close()
            bar.close()
            writer.close()
            if self.checkpointer:
                try:
                    self.checkpointer.wait()
                except CheckpointSaveError as exc:
                    if not failed:  # else the first error (already on its way) names the failed step
                        self._peer_verdict(exc)
                        raise
            if self.peer_watch is not None:
                self.peer_watch.disarm()
            if failed and diverged is not None:  # (every save has landed: the line can name the last good one)
                raise self._divergence(diverged) from None
        result.state, result.history = self.state, history
        if (self.eval_fn or self.eval_data) and result.status == "finished":
            result.eval = self.evaluate(self.state.params)
        return result

    def _peer_verdict(self, exc: BaseException) -> None:
        """A collective (or a save's) failure caused by a lost process: let the watch name it (it exits 75)."""
        from omnijax.train.distributed import peer_error

        if self.peer_watch is not None and peer_error(exc):
            self.peer_watch.verdict(self.cfg.trainer.peer_timeout_s + 5)

    def evaluate(self, params: Any) -> dict:
        """The recipe's own evaluation (eval_fn) and the held-out loss over `eval_data`."""
        out = dict(self.eval_fn(params)) if self.eval_fn else {}
        if self.eval_data is not None:
            out.update(self.held_out_loss(params))
        return out

    def held_out_loss(self, params: Any) -> dict:
        """Token-weighted mean loss over every held-out batch (same loss, placement and precision as training)."""
        if self._eval_step is None:
            from omnijax.train.step import make_eval_step

            self._eval_step = jax.jit(make_eval_step(self.graphdef, self.rest, self.loss_fn,
                                                     compute_dtype=jnp.dtype(self.cfg.trainer.compute_dtype)))
        total = count = 0.0
        for i, host_batch in enumerate(self.eval_data()):
            batch = self.placement.put_batch(host_batch)
            if i == 0:
                _compile_together(self._eval_step, "eval_step", params, batch)
            loss_sum, n = self._eval_step(params, batch)
            total, count = total + float(loss_sum), count + float(n)
        if count == 0:
            raise UserError("the held-out data (data.eval_sources) produced no loss tokens: check that its records "
                            "have text with loss (e.g. assistant turns)")
        return {"eval_loss": total / count, "eval_tokens": int(count)}

    def _check_finite(self, step: int, scalars: dict) -> None:
        in_row = int(scalars["nonfinite_in_row"])
        if in_row >= self.cfg.trainer.max_nonfinite_in_row:
            raise NonFiniteError(
                f"{in_row} non-finite losses/gradients in a row up to step {step}: updates were skipped; "
                "lower optimizer.lr, enable optimizer.grad_clip, or check the data "
                f"(trainer.max_nonfinite_in_row={self.cfg.trainer.max_nonfinite_in_row})", step, step - in_row + 1)

    def _divergence(self, exc: NonFiniteError) -> NonFiniteError:
        """The stop line of a diverged run: the last checkpoint saved before the non-finite streak began and
        the command that resumes from it with a lower learning rate. Checkpoints saved during the streak
        (same weights: every update was skipped, but a data position inside the bad stretch) are set aside,
        not deleted, so the same command resumes from the good one and can save those steps again."""
        tcfg, lr = self.cfg.trainer, self.cfg.optimizer.lr
        head = (f"training diverged: {exc.step - exc.first_bad + 1} non-finite losses/gradients in a row at steps "
                f"{exc.first_bad}..{exc.step} (trainer.max_nonfinite_in_row={tcfg.max_nonfinite_in_row}; those "
                "updates were skipped)")
        if not self.checkpointer:
            return NonFiniteError(f"{head}; checkpointing is off, so nothing to resume from: run again with a lower "
                                  f"optimizer.lr (e.g. optimizer.lr={lr / 10:g}) or optimizer.grad_clip", exc.step,
                                  exc.first_bad)
        moved = [s for s in self.checkpointer.all_steps() if s >= exc.first_bad]
        for s in moved:
            self.checkpointer.set_aside(s)
        good = self.checkpointer.all_steps()
        aside = (f" (step{'s' if len(moved) > 1 else ''} {', '.join(map(str, moved))}, saved during the streak, "
                 f"{'were' if len(moved) > 1 else 'was'} set aside in {self.checkpointer.directory}_set_aside)"
                 if moved else "")
        if not good:
            return NonFiniteError(f"{head}; no checkpoint was saved before it{aside}: run again with a lower "
                                  f"optimizer.lr (e.g. optimizer.lr={lr / 10:g}) or optimizer.grad_clip", exc.step,
                                  exc.first_bad)
        return NonFiniteError(f"{head}. Last good checkpoint: step {good[-1]} in {self.checkpointer.directory}{aside}. "
                              f"To resume from it with a lower learning rate, run the same command with "
                              f"optimizer.lr={lr / 10:g}", exc.step, exc.first_bad)


_BARRIERS = iter(range(1 << 62))


def _compile_together(jitted: Callable, name: str, *args: Any) -> None:
    """Across processes: compile ahead of time, then wait for every process before the first collective.

    Compiling can take one process much longer than another on a loaded host; the CPU collectives (gloo)
    give up connecting after ~30 s, so the wait happens on the coordination service instead (no-op
    in one process; a second call of the same program hits the compilation cache)."""
    if jax.process_count() == 1:
        return
    jitted.lower(*args).compile()
    from omnijax.jax_private import distributed

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"omnijax_{name}_{next(_BARRIERS)}", 3_600_000)


def _progress(total: int, start: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True,
                mininterval=1.0, file=sys.stderr)
