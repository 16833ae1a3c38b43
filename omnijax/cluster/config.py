"""Configs of the cluster recipes (simulation, bench), filled with `omnijax.config.build`."""
from __future__ import annotations

from dataclasses import dataclass, field

from omnijax.cluster.simulator import SimConfig
from omnijax.errors import ConfigError

SCHEDULERS = ("fifo", "drf", "tiresias", "fitted", "fitted_rt", "fitted_oracle", "fitted_aware", "learned", "learned_ac")


@dataclass
class LearnedConfig:
    teacher: str = "fitted"
    max_jobs: int = 64             # jobs the policy sees per decision (more are queued behind)
    hidden: int = 64
    warmup_workloads: list[str] = field(default_factory=lambda: ["workloads-0.5/workload-7", "workloads-0.5/workload-8"])
    warmup_epochs: int = 10
    rl_workloads: list[str] = field(default_factory=lambda: ["workloads-0.5/workload-7", "workloads-0.5/workload-8"])
    rl_episodes: int = 4
    rl_limit: int = 60             # jobs per RL episode (a prefix of the workload)
    lr: float = 1e-2
    rl_lr: float = 3e-4
    entropy: float = 0.01
    replay: int = 4                # replay passes over the buffer per episode
    gamma: float = 0.97
    seed: int = 0
    # "learned" (omnijax/cluster/residual/): ES over a policy steering the fitted plan
    train_sets: list[str] = field(default_factory=lambda: ["workloads-0.5", "workloads-1.5", "workloads-2.0"])
    window_s: float = 3600.0       # generated workloads: a window of this length of a training trace
    es_iterations: int = 6
    es_pairs: int = 3
    es_sigma: float = 0.3
    es_lr: float = 0.3
    es_validation: int = 8         # generated workloads the trained policy must beat fitted on (0: no check)
    es_confidence: float = 2.0     # ... by this many standard errors of the paired mean (residual.es.accept)
    hidden_es: int = 16
    train_families: list[str] = field(default_factory=list)   # each generated workload (training and validation)
                                   # runs under none or one of these families (sim.families), drawn uniformly
    anchor_workloads: int = 20     # generated workloads the warm start learns its lengths after a loss drop on
                                   # (residual.supervised.drop_anchor; 0: none)
    class_lengths: bool = True     # remaining steps from finished jobs of the same application and batch size
                                   # (residual.lengths.ClassLengths), before the drop anchor and the fit
    aware: bool = True             # step times with fitted_aware's straggler and interference terms
    supervised_workloads: int = 0  # generated workloads the warm start learns its length correction on (0: none,
                                   # the warm start is the fitted scheduler exactly)
    supervised_window_s: float = 0.0   # ... their window (0: window_s)
    supervised_columns: list[int] = field(default_factory=lambda: [15, 16, 18, 19])   # the features it regresses on
                                   # (residual.supervised.MISFIT_COLUMNS; [15, 18, 19]: only after a loss drop was seen)
    save: str = ""                 # write the trained policy (.npz) here
    load: str = ""                 # use a saved policy instead of training (a file `save` wrote)


@dataclass
class ClusterConfig:
    run_name: str = "cluster_sim"
    scheduler: str = "fitted"
    workload: str = "workloads/workload-1"   # a bundled name, or a path to a CSV file of the same columns
    limit: int = 0                 # first N jobs only (0 = all)
    sim: SimConfig = field(default_factory=SimConfig)
    learned: LearnedConfig = field(default_factory=LearnedConfig)
    plot: bool = True


def validate(cfg: ClusterConfig) -> ClusterConfig:
    if cfg.scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler={cfg.scheduler!r}: must be one of {', '.join(SCHEDULERS)}")
    if cfg.learned.teacher not in SCHEDULERS[:-2]:
        raise ConfigError(f"learned.teacher={cfg.learned.teacher!r}: must be one of {', '.join(SCHEDULERS[:-2])}")
    if cfg.limit < 0:
        raise ConfigError(f"limit={cfg.limit}: must be >= 0")
    from omnijax.cluster.families import FAMILIES, check
    check(cfg.sim)
    if cfg.learned.anchor_workloads < 0:
        raise ConfigError(f"learned.anchor_workloads={cfg.learned.anchor_workloads} must be >= 0 (0: no drop anchor)")
    if any(not 0 <= c < 20 for c in cfg.learned.supervised_columns) or cfg.learned.supervised_workloads < 0:
        raise ConfigError(f"learned.supervised_columns={cfg.learned.supervised_columns} must be feature indices in "
                          f"[0, 20) and learned.supervised_workloads={cfg.learned.supervised_workloads} >= 0")
    bad = [f for f in cfg.learned.train_families if f not in FAMILIES]
    if bad:
        raise ConfigError(f"learned.train_families: unknown famil{'y' if len(bad) == 1 else 'ies'} {bad}; choose from "
                          f"{', '.join(FAMILIES)}")
    s = cfg.sim
    if (min(s.num_nodes, s.gpus_per_node, s.cpus_per_node) <= 0 or s.slot_s <= 0 or s.restart_s < 0
            or (s.resize_restart_s or 0.0) < 0 or s.length_spread < 0):
        raise ConfigError("sim.num_nodes, sim.gpus_per_node, sim.cpus_per_node, sim.slot_s must be > 0 and "
                          "sim.restart_s, sim.resize_restart_s, sim.length_spread >= 0")
    if not cfg.run_name or "/" in cfg.run_name:
        raise ConfigError(f"run_name={cfg.run_name!r}: must be a non-empty name without '/'")
    return cfg


@dataclass
class BenchConfig:
    """`python -m recipes bench cluster` options; each row averages workload-1..files of a set."""
    schedulers: list[str] = field(default_factory=lambda: [s for s in SCHEDULERS[:-1] if s != "fitted_aware"])
    # (learned_ac and fitted_aware on request)
    seeds: int = 1                 # runs per file, sim.seed, sim.seed + 1, ... (noise, loss curves, the families' draws)
    workloads: list[str] = field(default_factory=lambda: ["workloads", "workloads-realistic"])   # sets, CSVs, folders
    files: int = 1                 # workload-1..N of a set, the first N CSVs of a folder (0: all)
    limit: int = 0                 # the first N jobs (of `applications`, where given) of each file (0: all)
    applications: list[str] = field(default_factory=list)   # only jobs of these (analysis); [] = all
    lp_interval_s: float = 120.0   # time step of the LP lower bound (0: skip it); shorter is tighter and slower
    lagrange_interval_s: float = 300.0   # time step of the Lagrangian lower bound (0: skip it)
    lagrange_iterations: int = 200       # column-generation rounds of the Lagrangian bound at most (valid after
                                         # any; it stops earlier once within 0.2% of its master LP)
    milp_time_s: float = 0.0       # HiGHS's time per file for the slot-exact bound (0: skip it; small workloads only)
    sim: SimConfig = field(default_factory=SimConfig)
    learned: LearnedConfig = field(default_factory=LearnedConfig)


@dataclass
class HindsightConfig:
    """`python -m recipes bench cluster_hindsight`: how far below `fitted` a schedule of the same family gets on
    a file when it may be tuned on that very file (a diagnostic of headroom, never a scheduler)."""
    workloads: list[str] = field(default_factory=lambda: ["workloads/workload-1"])   # files or bundled names
    limit: int = 0
    betas: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 4.0])
    resize_penalties_s: list[float] = field(default_factory=lambda: [0.0, 300.0, 1000.0])
    hysteresis: list[float] = field(default_factory=lambda: [0.0, 1.0])
    oracle: bool = True            # the grid also with the true job lengths (FittedOracle)
    es_iterations: int = 10        # ES on the file itself (0: skip); every perturbation is a policy that ran there
    es_pairs: int = 4
    es_sigma: float = 0.3
    es_lr: float = 0.3
    hidden_es: int = 16
    seed: int = 0
    sim: SimConfig = field(default_factory=SimConfig)


@dataclass
class ExecConfig:
    """`python -m recipes cluster_exec`: real jobs under a scheduler on a local Ray instance."""
    run_name: str = "cluster_exec"
    scheduler: str = "fitted"
    runner: str = "tiny_lm"        # tiny_lm | toy | ps (PS jobs are resized in place)
    runners: list[str] = field(default_factory=list)   # per job, overriding `runner` (e.g. [ps,tiny_lm,tiny_lm])
    backend: str = "ray"           # ray | local
    devices: int = 4               # fake CPU devices shared by all jobs
    jobs: int = 3
    steps: list[int] = field(default_factory=lambda: [300, 200, 200])
    arrivals_s: list[float] = field(default_factory=lambda: [0.0, 60.0, 120.0])
    slot_s: float = 15.0
    resize_penalty_s: float = 20.0   # the fitted model's resize cost: about one restart of a tiny job here
    policy: str = ""               # scheduler=learned: a saved policy (.npz, `bench cluster learned.save=PATH`)
    max_devices: list[int] = field(default_factory=list)   # per job, the most devices it may hold (jobs then share
                                   # the machine at once: co-located); missing entries: no cap
    applications: list[str] = field(default_factory=list)   # per job, its kind (jobs of one kind are one class
                                   # for the learned scheduler's class lengths); missing entries: "omnijax"
    plot: bool = True
