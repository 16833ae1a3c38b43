"""PS throughput with 1 of 4 servers slowed 2x/4x: static placement vs load distribution vs no straggler."""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from omnijax import config as cfglib
from omnijax.errors import ConfigError
from omnijax.ps.config import PSConfig
from omnijax.ps.config import validate as validate_ps

DESCRIPTION = "PS samples/s with 1 of 4 servers slowed 2x/4x: static placement vs load distribution vs no straggler"


# Applied under the command-line overrides (`ps.link_mb_per_s=10` keeps the other bench defaults).
PS_DEFAULTS = dict(num_workers=2, num_servers=4, num_blocks=32, chunk_bytes=1 << 20, credit_bytes=4 << 20,
                   link_mb_per_s=25.0, rebalance_every=4, min_gain=0.05, explore_every=8, trial_steps=4)


@dataclass
class PSBenchConfig:
    ps: PSConfig = field(default_factory=lambda: PSConfig(**PS_DEFAULTS))
    in_dim: int = 256
    hidden: list[int] = field(default_factory=lambda: [1024, 1024])
    num_classes: int = 10
    batch_per_worker: int = 32
    warmup_steps: int = 16        # not timed (every variant): compile, first measurements, rebalancing
    steps: int = 24               # timed steps per variant and round
    rounds: int = 2               # every variant is measured once per round; rounds alternate the order
    spare_server: bool = True     # also measure balanced + exploration with a 5th (spare) server in the pool
    slowdowns: list[float] = field(default_factory=lambda: [2.0, 4.0])
    slow_server: int = 3
    lr: float = 1e-3


class SyntheticBatches:
    """Deterministic random classification batches, made on the worker (no data through the driver)."""

    def __init__(self, in_dim: int, num_classes: int, batch: int):
        self.in_dim, self.num_classes, self.batch = in_dim, num_classes, batch

    def __call__(self, step: int, worker: int, num_workers: int) -> dict:
        r = np.random.default_rng(step * 7919 + worker)
        return {"x": r.normal(size=(self.batch, self.in_dim)).astype(np.float32),
                "y": r.integers(0, self.num_classes, self.batch).astype(np.int32)}


def _measure(cluster, base: PSConfig, bench: PSBenchConfig, **changes) -> dict:
    import dataclasses

    import optax

    from omnijax.models.classifier import ClassifierConfig, build_classifier, classifier_loss
    from omnijax.ps.trainer import PSTrainer

    cfg = dataclasses.replace(base, **changes)
    model_fn = functools.partial(build_classifier, ClassifierConfig(bench.in_dim, list(bench.hidden), bench.num_classes))
    batches = SyntheticBatches(bench.in_dim, bench.num_classes, bench.batch_per_worker)
    trainer = PSTrainer(cfg, model_fn, classifier_loss, optax.adam(bench.lr), batches, cluster, log=lambda m: None)
    trainer.run(bench.warmup_steps)
    t0 = time.perf_counter()
    rows = trainer.run(bench.steps)
    wall = time.perf_counter() - t0
    samples = bench.steps * cfg.num_workers * bench.batch_per_worker
    slow_share = sum(b for b, s in zip(trainer.block_bytes, trainer.placement) if s == cfg.slow_server)
    # deterministic part: the busiest server's simulated link time per step (pull + push of every worker)
    link = {}
    for nbytes, sid in zip(trainer.block_bytes, trainer.placement):
        factor = cfg.slowdown if sid == cfg.slow_server else 1.0
        link[sid] = link.get(sid, 0.0) + 2 * cfg.num_workers * nbytes * factor / (cfg.link_mb_per_s * 1e6)
    return dict(samples_per_s=round(samples / wall, 2), step_ms=round(1e3 * wall / bench.steps, 2),
                link_ms_busiest_server=round(1e3 * max(link.values()), 1) if cfg.link_mb_per_s > 0 else None,
                final_loss=round(rows[-1]["loss"], 4), servers=sorted(set(trainer.placement)),
                slow_server_bytes_fraction=round(slow_share / sum(trainer.block_bytes), 4),
                changes=[e["kind"].split(" ")[0] for e in trainer.events],
                param_mb=round(4 * trainer.layout.total / 1e6, 2))


def run(overrides: list[str]) -> Iterator[dict]:
    import ray

    import cloudpickle
    from omnijax.ps.trainer import PSCluster, ensure_ray

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    bench: PSBenchConfig = cfglib.build(PSBenchConfig, overrides=overrides, defaults={"ps": PS_DEFAULTS}, check=None)
    base = validate_ps(bench.ps)
    if bench.slow_server >= (base.max_servers or base.num_servers):
        raise ConfigError(f"slow_server={bench.slow_server}: only servers 0..{(base.max_servers or base.num_servers) - 1}")
    if bench.rounds <= 0 or bench.steps <= 0:
        raise ConfigError(f"rounds={bench.rounds} and steps={bench.steps} must be > 0")
    started = not ray.is_initialized()
    ensure_ray(base.address)
    pool = base.max_servers or base.num_servers
    cluster = PSCluster(base.num_workers, pool + int(bench.spare_server), base.address)
    fixed = dict(max_servers=pool, explore_every=0)  # the five required variants: the same 4 servers
    variants = {"no_straggler": dict(slow_server=-1, slowdown=1.0, balance=False, **fixed)}
    for factor in bench.slowdowns:
        for kind, balance in (("static", False), ("balanced", True)):
            variants[f"{kind}_{factor:g}x"] = dict(slow_server=bench.slow_server, slowdown=factor, balance=balance,
                                                  **fixed)
    if bench.spare_server:  # exploration may bring in a 5th server: more resources than no_straggler
        for factor in bench.slowdowns:
            variants[f"balanced_explore_{factor:g}x"] = dict(
                slow_server=bench.slow_server, slowdown=factor, balance=True, max_servers=pool + 1,
                min_servers=pool - 1, explore_every=base.explore_every or 8)
    names = list(variants)
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for r in range(bench.rounds):  # alternate the order so that drifting machine load hits all variants
            for name in (names if r % 2 == 0 else names[::-1]):
                results[name].append(_measure(cluster, base, bench, **variants[name]))
        ref = float(np.mean([m["samples_per_s"] for m in results["no_straggler"]]))
        for name in names:
            rows = results[name]
            rate = float(np.mean([m["samples_per_s"] for m in rows]))
            out = dict(variant=name, samples_per_s=round(rate, 2),
                       fraction_of_no_straggler=round(rate / ref, 4),
                       samples_per_s_rounds=[m["samples_per_s"] for m in rows], **{
                           k: v for k, v in rows[-1].items() if k != "samples_per_s"})
            if name != "no_straggler":
                out["vs"] = "no_straggler"
            if name.startswith("balanced_explore"):
                out["note"] = "pool of 5 servers; exploration may add the spare (more resources than no_straggler)"
            yield out
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()
