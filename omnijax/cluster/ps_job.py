"""A parameter-server training job (omnijax.ps on Ray) that the executor resizes in place.

`python -m omnijax.cluster.ps_job trainer.steps=N trainer.run_name=X ps.workers=W ps.servers=P
ps.max_servers=S`: trains the digits MLP classifier (recipes/ps_digits.py's data and model) with the
sync parameter-server backend, in chunks of `trainer.chunk` steps. Between chunks it reads
runs/X/control.json (`{"seq": k, "workers": w, "servers": p}`, written by the executor) and, when `seq`
is new, changes its shape without restarting the process, the actors' compiled code or the optimizer:

- servers: the PS backend's own scale out/in, blocks handed over between servers at an agreed step
  (`PSTrainer.move_blocks` to a byte-balanced plan over the new server set);
- workers: between chunks nothing is in flight, so every block's parameters, optimizer state and
  version are taken from the servers (in memory, no checkpoint file), the servers are told the new
  worker count and get their blocks back, and the (new or remaining) worker actors are configured.

The global batch (`batch`, rows per step) is fixed and split evenly over the workers, so the sync step
is the same full-batch gradient for any worker count: a resize changes the speed, not the arithmetic,
and the loss keeps its trajectory. Each chunk appends a metrics.jsonl row (step, loss, step_time_s,
devices = workers, servers); each applied resize appends a resizes.jsonl row. SIGTERM checkpoints
(orbax, runs/X/checkpoints/) and exits; a start with a checkpoint resumes from it (a preemption).

`trainer.lockstep=true`: after each chunk the job waits until runs/X/ack.json says the executor has read
that step (`{"step": s}`, s >= the job's step), so every resize lands at the chunk boundary its decision
was made at, however loaded the machine is (the executor's `PSRunner(lockstep=True)` writes the acks).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from omnijax.train.metrics import mend_metrics

DIGITS_BATCH = 64


class SplitBatches:
    """Step s draws one global batch of `batch` rows (a pure function of seed and step); worker k of w
    gets rows k·batch/w ... (k+1)·batch/w of it, so the mean of the worker gradients is the
    full-batch gradient whatever w is (w must divide `batch`)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, seed: int):
        self.x, self.y, self.batch, self.seed = x, y, batch, seed

    def __call__(self, step: int, worker: int, num_workers: int) -> dict:
        idx = np.random.default_rng((self.seed, step)).integers(0, len(self.x), self.batch)
        per = self.batch // num_workers
        idx = idx[worker * per:(worker + 1) * per]
        return {"x": self.x[idx], "y": self.y[idx]}


def resize_in_place(trainer: Any, workers: int, servers: int) -> dict:
    """Change a sync PSTrainer to `workers` workers and `servers` active servers between `run`s.

    Servers: a byte-balanced placement over the kept (or added pool) servers, scheduled with
    `move_blocks` (blocks change owner at the next step, as in scale out/in). Workers: block state moves
    through the driver's memory to servers reconfigured for the new worker count (same actors, same
    compiled update), then the worker actors are (re)configured. Returns what changed.
    """
    import ray

    from omnijax.errors import ConfigError
    from omnijax.ps.distributor import plan_placement

    if trainer.cfg.mode != "sync":
        raise ConfigError("in-place resizes happen between steps of a sync PS job (ps.mode=sync)")
    pool = list(trainer.pool)
    if not 1 <= servers <= len(pool) or workers < 1:
        raise ConfigError(f"resize to {workers} workers / {servers} servers: need >= 1 worker and "
                          f"1..{len(pool)} servers (the pool)")
    current = trainer.placement
    active = sorted(set(current))
    before = {"workers": trainer.cfg.num_workers, "servers": len(active)}
    if servers < len(active):
        keep = active[:servers]
    else:
        keep = active + [s for s in pool if s not in active][:servers - len(active)]
    plan = current if keep == active else plan_placement(
        trainer.block_bytes, [s if s in keep else -1 for s in current], {s: 1.0 for s in keep}, keep)
    if workers == trainer.cfg.num_workers:
        if plan != current:
            trainer.move_blocks(plan, reason=f"resize:servers={servers}")
        return {"from": before, "to": {"workers": workers, "servers": servers}, "moved": "at_step"}
    snap = trainer.snapshot()
    step = trainer.step
    stale = {b: s["version"] for b, s in snap.items() if s["version"] != step}
    if stale:
        raise RuntimeError(f"resize_in_place: blocks {stale} are not at version {step}; steps are in flight")
    trainer.cfg = dataclasses.replace(trainer.cfg, num_workers=workers)
    srv = trainer.cluster.servers
    ray.get([srv[s].configure.remote(trainer._opt_blob, trainer._knobs(s)) for s in pool])
    applied = {w: step for w in range(workers)}
    ray.get([srv[plan[b.index]].install.remote(b.index, snap[b.index]["param"], snap[b.index]["opt"], step,
                                                applied, {}) for b in trainer.blocks])
    trainer.cluster.ensure(workers, len(pool))
    trainer.workers = list(trainer.cluster.workers[:workers])
    trainer.live_workers = list(range(workers))
    ray.get([trainer._configure_worker(w) for w in trainer.workers])
    trainer.schedule = {step: tuple(plan)}
    trainer._change_at = -1
    trainer.events.append(dict(kind=f"resize:workers={workers},servers={servers}", at_step=step))
    return {"from": before, "to": {"workers": workers, "servers": servers}, "moved": "in_memory"}


def _opts(argv: list[str]) -> dict[str, str]:
    from omnijax.errors import ConfigError
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise ConfigError(f"ps_job takes key=value arguments, got {bad}")
    return dict(a.split("=", 1) for a in argv)


def _await_ack(path: Path, step: int, stop: dict) -> None:
    """Blocks until the executor has acknowledged `step` (or SIGTERM arrives)."""
    while not stop["flag"]:
        try:
            if json.loads(path.read_text()).get("step", -1) >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.005)


def main(argv: list[str]) -> int:
    import functools

    import optax

    from omnijax.errors import ConfigError
    from omnijax.models.classifier import ClassifierConfig, build_classifier, classifier_loss
    from omnijax.ps.config import PSConfig
    from omnijax.ps.trainer import PSTrainer, ensure_ray
    from omnijax.data.digits import digits_split

    o = _opts(argv)
    steps = int(o.pop("trainer.steps", 200))
    name = o.pop("trainer.run_name", "ps_job")
    chunk = int(o.pop("trainer.chunk", 5))
    workers = int(o.pop("ps.workers", 2))
    servers = int(o.pop("ps.servers", 1))
    max_servers = max(int(o.pop("ps.max_servers", 2)), servers)
    batch = int(o.pop("batch", DIGITS_BATCH))
    lr = float(o.pop("lr", 3e-3))
    lockstep = str(o.pop("trainer.lockstep", "false")).lower() in ("1", "true", "yes")
    o.pop("parallel.cpu_devices", None)   # the executor's generic device count; ps.workers says it here
    if o:
        raise ConfigError(f"ps_job: unknown keys {sorted(o)}")
    if steps <= 0 or chunk <= 0 or workers <= 0 or batch % workers:
        raise ConfigError(f"ps_job: steps, chunk, workers must be > 0 and workers must divide batch={batch}")
    run = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / name
    ckpts = run / "checkpoints"
    run.mkdir(parents=True, exist_ok=True)
    (xtr, ytr), _ = digits_split()
    model_cfg = ClassifierConfig(in_dim=64, hidden=[64, 64], num_classes=10)
    cfg = PSConfig(num_workers=workers, num_servers=servers, max_servers=max_servers, num_blocks=max(8, max_servers))
    ensure_ray(cfg.address)
    trainer = PSTrainer(cfg, functools.partial(build_classifier, model_cfg, 0), classifier_loss, optax.adam(lr),
                        SplitBatches(xtr, ytr, batch, seed=0), log=lambda m: print(f"[ps] {m}", file=sys.stderr))
    latest = sorted(ckpts.glob("step_*")) if ckpts.exists() else []
    if latest:
        trainer.restore(str(latest[-1]))
    metrics = run / "metrics.jsonl"
    mend_metrics(metrics)   # as the trainer does on resume: the steps redone supersede their rows
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    control, seq, warm = run / "control.json", -1, True
    if control.exists():   # a preempted job restarts at the shape of its command line, not an old request
        seq = json.loads(control.read_text()).get("seq", -1)
    try:
        with open(metrics, "a") as out:
            while trainer.step < steps and not stop["flag"]:
                if control.exists():
                    req = json.loads(control.read_text())
                    if req.get("seq", -1) > seq:
                        seq = req["seq"]
                        t0 = time.perf_counter()
                        change = resize_in_place(trainer, int(req["workers"]), int(req["servers"]))
                        warm = change["moved"] != "in_memory"   # new worker actors compile in the next chunk
                        with open(run / "resizes.jsonl", "a") as f:
                            f.write(json.dumps({"seq": seq, "step": trainer.step, "pid": os.getpid(),
                                                "seconds": round(time.perf_counter() - t0, 3), **change}) + "\n")
                n = min(chunk, steps - trainer.step)
                t0 = time.perf_counter()
                rows = trainer.run(n)
                dt = (time.perf_counter() - t0) / n
                out.write(json.dumps({"step": trainer.step, "loss": float(np.mean([r["loss"] for r in rows])),
                                      "step_time_s": dt, "tokens_per_s": batch / dt,
                                      "devices": trainer.cfg.num_workers, "servers": len(set(trainer.placement)),
                                      "pid": os.getpid(), "warm": warm}) + "\n")
                out.flush()
                warm = True
                if lockstep:
                    _await_ack(run / "ack.json", trainer.step, stop)
        if stop["flag"] and trainer.step < steps:
            trainer.save_checkpoint(str(ckpts / f"step_{trainer.step:08d}"))
            print(f"preempted at step {trainer.step}", file=sys.stderr)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
