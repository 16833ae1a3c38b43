"""A small real training job speaking the same contract as the omnijax training recipes.

`python -m omnijax.cluster.toy_job trainer.steps=N trainer.run_name=X parallel.cpu_devices=K`:
data-parallel SGD on least squares over K shards (the gradient is the mean of the K shard gradients),
writes runs/X/metrics.jsonl (step, loss, tokens_per_s, step_time_s), checkpoints the weights and the
step under runs/X/checkpoints/ every `trainer.checkpoint_every` steps and on SIGTERM, and resumes from
the latest checkpoint with whatever K it is given. It starts in well under a second, so the executor
can be tested against real processes without paying a JAX compile per restart.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from omnijax.train.metrics import mend_metrics


def main(argv: list[str]) -> int:
    opts = dict(a.split("=", 1) for a in argv)
    steps = int(opts.get("trainer.steps", 100))
    name = opts.get("trainer.run_name", "toy")
    devices = max(1, int(opts.get("parallel.cpu_devices", 1)))
    every = int(opts.get("trainer.checkpoint_every", 10))
    work = int(opts.get("toy.work", 20000))          # rows per step: sets the step time
    min_step_s = float(opts.get("toy.min_step_s", 0.0))  # a floor on the step time, whatever the machine's speed
    run = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / name
    ckpt = run / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    true_w = rng.standard_normal(32)
    w, step = np.zeros(32), 0
    if (ckpt / "latest.npz").exists():
        saved = np.load(ckpt / "latest.npz")
        w, step = saved["w"], int(saved["step"])
        print(f"resumed at step {step} on {devices} devices", file=sys.stderr)
    metrics = run / "metrics.jsonl"
    mend_metrics(metrics)   # as the trainer does on resume: the steps redone supersede their rows
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))

    def save() -> None:
        tmp = ckpt / "tmp.npz"
        np.savez(tmp, w=w, step=step)
        os.replace(tmp, ckpt / "latest.npz")

    with open(metrics, "a") as out:
        while step < steps:
            t0 = time.perf_counter()
            grads, losses = [], []
            for shard in range(devices):   # data-parallel shards, reduced by a mean (the all-reduce)
                r = np.random.default_rng(step * 1000 + shard)
                x = r.standard_normal((work // devices, 32))
                y = x @ true_w + 0.1 * r.standard_normal(len(x))
                err = x @ w - y
                grads.append(x.T @ err / len(x))
                losses.append(float(np.mean(err ** 2)))
            w = w - 0.05 * np.mean(grads, 0)
            step += 1
            if min_step_s > 0:
                time.sleep(max(0.0, min_step_s - (time.perf_counter() - t0)))
            dt = time.perf_counter() - t0
            out.write(json.dumps({"step": step, "loss": float(np.mean(losses)), "tokens_per_s": work / dt,
                                  "step_time_s": dt, "devices": devices}) + "\n")
            out.flush()
            if step % every == 0 or step == steps:
                save()
            if stop["flag"]:
                save()
                print(f"preempted at step {step}", file=sys.stderr)
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
