"""The training distribution: workloads generated from training traces, and the simulator config
(families, seed) each training episode runs under."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from omnijax.cluster.traces import JobSpec


def generate_workload(pool: Sequence[Sequence[JobSpec]], rng: np.random.Generator, window_s: float = 3600.0,
                      jitter_s: float = 300.0) -> list[JobSpec]:
    """A workload from the training distribution: a random `window_s` window of a random training trace,
    its jobs resampled with replacement (same count) and their arrivals jittered by up to `jitter_s`."""
    specs = list(pool[int(rng.integers(len(pool)))])
    end = max(s.time for s in specs)
    t0 = float(rng.uniform(0.0, max(end - window_s, 0.0)))
    window = [s for s in specs if t0 <= s.time < t0 + window_s] or specs[:1]
    picks = rng.integers(len(window), size=len(window))
    out = []
    for i, k in enumerate(picks):
        s = window[int(k)]
        t = float(np.clip(s.time - t0 + rng.uniform(-jitter_s, jitter_s), 0.0, window_s))
        out.append(JobSpec(f"{s.application}-g{i}", t, s.application, s.num_replicas, s.batch_size))
    return sorted(out, key=lambda s: (s.time, s.name))


def episode_configs(sim_cfg, families: Sequence[str], count: int, rng: np.random.Generator) -> list:
    """`count` simulator configs, each with its own seed, under no family or one of `families`: round robin in a
    fresh random order per round, so every family gets its share of a short training run."""
    from dataclasses import replace
    options = [()] + [(f,) for f in families]
    if not families:
        return [sim_cfg] * count
    order: list[tuple[str, ...]] = []
    while len(order) < count:
        order += [options[int(i)] for i in rng.permutation(len(options))]
    return [replace(sim_cfg, families=order[i], seed=int(rng.integers(1 << 30))) for i in range(count)]
