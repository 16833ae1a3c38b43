"""Optimizers: optax AdamW (or SGD) with linear warm-up, cosine decay and global-norm clipping."""
from __future__ import annotations

import optax

from omnijax.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """The update rule the trainer applies to fp32 master weights."""
    lr = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        # Norms, biases and other vectors are not decayed: decay only matrices.
        core = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=lambda params: _matrices(params))
    else:
        core = optax.sgd(lr, momentum=cfg.b1 or None)
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*chain, core)


# Leading axes the pipeline adds when it stacks blocks (omnijax.parallel.engine.PipelinedLLM): not part of
# a weight's own rank, so a stacked norm scale is still a vector (not decayed) under pp.
STACKED_AXES = ("stage", None, "layers")


def _matrices(params):
    import jax
    from flax import nnx

    def is_matrix(x):
        if not isinstance(x, nnx.Variable):
            return getattr(x, "ndim", 0) >= 2
        names = tuple(x.get_metadata().get("out_sharding") or ())
        stacked = len(STACKED_AXES) if names[:len(STACKED_AXES)] == STACKED_AXES else 0
        return x.replace(getattr(x.get_value(), "ndim", 0) - stacked >= 2)

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
