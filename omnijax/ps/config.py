"""Typed config of the parameter-server backend (`ps.*` keys); build with `omnijax.config.from_dict`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omnijax.errors import ConfigError


@dataclass
class PSConfig:
    mode: Literal["sync", "async"] = "sync"
    num_workers: int = 2
    num_servers: int = 2          # servers holding blocks at the start
    max_servers: int = 0          # size of the server pool scale-out may use (0 = num_servers)
    min_servers: int = 1          # scale-in never goes below this
    num_blocks: int = 16          # placement unit: the flat parameter vector cut into this many blocks
    chunk_bytes: int = 262144     # transfer unit of a gradient push
    credit_bytes: int = 1048576   # at most this many pushed bytes in flight per worker
    staleness: int = 1            # async: bound on how many iterations a worker may run ahead
    # async only: "delay_comp" corrects a stale gradient on the server (g + λ·g⊙g⊙(w_now − w_pulled));
    # "weight_pred" makes the worker take its gradient at predicted weights w + Opt(w, g) (fresh opt state)
    staleness_mode: Literal["none", "delay_comp", "weight_pred", "delay_comp+weight_pred"] = "none"
    dc_lambda: float = 0.04       # delay compensation strength
    link_mb_per_s: float = 0.0    # simulated per-server link bandwidth (0 = none); makes transfer cost real
    slow_server: int = -1         # straggler injection: this server index is slowed (-1 = none)
    slowdown: float = 1.0         # ... by this per-byte factor (kind "delay")
    straggler_kind: Literal["delay", "neighbour"] = "delay"
    balance: bool = False         # load distribution: move blocks from slow to fast servers
    # what the distributor prices a server's byte by: "measured" = its reported transfer + processing seconds
    # (the real controller); "link" = the link model's transfer seconds only (bytes / link_mb_per_s x slowdown),
    # which no machine load can change: reproducible experiments and tests of the controller's decisions
    cost_source: Literal["measured", "link"] = "measured"
    rebalance_every: int = 4      # steps between straggler checks
    explore_every: int = 0        # steps between scale-out/in trials (0 = no exploration)
    trial_steps: int = 6          # steps measured per trial
    min_gain: float = 0.05        # a change must promise/raise throughput by this fraction
    pipeline_depth: int = 2       # sync: steps submitted ahead to the workers
    checkpoint_every: int = 0     # steps between checkpoints (0 = none)
    checkpoint_dir: str = ""      # where checkpoints go ("" = no checkpoints)
    address: str = ""             # Ray address ("" = start a local Ray, "auto", "ray://host:port")


def validate(cfg: PSConfig) -> PSConfig:
    for name in ("num_workers", "num_servers", "min_servers", "num_blocks", "chunk_bytes", "credit_bytes",
                 "rebalance_every", "trial_steps", "pipeline_depth"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"ps.{name}={getattr(cfg, name)}: must be > 0")
    for name in ("staleness", "link_mb_per_s", "explore_every", "checkpoint_every", "min_gain", "dc_lambda"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"ps.{name}={getattr(cfg, name)}: must be >= 0")
    pool = cfg.max_servers or cfg.num_servers
    if pool < cfg.num_servers:
        raise ConfigError(f"ps.max_servers={cfg.max_servers} must be >= ps.num_servers={cfg.num_servers} (or 0)")
    if cfg.min_servers > cfg.num_servers:
        raise ConfigError(f"ps.min_servers={cfg.min_servers} must be <= ps.num_servers={cfg.num_servers}")
    if cfg.num_blocks < pool:
        raise ConfigError(f"ps.num_blocks={cfg.num_blocks} must be >= the server pool ({pool}) so each can own a block")
    if cfg.slow_server >= pool:
        raise ConfigError(f"ps.slow_server={cfg.slow_server}: only servers 0..{pool - 1} exist")
    if cfg.slowdown < 1:
        raise ConfigError(f"ps.slowdown={cfg.slowdown}: must be >= 1 (a factor of slowness)")
    if cfg.slow_server >= 0 and cfg.straggler_kind == "delay" and cfg.slowdown > 1 and cfg.link_mb_per_s <= 0:
        raise ConfigError("ps.slowdown with straggler_kind=delay multiplies the per-byte link time: "
                          "set ps.link_mb_per_s > 0 too")
    if cfg.cost_source == "link" and cfg.link_mb_per_s <= 0:
        raise ConfigError("ps.cost_source=link prices servers by the link model: set ps.link_mb_per_s > 0 too")
    if cfg.staleness_mode != "none" and cfg.mode != "async":
        raise ConfigError(f"ps.staleness_mode={cfg.staleness_mode} compensates stale gradients: it needs ps.mode=async")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ConfigError("ps.checkpoint_every > 0 needs ps.checkpoint_dir")
    if cfg.mode == "async" and cfg.balance:
        raise ConfigError("ps.balance=true is implemented for mode=sync (moves at an agreed step); "
                          "use mode=sync or balance=false")
    return cfg
