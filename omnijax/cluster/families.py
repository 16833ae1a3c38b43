"""Workload families where the fitted (Optimus-style) model forms break; each is an option of the simulator.

All are off by default (`SimConfig.families = ()`), and then the simulator is exactly what it was. Each
family changes only the hidden truth the simulator runs on; schedulers still see only what a real one
would: measured step times at current placements (`Job.observed_step_s`), which jobs share which nodes
(`Job.placement`) and the losses so far. Sources and magnitudes: docs/cluster.md ("Where the fitted forms
break").

- "interference": a job's step time grows with the communication of the jobs that share its nodes:
  × (1 + `interference_alpha` · Σ h_i) over the other jobs i on any of its nodes, h_i = i's measured sync
  share of its step time at its placement (so multi-node all-reduce jobs weigh most), capped at
  `interference_cap`. Co-located jobs contend for PCIe, host memory and the NIC.
- "straggler": every node is slow with probability `straggler_frac` (drawn per run from `seed`); a slow node
  runs `straggler_slowdown` × slower, and a synchronous placement runs at its slowest node's speed.
- "stepdecay": loss curves of step-decay learning-rate schedules: the loss falls to a plateau, then drops at
  each milestone (`decay_milestones`, fractions of the job's length), instead of 1/(a·k + b) + c.
- "turnover": for communication-bound applications (measured sync share at 16 GPUs over 4 nodes at least
  `turnover_share`) the sync time grows as (n / `turnover_size`)^`turnover_power` past `turnover_size`
  devices, so speed falls past a size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from omnijax.errors import ConfigError

FAMILIES = ("interference", "straggler", "stepdecay", "turnover")


def check(cfg) -> None:
    """One-line ConfigError for unknown families or impossible parameters of a SimConfig."""
    bad = [f for f in cfg.families if f not in FAMILIES]
    if bad:
        raise ConfigError(f"sim.families: unknown famil{'y' if len(bad) == 1 else 'ies'} {bad}; choose from "
                          f"{', '.join(FAMILIES)}")
    if cfg.interference_alpha < 0 or cfg.interference_cap < 1:
        raise ConfigError(f"sim.interference_alpha={cfg.interference_alpha} must be >= 0 and "
                          f"sim.interference_cap={cfg.interference_cap} >= 1")
    if not 0 <= cfg.straggler_frac <= 1 or cfg.straggler_slowdown < 1:
        raise ConfigError(f"sim.straggler_frac={cfg.straggler_frac} must be in [0, 1] and "
                          f"sim.straggler_slowdown={cfg.straggler_slowdown} >= 1")
    ms = list(cfg.decay_milestones)
    if any(not 0 < m < 1 for m in ms) or ms != sorted(ms) or not 0 < cfg.decay_factor < 1:
        raise ConfigError(f"sim.decay_milestones={tuple(ms)} must be increasing fractions in (0, 1) and "
                          f"sim.decay_factor={cfg.decay_factor} in (0, 1)")
    if cfg.turnover_size < 1 or cfg.turnover_power <= 0 or not 0 <= cfg.turnover_share <= 1:
        raise ConfigError(f"sim.turnover_size={cfg.turnover_size} must be >= 1, sim.turnover_power="
                          f"{cfg.turnover_power} > 0 and sim.turnover_share={cfg.turnover_share} in [0, 1]")


def family_rng(cfg) -> np.random.Generator:
    """The families' own random stream: the simulator's stream (noise, loss curves) stays as it was."""
    return np.random.default_rng([int(cfg.seed), 0x5EED])


def node_slowdowns(cfg, rng: np.random.Generator) -> np.ndarray:
    """Per node: 1 (normal) or `straggler_slowdown` (slow); all 1 unless "straggler" is on."""
    out = np.ones(cfg.num_nodes)
    if "straggler" in cfg.families:
        out[rng.random(cfg.num_nodes) < cfg.straggler_frac] = cfg.straggler_slowdown
    return out


def slowdowns(cfg, placements: Mapping[str, tuple[int, ...]], comm_share: Mapping[str, float],
              nodes_slow: np.ndarray) -> dict[str, float]:
    """Step-time multiplier (>= 1) of every placed job from the nodes it runs on and its neighbours."""
    out = {name: 1.0 for name in placements}
    if "straggler" in cfg.families:
        for name, counts in placements.items():
            on = [i for i, c in enumerate(counts) if c]
            if on:
                out[name] *= float(max(nodes_slow[i] for i in on))
    if "interference" in cfg.families:
        users: dict[int, list[str]] = {}
        for name, counts in placements.items():
            for i, c in enumerate(counts):
                if c:
                    users.setdefault(i, []).append(name)
        for name, counts in placements.items():
            near = {o for i, c in enumerate(counts) if c for o in users[i] if o != name}
            load = sum(comm_share.get(o, 0.0) for o in near)
            out[name] *= min(1.0 + cfg.interference_alpha * load, cfg.interference_cap)
    return out


@dataclass(frozen=True)
class StepDecayLoss:
    """Loss of a step-decay schedule: phase p (between milestones) decays as 1/(x/τ + 1) from where the last
    phase ended towards its plateau c + G·d^(p+1), G = the initial gap, d = `factor`; τ = `tau` × the
    job's length. Its fit by 1/(a·k + b) + c sees each plateau as convergence."""
    total_steps: float
    c: float
    gap: float
    milestones: tuple[float, ...]
    factor: float
    tau: float = 0.04

    def __call__(self, k):
        k = np.asarray(k, dtype=float)
        starts = [0.0, *[m * self.total_steps for m in self.milestones]]
        out = np.empty_like(k)
        level = self.c + self.gap
        for p, s in enumerate(starts):
            plateau = self.c + self.gap * self.factor ** (p + 1)
            end = starts[p + 1] if p + 1 < len(starts) else np.inf
            tau = self.tau * self.total_steps
            sel = (k >= s) & (k < end)
            out[sel] = plateau + (level - plateau) / ((k[sel] - s) / tau + 1.0)
            if math.isfinite(end):
                level = plateau + (level - plateau) / ((end - s) / tau + 1.0)
        return out if out.ndim else float(out)


def stepdecay_loss(total_steps: float, cfg, rng: np.random.Generator) -> StepDecayLoss:
    c = float(rng.uniform(0.05, 2.0))
    gap = 1.0 / float(rng.uniform(0.5, 2.0))
    return StepDecayLoss(total_steps, c, gap, tuple(cfg.decay_milestones), cfg.decay_factor)


def turnover_step_time(profile, cfg) -> Callable[[int, int, int], float]:
    """The application's step time (n, nodes, batch) with sync growing past `turnover_size` devices if the
    application is communication-bound (measured sync share at 16 devices on 4 nodes)."""
    bsz = max(profile.iterations)
    n16 = int(min(16, max(1, bsz // profile.min_local_bsz)))
    share = profile.sync_time(max(1, math.ceil(n16 / 4)), n16) / profile.step_time(n16, max(1, math.ceil(n16 / 4)), bsz)
    bound = n16 > 1 and share >= cfg.turnover_share

    def step(n: int, nodes: int, batch: int) -> float:
        t = profile.step_time(n, nodes, batch)
        if bound and n > cfg.turnover_size:
            t += profile.sync_time(nodes, n) * ((n / cfg.turnover_size) ** cfg.turnover_power - 1.0)
        return t
    return step


def comm_shares(profiles: Mapping[str, object], jobs: Sequence, placements: Mapping[str, tuple[int, ...]],
                step_time: Callable) -> dict[str, float]:
    """Measured sync share of every placed job's step time at its placement this slot (h_i above)."""
    out = {}
    for j in jobs:
        counts = placements.get(j.name)
        if counts and j.application in profiles:
            n, m = sum(counts), sum(1 for c in counts if c)
            st = step_time(j, n, m)
            out[j.name] = float(profiles[j.application].sync_time(m, n) / st) if st > 0 else 0.0
    return out
