"""Trace-driven cluster simulator in time slots.

Jobs arrive (from a workload file or any list), wait until the next slot boundary, and then every slot
the scheduler decides all allocations; placements follow (`jobs.place`); a job whose placement changed
pays `restart_s` of no progress (checkpoint + restart); the others advance by slot / step time, where
the step time comes from the application's measured tables (`traces.AppProfile`: compute time at the
local batch, sync time interpolated over nodes × replicas). Completion inside a slot is timed exactly.
Jobs learn as they run: each slot feeds a noisy step-time and loss observation into the job's models.

Reports average JCT, makespan, utilisation and per-job timelines, and can plot them as PNG.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from omnijax.cluster import families as fam
from omnijax.cluster.jobs import CPUS_PER_REPLICA, Cluster, Job, check_allocation, nodes_for, place
from omnijax.cluster.perf_model import LossCoeffs, LossModel, SpeedModel
from omnijax.cluster.schedulers import Scheduler
from omnijax.cluster.traces import JobSpec, load_profile

StepTimeFn = Callable[[Job, int, int], float]       # (job, devices, nodes) -> seconds per step


@dataclass
class SimConfig:
    num_nodes: int = 16
    gpus_per_node: int = 4
    cpus_per_node: int = 32
    slot_s: float = 60.0
    restart_s: float = 30.0          # checkpoint + restart cost of any (re)placement
    resize_restart_s: float | None = None   # ... of a job that has run before (None: restart_s); 0 prices what
                                            # the restarts of resizes and preemptions cost (an analysis knob)
    speed_noise: float = 0.03        # relative noise of step-time observations
    loss_noise: float = 0.01         # relative noise of loss observations
    loss_eps: float = 0.05           # a job has converged when l − c <= eps · (l(0) − c)
    profile_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)   # trial runs on arrival (Optimus-style profiling)
    length_spread: float = 0.0       # log-normal spread of a job's length around its class's (application, batch
                                     # size) length; 0: the profile's length for every job of a class (Pollux's
                                     # assumption)
    seed: int = 0
    max_time_s: float = 30 * 24 * 3600.0
    # workload families where the fitted model forms break (omnijax/cluster/families.py); () = none, the default
    families: tuple[str, ...] = ()
    interference_alpha: float = 0.5     # step time × (1 + alpha · Σ neighbours' sync shares)
    interference_cap: float = 2.0       # ... at most this factor
    straggler_frac: float = 0.25        # share of slow nodes
    straggler_slowdown: float = 1.5     # a slow node's step-time factor
    decay_milestones: tuple[float, ...] = (1 / 3, 2 / 3, 8 / 9)   # learning-rate drops, fractions of the job
    decay_factor: float = 0.3           # each plateau's gap to the final loss is this times the previous one
    turnover_size: int = 8              # communication-bound applications' sync grows past this many devices
    turnover_power: float = 1.0
    turnover_share: float = 0.4         # ... where the measured sync share at 16 devices is at least this

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.num_nodes, self.gpus_per_node, self.cpus_per_node)


@dataclass
class SimResult:
    scheduler: str
    avg_jct_s: float
    makespan_s: float
    utilization: float
    jobs: list[dict]
    util_timeline: list[tuple[float, float]]
    speed_model_error: float
    loss_model_error: float

    def summary(self) -> dict:
        return {"variant": self.scheduler, "avg_jct_s": round(self.avg_jct_s, 1),
                "makespan_s": round(self.makespan_s, 1), "utilization": round(self.utilization, 4),
                "speed_model_error": round(self.speed_model_error, 4),
                "loss_model_error": round(self.loss_model_error, 4), "jobs": len(self.jobs)}

    def write(self, folder: str | Path, plot: bool = True) -> list[Path]:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        out = [folder / "report.json"]
        out[0].write_text(json.dumps({"summary": self.summary(), "jobs": self.jobs,
                                      "util_timeline": self.util_timeline}, indent=1))
        if plot:
            out.append(plot_result(self, folder / "timeline.png"))
        return out


def first_slot(arrival: float, slot_s: float) -> int:
    """Index of the first slot boundary at or after `arrival` (where the job is first scheduled). Plain
    ceil(arrival / slot) can land before the arrival: a tiny positive arrival's quotient underflows to 0,
    and the simulator then waited forever for a slot that had already passed."""
    k = math.ceil(arrival / slot_s)
    return k + 1 if k * slot_s < arrival else k


def hidden_loss(total_steps: float, eps: float, rng: np.random.Generator) -> LossCoeffs:
    """A loss curve 1/(a·k + b) + c that converges (in the `eps` sense) exactly at `total_steps`."""
    b = float(rng.uniform(0.5, 2.0))
    c = float(rng.uniform(0.05, 2.0))
    return LossCoeffs(a=b * (1.0 / eps - 1.0) / total_steps, b=b, c=c)


def jobs_from_specs(specs: Sequence[JobSpec], cfg: SimConfig) -> tuple[list[Job], StepTimeFn]:
    """Jobs with lengths from the validation files and speeds from the measured placement tables."""
    jobs = []
    profiles = {a: load_profile(a) for a in sorted({s.application for s in specs})}
    spread = np.exp(cfg.length_spread * np.random.default_rng([int(cfg.seed), 0x1E46]).standard_normal(len(specs)))
    for s, scale in zip(specs, spread):
        prof = profiles[s.application]
        jobs.append(Job(
            name=s.name, arrival=s.time, application=s.application, batch_size=s.batch_size,
            requested=s.num_replicas, total_steps=float(prof.total_iterations(s.batch_size)) * float(scale),
            cpus_per_replica=CPUS_PER_REPLICA[s.application],
            max_replicas=max(1, int(s.batch_size // prof.min_local_bsz)),
            loss_model=LossModel(eps=cfg.loss_eps), speed_model=SpeedModel("allreduce", s.batch_size)))

    if "turnover" in cfg.families:
        turned = {a: fam.turnover_step_time(p, cfg) for a, p in profiles.items()}

        def step_time(job: Job, n: int, nodes: int) -> float:
            return turned[job.application](n, nodes, job.batch_size)
    else:
        def step_time(job: Job, n: int, nodes: int) -> float:
            return profiles[job.application].step_time(n, nodes, job.batch_size)
    return jobs, step_time


CommShareFn = Callable[[Sequence[Job], Mapping[str, tuple[int, ...]], StepTimeFn], dict[str, float]]


def comm_share_fn(specs: Sequence[JobSpec]) -> CommShareFn:
    """Measured sync shares of placed jobs (what the "interference" family weighs neighbours by)."""
    profiles = {a: load_profile(a) for a in sorted({s.application for s in specs})}
    return lambda jobs, placements, step_time: fam.comm_shares(profiles, jobs, placements, step_time)


def simulate(jobs: Sequence[Job], step_time: StepTimeFn, scheduler: Scheduler, cfg: SimConfig,
             comm_share: CommShareFn | None = None) -> SimResult:
    """Run all jobs to completion under `scheduler`; the jobs are modified in place. `comm_share`: the
    placed jobs' sync shares (the "interference" family; without it neighbours weigh nothing)."""
    fam.check(cfg)
    cluster = cfg.cluster
    rng = np.random.default_rng(cfg.seed)
    # drawn under every family, stepdecay too (which replaces them): the observation noise drawn from `rng`
    # afterwards is then the same stream with and without a family, so the two runs stay paired
    truth = {j.name: hidden_loss(j.total_steps, cfg.loss_eps, rng) for j in jobs}
    frng = fam.family_rng(cfg)
    if "stepdecay" in cfg.families:
        truth = {j.name: fam.stepdecay_loss(j.total_steps, cfg, frng) for j in jobs}
    nodes_slow = fam.node_slowdowns(cfg, frng)
    node_order = getattr(scheduler, "node_order", None)
    pending = sorted(jobs, key=lambda j: (j.arrival, j.name))
    if not pending:
        raise ValueError("simulate needs at least one job")
    active: list[Job] = []
    done: list[Job] = []
    slot = cfg.slot_s
    t = first_slot(pending[0].arrival, slot) * slot
    busy_total = 0.0
    util: list[tuple[float, float]] = []

    def observe_speed(j: Job, n: int, nodes: int, factor: float = 1.0) -> None:
        seen = step_time(j, n, nodes) * factor * float(np.exp(cfg.speed_noise * rng.standard_normal()))
        j.speed_model.observe(n, nodes, seen)
        j.observed_step_s = seen

    while pending or active:
        if t > cfg.max_time_s:
            raise RuntimeError(f"simulation exceeded {cfg.max_time_s} s with {len(active)} jobs active: "
                               f"scheduler {scheduler.name} is not making progress")
        while pending and pending[0].arrival <= t:
            j = pending.pop(0)
            j.waiting_since = t
            for n in cfg.profile_sizes:
                if n <= min(cluster.gpus, j.max_replicas):
                    observe_speed(j, n, nodes_for(n, cluster))
            active.append(j)
        if not active:
            t = first_slot(pending[0].arrival, slot) * slot
            continue
        alloc = scheduler.allocate(t, active, cluster)
        alloc = {j.name: int(alloc.get(j.name, 0)) for j in active}
        check_allocation(alloc, {j.name: j for j in active}, cluster)
        order = node_order(cluster) if node_order is not None else None
        placements = place(alloc, {j.name: j.placement for j in active}, cluster, pack=scheduler.pack, order=order)
        slow: dict[str, float] = {}
        if cfg.families and placements:
            shares = (comm_share(active, placements, step_time)
                      if comm_share is not None and "interference" in cfg.families else {})
            slow = fam.slowdowns(cfg, placements, shares, nodes_slow)
        busy = 0.0
        for j in list(active):
            new = placements.get(j.name, ())
            n = alloc[j.name]
            if new != j.placement:
                j.timeline.append((t, n, sum(1 for c in new if c)))
                if n == 0:
                    j.waiting_since = t
                elif j.started is not None:
                    j.restarts += 1
            if n == 0:
                j.placement = ()
                j.allocation = 0
                continue
            again = j.started is not None and cfg.resize_restart_s is not None
            overhead = (cfg.resize_restart_s if again else cfg.restart_s) if new != j.placement else 0.0
            if j.allocation == 0:
                j.last_run = 0.0
            j.placement, j.allocation = new, n
            if j.started is None:
                j.started = t
            st = step_time(j, n, j.nodes) * slow.get(j.name, 1.0)
            run = max(0.0, slot - overhead)
            steps = run / st
            used = slot
            if j.progress + steps >= j.total_steps:
                used = min(slot, overhead + (j.total_steps - j.progress) * st)
                j.progress = j.total_steps
                j.finished = t + used
            else:
                j.progress += steps
            j.attained_service += n * used
            j.last_run += used
            busy += n * used
            if run > 0:
                observe_speed(j, n, j.nodes, slow.get(j.name, 1.0))
                loss = float(truth[j.name](j.progress)) * (1.0 + cfg.loss_noise * rng.standard_normal())
                j.loss_model.observe(j.progress, loss)
            if j.done:
                j.timeline.append((j.finished, 0, 0))
                active.remove(j)
                done.append(j)
                scheduler.job_finished(j)
        busy_total += busy
        util.append((t, busy / (cluster.gpus * slot)))
        t += slot

    first = min(j.arrival for j in done)
    makespan = max(j.finished for j in done) - first
    jcts = [j.finished - j.arrival for j in done]
    speed_err = [e for j in done for e in j.speed_model.errors]
    loss_err = [e for j in done for e in j.loss_model.errors]
    return SimResult(
        scheduler=scheduler.name, avg_jct_s=float(np.mean(jcts)), makespan_s=float(makespan),
        utilization=float(busy_total / (cluster.gpus * makespan)) if makespan > 0 else 0.0,
        jobs=[{"name": j.name, "application": j.application, "arrival": j.arrival, "start": j.started,
               "finish": j.finished, "jct": j.finished - j.arrival, "restarts": j.restarts,
               "timeline": j.timeline} for j in sorted(done, key=lambda j: j.arrival)],
        util_timeline=util,
        speed_model_error=float(np.mean(speed_err)) if speed_err else float("nan"),
        loss_model_error=float(np.mean(loss_err)) if loss_err else float("nan"))


def run_workload(specs: Sequence[JobSpec], scheduler: Scheduler, cfg: SimConfig) -> SimResult:
    return run_jobs(specs, scheduler, cfg)[1]


def run_jobs(specs: Sequence[JobSpec], scheduler: Scheduler, cfg: SimConfig) -> tuple[list[Job], SimResult]:
    """`run_workload`, also returning the finished jobs (their true lengths: what supervised training learns from)."""
    jobs, step_time = jobs_from_specs(specs, cfg)
    return jobs, simulate(jobs, step_time, scheduler, cfg, comm_share=comm_share_fn(specs) if cfg.families else None)


def plot_result(result: SimResult, path: str | Path) -> Path:
    """Per-job timeline (bar shade = devices held) above the cluster utilisation curve."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = result.jobs
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 3 + 0.05 * len(jobs) + 2), sharex=True,
                                  gridspec_kw={"height_ratios": [4, 1]})
    cmap = plt.get_cmap("viridis")
    top = max([n for j in jobs for _, n, _ in j["timeline"]] + [1])
    for row, j in enumerate(jobs):
        ax.plot([j["arrival"] / 3600, j["finish"] / 3600], [row, row], color="0.85", lw=1)
        tl = j["timeline"]
        for (t0, n, _), (t1, _, _) in zip(tl, tl[1:]):
            if n > 0:
                ax.plot([t0 / 3600, t1 / 3600], [row, row], color=cmap(n / top), lw=2.5, solid_capstyle="butt")
    ax.set_ylabel("job (by arrival)")
    ax.set_title(f"{result.scheduler}: avg JCT {result.avg_jct_s / 3600:.2f} h, makespan "
                 f"{result.makespan_s / 3600:.2f} h, utilisation {result.utilization:.0%}")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, top))
    fig.colorbar(sm, ax=[ax, ax2], label="devices")
    ts = np.array(result.util_timeline)
    if len(ts):
        ax2.plot(ts[:, 0] / 3600, ts[:, 1], lw=1)
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("utilisation")
    ax2.set_xlabel("hours")
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def config_dict(cfg: SimConfig) -> dict:
    return asdict(cfg)
