"""Auto-tuning of the transfer knobs (chunk size, credit window) while training runs.

Each optuna trial sets (chunk_bytes, credit_bytes) on the workers and times a few real training steps;
the steps are not wasted (the chunking does not change the arithmetic) and the best setting stays.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from omnijax.errors import ConfigError

CHUNKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
CREDITS = (1, 2, 4, 8)  # credit window in chunks


def autotune_comm(trainer: Any, trials: int = 6, steps_per_trial: int = 3, chunk_choices: Sequence[int] = CHUNKS,
                  credit_chunks: Sequence[int] = CREDITS, seed: int = 0) -> dict:
    """Pick the (chunk_bytes, credit_bytes) with the lowest median step time; returns it and every trial."""
    import optuna

    if trials <= 0 or steps_per_trial <= 0:
        raise ConfigError(f"autotune_comm: trials={trials} and steps_per_trial={steps_per_trial} must be > 0")
    if trainer.cfg.mode != "sync":
        raise ConfigError("autotune_comm times synchronous steps: use ps.mode=sync")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    rows: list[dict] = []

    def objective(trial: optuna.Trial) -> float:
        chunk = trial.suggest_categorical("chunk_bytes", list(chunk_choices))
        credit = chunk * trial.suggest_categorical("credit_chunks", list(credit_chunks))
        trainer.set_comm(chunk, credit)
        steps = trainer.run(steps_per_trial)
        value = statistics.median(r["step_s"] for r in steps)
        rows.append(dict(chunk_bytes=chunk, credit_bytes=credit, step_s=value))
        return value

    study.optimize(objective, n_trials=trials)
    best = study.best_params
    chunk, credit = best["chunk_bytes"], best["chunk_bytes"] * best["credit_chunks"]
    trainer.set_comm(chunk, credit)
    return dict(chunk_bytes=chunk, credit_bytes=credit, step_s=study.best_value, trials=rows)
