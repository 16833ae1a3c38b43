"""Scheduler construction by name, shared by the recipes, the bench and the executor."""
from __future__ import annotations

from omnijax.cluster.config import SCHEDULERS, ClusterConfig
from omnijax.cluster.schedulers import DRF, FIFO, FittedModel, FittedOracle, Scheduler, Tiresias
from omnijax.errors import ConfigError


def make_scheduler(name: str, cfg: ClusterConfig | None = None) -> Scheduler:
    """A fresh scheduler; "learned" is trained first (evolution strategies on generated workloads; "learned_ac": imitation, then actor-critic)."""
    cfg = cfg or ClusterConfig()
    if name == "fifo":
        return FIFO()
    if name == "drf":
        return DRF()
    if name == "tiresias":
        return Tiresias()
    if name == "fitted":
        return FittedModel()
    if name == "fitted_rt":
        return FittedModel(objective="remaining_time")
    if name == "fitted_oracle":
        return FittedOracle()
    if name == "fitted_aware":
        from omnijax.cluster.aware import FittedAware
        return FittedAware()
    if name == "learned":
        from omnijax.cluster.residual.training import train_residual
        return train_residual(cfg)
    if name == "learned_ac":
        from omnijax.cluster.learned import train_learned
        return train_learned(cfg)
    raise ConfigError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")
