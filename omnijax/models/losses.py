"""Losses over packed token buffers: token-weighted cross entropy with a mask."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of per-token cross entropy where mask > 0, and the number of such tokens.

    Sums (not means) so that microbatches and shards add up to the exact global mean.
    """
    logits = logits.astype(jnp.float32)
    # a masked position's target may be an id outside the vocabulary (a media placeholder): never gathered
    targets = jnp.where(mask > 0, targets, 0)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum((logz - picked) * mask), jnp.sum(mask)


def lm_loss(model, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """Next-token loss of a text LLM on a packed batch: (loss_sum, token_count, aux)."""
    x = model.embed(batch["tokens"])
    logits, aux = model.forward_embeddings(x, batch["segment_ids"], batch["positions"])
    loss_sum, count = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return loss_sum, count, aux
