"""Train the NNX MLP classifier on sklearn's load_digits with the Ray parameter-server backend."""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from omnijax import config as cfglib
from omnijax.data.digits import DigitsBatches, digits_split
from omnijax.errors import ConfigError
from omnijax.models.classifier import ClassifierConfig
from omnijax.ps.config import PSConfig
from omnijax.ps.config import validate as validate_ps

DESCRIPTION = "MLP classifier on load_digits (real 8x8 digits) trained by the Ray parameter-server backend"


PS_DEFAULTS = dict(num_workers=2, num_servers=2, num_blocks=8)  # applied under command-line overrides


@dataclass
class PSTrainerSection:
    steps: int = 300
    run_name: str = "ps_digits"
    seed: int = 0
    log_every: int = 25
    checkpoint_every: int = 0


@dataclass
class PSDigitsConfig:
    ps: PSConfig = field(default_factory=lambda: PSConfig(**PS_DEFAULTS))
    model: ClassifierConfig = field(default_factory=lambda: ClassifierConfig(in_dim=64, hidden=[64, 64], num_classes=10))
    trainer: PSTrainerSection = field(default_factory=PSTrainerSection)
    optimizer: Literal["adam", "sgd"] = "adam"   # element-wise: servers update 1-D blocks independently
    lr: float = 3e-3
    batch_per_worker: int = 32


def main(argv: list[str]) -> int:
    import jax.numpy as jnp
    import optax
    import ray
    from flax import nnx

    from omnijax.models.classifier import build_classifier, classifier_loss
    from omnijax.ps.trainer import PSTrainer, ensure_ray
    from omnijax.train.metrics import MetricsWriter

    cfg: PSDigitsConfig = cfglib.build(PSDigitsConfig, overrides=argv, defaults={"ps": PS_DEFAULTS}, check=None)
    t = cfg.trainer
    if t.steps <= 0 or cfg.batch_per_worker <= 0 or not 0 < cfg.lr < 10:
        raise ConfigError("trainer.steps and batch_per_worker must be > 0 and lr in (0, 10)")
    if cfg.model.in_dim != 64 or cfg.model.num_classes != 10:
        raise ConfigError("model.in_dim must be 64 and model.num_classes 10 for 8x8 digits")
    run_dir = Path(os.environ.get("OMNIJAX_RUNS", "runs")) / t.run_name
    ps = cfg.ps
    if t.checkpoint_every:
        ps.checkpoint_every, ps.checkpoint_dir = t.checkpoint_every, str(run_dir / "checkpoints")
    validate_ps(ps)  # before any actor starts
    (xtr, ytr), (xte, yte) = digits_split()
    schedule = optax.cosine_decay_schedule(cfg.lr, t.steps, alpha=0.1)
    opt = optax.adam(schedule) if cfg.optimizer == "adam" else optax.sgd(schedule, momentum=0.9)
    model_fn = functools.partial(build_classifier, cfg.model, t.seed)
    started = not ray.is_initialized()
    ensure_ray(ps.address)
    trainer = PSTrainer(ps, model_fn, classifier_loss, opt, DigitsBatches(xtr, ytr, cfg.batch_per_worker, t.seed))
    writer = MetricsWriter(run_dir)
    samples_per_step = cfg.batch_per_worker * (ps.num_workers if ps.mode == "sync" else 1)
    try:
        done = 0
        while done < t.steps:
            n = min(t.log_every, t.steps - done)
            t0 = time.perf_counter()
            rows = trainer.run(n)
            rate = len(rows) * samples_per_step / (time.perf_counter() - t0)
            done += n
            loss = float(np.mean([r["loss"] for r in rows[-max(1, len(rows) // 4):]]))
            writer.write(trainer.step, {"loss": loss, "samples_per_s": rate, "tokens_per_s": rate,
                                        "servers": len(set(trainer.placement))})
            print(f"step {trainer.step:5d}  loss {loss:.4f}  samples/s {rate:.1f}", flush=True)
        graphdef, _, rest = nnx.split(model_fn(), nnx.Param, ...)
        model = nnx.merge(graphdef, trainer.params(), rest)
        acc = float(jnp.mean(jnp.argmax(model(jnp.asarray(xte)), -1) == jnp.asarray(yte)))
        (run_dir / "eval.json").write_text(json.dumps(
            {"metrics": {"accuracy": acc}, "chance": {"accuracy": 0.1}, "test_samples": int(len(yte)),
             "events": trainer.events}, indent=1))
        print(f"test accuracy {acc:.4f} (chance 0.10) -> {run_dir}/eval.json")
    finally:
        writer.close()
        trainer.close()
        if started:
            ray.shutdown()
    return 0
