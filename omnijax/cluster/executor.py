"""Executor: runs real training jobs under a scheduler, on a local Ray instance by default.

Every slot it reads each running job's metrics.jsonl (progress, loss, step time), feeds them into the
job's loss and speed models, asks the scheduler for allocations, and applies them: a job whose device
count changed is resized in one of two ways, by its runner's kind:

- SPMD jobs (`TinyLMRunner`, `ToyRunner`): stopped with SIGTERM (the trainer checkpoints and exits) and
  restarted with the new `parallel.cpu_devices`; they resume from the latest checkpoint onto the new mesh;
- parameter-server jobs (`PSRunner`, `in_place = True`): resized IN PLACE, without stopping the process:
  the executor writes the new worker/server count to the job's control.json and the job
  (`omnijax.cluster.ps_job`) applies it between steps (see there). Only a preemption (0 devices) stops
  a PS job (SIGTERM -> checkpoint), and a later start resumes it.

Each job process is owned by a Ray actor (`backend="ray"`) or directly by this process
(`backend="local"`). A job may name its own runner (`ExecJob.runner`), so one run can mix kinds.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from omnijax.cluster.jobs import Cluster, Job, check_allocation
from omnijax.cluster.perf_model import LossModel, SpeedModel
from omnijax.cluster.schedulers import Scheduler
from omnijax.errors import UserError
from omnijax.train.metrics import read_metrics

_REPO = Path(__file__).resolve().parents[2]


class Runner(Protocol):
    """Builds the command that trains `name` for `steps` on `devices` devices, resuming if it can.

    Runners with `in_place = True` also implement `resize(run_dir, devices, seq)`: ask the running job to
    change to `devices` without a restart."""
    def command(self, name: str, steps: int, devices: int) -> list[str]: ...


@dataclass
class TinyLMRunner:
    """`python -m recipes tiny_lm` with small-model overrides so that several fit on a laptop CPU."""
    extra: Sequence[str] = ("model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=128", "model.head_dim=16",
                            "data.seq_len=64", "data.batch_size=8", "trainer.log_every=5",
                            # checkpoints come from preemption (SIGTERM) and the end of training: the
                            # trainer saves twice when a preemption lands on a periodic-save step
                            "trainer.checkpoint_every=1000000", "trainer.eval_every=0", "trainer.progress=false")

    def command(self, name, steps, devices):
        return [sys.executable, "-m", "recipes", "tiny_lm", f"trainer.steps={steps}", f"trainer.run_name={name}",
                f"parallel.cpu_devices={devices}", *self.extra]


@dataclass
class ToyRunner:
    work: int = 20000
    checkpoint_every: int = 10
    min_step_s: float = 0.0   # a floor on each step's time: a job's length in seconds no longer rides on the machine

    def command(self, name, steps, devices):
        return [sys.executable, "-m", "omnijax.cluster.toy_job", f"trainer.steps={steps}", f"trainer.run_name={name}",
                f"parallel.cpu_devices={devices}", f"trainer.checkpoint_every={self.checkpoint_every}",
                f"toy.work={self.work}", f"toy.min_step_s={self.min_step_s}"]


@dataclass
class PSRunner:
    """A sync parameter-server job (`omnijax.cluster.ps_job`, the digits MLP on omnijax.ps/Ray):
    `devices` workers and `devices // 2` servers (at least 1, at most `max_servers`); resized in place."""
    max_servers: int = 2
    chunk: int = 5
    resize_penalty_s: float = 2.0   # the fitted model's cost of an in-place resize: the hand-over took
                                    # 0.06-0.6 s here, plus the wait for the next chunk boundary
    lockstep: bool = False          # the job waits at each chunk for the executor's ack (`ack`): resizes land
                                    # at the chunk their decision was made at, whatever the machine's load
    in_place = True

    def shape(self, devices: int) -> tuple[int, int]:
        """(workers, servers) for a device count."""
        return devices, max(1, min(self.max_servers, devices // 2))

    def command(self, name, steps, devices):
        workers, servers = self.shape(devices)
        return [sys.executable, "-m", "omnijax.cluster.ps_job", f"trainer.steps={steps}", f"trainer.run_name={name}",
                f"trainer.chunk={self.chunk}", f"ps.workers={workers}", f"ps.servers={servers}",
                f"ps.max_servers={self.max_servers}", *(["trainer.lockstep=true"] if self.lockstep else [])]

    def resize(self, run_dir: Path, devices: int, seq: int) -> dict:
        workers, servers = self.shape(devices)
        req = {"seq": seq, "workers": workers, "servers": servers}
        tmp = run_dir / "control.json.tmp"
        tmp.write_text(json.dumps(req))
        os.replace(tmp, run_dir / "control.json")   # atomic: the job never reads half a request
        return req

    def ack(self, run_dir: Path, step: int) -> None:
        """Tells a lockstep job that its progress up to `step` has been read and decided on."""
        if self.lockstep:
            tmp = run_dir / "ack.json.tmp"
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, run_dir / "ack.json")


class ProcessOwner:
    """Owns one job process; the same class runs as a Ray actor or in-process."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self, cmd: list[str], env: dict, log_path: str) -> int:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("a process owner runs one job process at a time; stop it first")
        if self.log is not None:
            self.log.close()
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(_REPO), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> int:
        """SIGTERM (the job checkpoints and exits), SIGKILL after `timeout` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return -1 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class ExecJob:
    name: str
    steps: int
    arrival_s: float = 0.0
    batch_size: int = 8
    max_devices: int = 1 << 30
    runner: Runner | None = None      # None: the executor's runner
    application: str = "omnijax"      # the job's kind as the scheduler sees it: jobs of one kind and batch size
                                      # are one class (the learned scheduler reads recurring jobs' lengths by class)


@dataclass
class _Running:
    owner: object
    devices: int
    started: float
    rows: list = field(default_factory=list)   # metrics rows as last read in this start
    first_row_skipped: bool = False


@dataclass
class ExecResult:
    jobs: list[dict]
    events: list[dict]
    avg_jct_s: float
    makespan_s: float
    resizes: int
    speed_errors: dict[str, float] = field(default_factory=dict)
    in_place_resizes: int = 0


class Executor:
    def __init__(self, scheduler: Scheduler, runner: Runner, devices: int, run_root: str | Path,
                 backend: str = "ray", slot_s: float = 10.0, stop_timeout_s: float = 120.0, log=print):
        if backend not in ("ray", "local"):
            raise UserError(f"executor backend={backend!r}: must be 'ray' or 'local'")
        if devices <= 0:
            raise UserError(f"executor devices={devices}: must be > 0")
        self.scheduler, self.runner, self.backend = scheduler, runner, backend
        self.cluster = Cluster(num_nodes=1, gpus_per_node=devices, cpus_per_node=1 << 20)
        self.run_root = Path(run_root)
        self.slot_s, self.stop_timeout_s, self.log = slot_s, stop_timeout_s, log
        self.events: list[dict] = []

    # ------------------------------------------------------------------ process plumbing
    def _owner(self):
        if self.backend == "local":
            return ProcessOwner()
        import ray
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        return ray.remote(num_cpus=0)(ProcessOwner).remote()

    def _call(self, owner, method: str, *args):
        if self.backend == "local":
            return getattr(owner, method)(*args)
        import ray
        return ray.get(getattr(owner, method).remote(*args))

    def _env(self) -> dict:
        env = dict(os.environ)
        env["OMNIJAX_RUNS"] = str(self.run_root)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.pop("XLA_FLAGS", None)          # the job sets its own device count
        env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def _event(self, t: float, kind: str, job: str, **kw) -> None:
        ev = {"t": round(t, 2), "event": kind, "job": job, **kw}
        self.events.append(ev)
        self.log(json.dumps(ev))

    def _read(self, job: Job, run: _Running) -> None:
        """New metrics rows -> progress, loss model, speed model (skipping the compile-laden first row of a
        start and rows marked `"warm": false`). A row's own `devices` wins over the allocation (an
        in-place resize takes effect at the job's next step boundary). Rows as the run stands (`read_metrics`):
        a row is new when the last read had no such row of its step (a resumed job's rows supersede the ones
        it logged before)."""
        rows = read_metrics(self.run_root / job.name / "metrics.jsonl")
        if rows:
            job.progress = float(rows[-1]["step"])
        before = {r["step"]: r for r in run.rows}
        for row in rows:
            if before.get(row["step"]) == row:
                continue
            if "loss" in row:
                job.loss_model.observe(row["step"], row["loss"])
            if not run.first_row_skipped:
                run.first_row_skipped = True
                continue
            if row.get("step_time_s") and row.get("warm", True):
                job.speed_model.observe(int(row.get("devices", run.devices)), 1, float(row["step_time_s"]))
                job.observed_step_s = float(row["step_time_s"])
        run.rows = rows

    # ------------------------------------------------------------------ main loop
    def run(self, specs: Sequence[ExecJob]) -> ExecResult:
        jobs = {s.name: Job(name=s.name, arrival=s.arrival_s, application=s.application, batch_size=s.batch_size,
                            requested=1, total_steps=float(s.steps), max_replicas=min(s.max_devices, self.cluster.gpus),
                            cpus_per_replica=1, loss_model=LossModel(), speed_model=SpeedModel("allreduce", s.batch_size))
                for s in specs}
        steps = {s.name: s.steps for s in specs}
        runners = {s.name: s.runner or self.runner for s in specs}
        for name, r in runners.items():   # in-place resizes cost the job little: say so to the scheduler
            if getattr(r, "in_place", False):
                jobs[name].resize_penalty_s = getattr(r, "resize_penalty_s", None)
        seqs: dict[str, int] = {}
        running: dict[str, _Running] = {}
        owners: dict[str, object] = {}
        pending = sorted(specs, key=lambda s: s.arrival_s)
        active: list[Job] = []
        t0 = time.monotonic()
        resizes = in_place = 0
        try:
            while pending or active:
                now = time.monotonic() - t0
                while pending and pending[0].arrival_s <= now:
                    s = pending.pop(0)
                    active.append(jobs[s.name])
                    self._event(now, "arrive", s.name)
                for j in list(active):
                    run = running.get(j.name)
                    if run is None:
                        continue
                    self._read(j, run)
                    rc = self._call(run.owner, "poll")
                    if rc is not None:
                        self._read(j, run)
                        del running[j.name]
                        j.allocation, j.placement = 0, ()
                        if rc == 0 and j.progress >= steps[j.name]:
                            j.finished = now
                            active.remove(j)
                            self.scheduler.job_finished(j)
                            self._event(now, "finish", j.name, step=int(j.progress))
                        else:
                            raise RuntimeError(f"job {j.name} exited with code {rc} at step {j.progress}; "
                                               f"see {self.run_root / j.name / 'executor.log'}")
                for j in active:   # jobs not yet measured: ideal-scaling prior (1 s/step on one device)
                    if j.speed_model.theta is None:
                        j.speed_model.theta = np.array([1.0 / j.batch_size, 0.0, 0.0, 0.0, 0.0])
                # a job still starting (no metrics yet) is pinned: stopping it would only waste its startup
                pinned = {j.name: running[j.name].devices for j in active
                          if j.name in running and not running[j.name].rows}
                # what is free, rounded down to a power of two so every size the scheduler picks divides
                # a power-of-two batch
                left = max(self.cluster.gpus - sum(pinned.values()), 1)
                free = Cluster(1, 1 << (left.bit_length() - 1), self.cluster.cpus_per_node)
                others = [j for j in active if j.name not in pinned]
                alloc = self.scheduler.allocate(now, others, free) if others and sum(pinned.values()) < self.cluster.gpus else {}
                alloc = {j.name: int(pinned.get(j.name, alloc.get(j.name, 0))) for j in active}
                check_allocation(alloc, {j.name: j for j in active}, self.cluster)
                changed = [j for j in active if (running[j.name].devices if j.name in running else 0) != alloc[j.name]]
                for j in [j for j in changed if j.name in running and alloc[j.name] > 0
                          and getattr(runners[j.name], "in_place", False)]:   # PS jobs: resized in place
                    run = running[j.name]
                    seqs[j.name] = seqs.get(j.name, 0) + 1   # increasing across restarts of the job
                    req = runners[j.name].resize(self.run_root / j.name, alloc[j.name], seqs[j.name])
                    resizes += 1
                    in_place += 1
                    self._event(time.monotonic() - t0, "resize", j.name, step=int(j.progress), devices=alloc[j.name],
                                previous=run.devices, in_place=True, **{k: v for k, v in req.items() if k != "seq"})
                    run.devices = alloc[j.name]
                    j.allocation, j.placement = alloc[j.name], (alloc[j.name],)
                    j.timeline.append((time.monotonic() - t0, alloc[j.name], 1))
                changed = [j for j in changed if (running[j.name].devices if j.name in running else 0) != alloc[j.name]]
                for j in changed:   # stop every job that changes first, so that its devices are free
                    run = running.pop(j.name, None)
                    if run is not None:
                        rc = self._call(run.owner, "stop", self.stop_timeout_s)
                        self._read(j, run)
                        if rc == 0 and j.progress >= steps[j.name]:   # it finished while we decided
                            j.finished, j.allocation, j.placement = time.monotonic() - t0, 0, ()
                            active.remove(j)
                            self.scheduler.job_finished(j)
                            self._event(j.finished, "finish", j.name, step=int(j.progress))
                            continue
                        resizes += alloc[j.name] > 0
                        self._event(time.monotonic() - t0, "stop", j.name, step=int(j.progress), rc=rc,
                                    devices=run.devices, reason="resize" if alloc[j.name] else "preempt")
                changed = [j for j in changed if j.finished is None]
                for j in changed:
                    n = alloc[j.name]
                    if n > 0:
                        (self.run_root / j.name).mkdir(parents=True, exist_ok=True)
                        owner = owners.get(j.name) or owners.setdefault(j.name, self._owner())   # reused on restarts
                        pid = self._call(owner, "start", runners[j.name].command(j.name, steps[j.name], n), self._env(),
                                         str(self.run_root / j.name / "executor.log"))
                        running[j.name] = _Running(owner, n, time.monotonic() - t0)
                        if j.started is None:
                            j.started = time.monotonic() - t0
                        else:
                            j.restarts += 1
                        self._event(time.monotonic() - t0, "start", j.name, devices=n, pid=pid, step=int(j.progress))
                    j.allocation, j.placement = n, ((n,) if n else ())
                    j.timeline.append((time.monotonic() - t0, n, 1 if n else 0))
                for j in active:   # after this slot's resize requests: a lockstep job may go on
                    if j.name in running and hasattr(runners[j.name], "ack"):
                        runners[j.name].ack(self.run_root / j.name, int(j.progress))
                if active:
                    time.sleep(self.slot_s)
                elif pending:
                    time.sleep(max(0.0, min(self.slot_s, pending[0].arrival_s - (time.monotonic() - t0))))
        finally:
            for name, run in running.items():
                self._call(run.owner, "stop", self.stop_timeout_s)
        done = list(jobs.values())
        for j in done:
            j.timeline.append((j.finished, 0, 0))
        jcts = [j.finished - j.arrival for j in done]
        return ExecResult(
            jobs=[{"name": j.name, "arrival": j.arrival, "start": j.started, "finish": j.finished,
                   "jct": j.finished - j.arrival, "restarts": j.restarts, "steps": int(j.progress),
                   "timeline": j.timeline, "speed_theta": [round(float(x), 5) for x in j.speed_model.theta],
                   "speed_points": {f"{n}": round(float(sum(v) / len(v)), 4) for (n, _), v in j.speed_model.points.items()},
                   "loss_fit": None if j.loss_model.coeffs is None else vars(j.loss_model.coeffs),
                   "last_loss": j.loss_model.losses[-1] if j.loss_model.losses else None} for j in done],
            events=self.events, avg_jct_s=sum(jcts) / len(jcts),
            makespan_s=max(j.finished for j in done) - min(j.arrival for j in done), resizes=resizes,
            speed_errors={j.name: j.speed_model.mean_error for j in done}, in_place_resizes=in_place)
