"""Optimizers: optax AdamW (or SGD) with linear warm-up, cosine decay and global-norm clipping.

With a `Partition` (omnijax/train/parts.py) the update rule is an optax partition over the model's parts:
frozen parts get `set_to_zero` (no moments, no weight decay), trainable parts their own copy of the rule
with the schedule scaled by `optimizer.lr_scale.<part>`."""
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


def make_optimizer(cfg: OptimizerConfig, total_steps: int, partition=None) -> optax.GradientTransformation:
    """The update rule the trainer applies to fp32 master weights (partitioned by `partition`'s parts)."""
    lr = learning_rate_schedule(cfg, total_steps)
    chain = [clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    if partition is None or partition.is_trivial:
        return optax.chain(*chain, _rule(cfg, lr))
    from omnijax.train.parts import label_tree

    rules = {}
    for part in partition.parts:
        scale = float(partition.lr_scale.get(part, 1.0))
        if part not in partition.trainable:
            rules[part] = optax.set_to_zero()
        else:
            rules[part] = _rule(cfg, lr if scale == 1.0 else (lambda step, s=scale: lr(step) * s))
    return optax.chain(*chain, optax.multi_transform(rules, label_tree))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax's `clip_by_global_norm` (same formula) over the floating leaves only: a quantised frozen base
    (QLoRA, omnijax/layers/lora.py) has integer leaves, whose (zero) gradients pass through untouched."""
    import jax
    import jax.numpy as jnp

    def update(updates, state, params=None):
        del params
        floating = lambda t: jnp.issubdtype(t.dtype, jnp.floating)  # noqa: E731
        g_norm = optax.tree.norm([t for t in jax.tree.leaves(updates) if floating(t)])
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm) if floating(t) else t
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _rule(cfg: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    if cfg.name == "adamw":
        # Norms, biases and other vectors are not decayed: decay only matrices.
        core = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=lambda params: _matrices(params))
    else:
        core = optax.sgd(lr, momentum=cfg.b1 or None)
    return core


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
