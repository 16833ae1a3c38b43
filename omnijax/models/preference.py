"""Direct preference optimisation (sigmoid DPO, Rafailov et al. 2023) over packed buffers.

A preference pair is one prompt with a chosen and a rejected answer: two documents (prompt + answer each) in the
packed token buffer. `pref_index` [B, L] says which answer a token's loss belongs to: 2p+1 the chosen and 2p+2
the rejected answer of pair p (0: no pair), `pair_mask` [P] which of the P pair slots are real. A sequence's
log-probability is the sum of its answer tokens' (`loss_mask`) log-probabilities, and the loss per pair is TRL's
`DPOTrainer` sigmoid loss

    -log σ(β · ((π_c − ρ_c) − (π_r − ρ_r)))

with π the policy's and ρ the reference's sequence log-probabilities. The reference is the policy with its LoRA
adapters switched off (`omnijax.layers.lora.disabled`: no second copy of the model), or log-probabilities
precomputed once into the batch (`ref_chosen_logps` / `ref_rejected_logps` [P]).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from flax import nnx

from omnijax.errors import ConfigError
from omnijax.layers import lora
from omnijax.models import adapters


def token_logps(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """log p(target) per position [B, L] (0 where mask is 0)."""
    logits = logits.astype(jnp.float32)
    targets = jnp.where(mask > 0, targets, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (picked - jax.nn.logsumexp(logits, axis=-1)) * mask.astype(jnp.float32)


def pair_logps(logps: jax.Array, pref_index: jax.Array, pairs: int) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) sequence log-probabilities [P] from per-position ones and `pref_index`."""
    sums = jax.ops.segment_sum(logps.reshape(-1), pref_index.reshape(-1).astype(jnp.int32), num_segments=2 * pairs + 1)
    return sums[1::2], sums[2::2]


def dpo_terms(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array], pair_mask: jax.Array,
              beta: float) -> tuple[jax.Array, dict]:
    """(sum of the pairs' sigmoid DPO losses, sums of the chosen / rejected rewards, correct orderings, pairs)."""
    (pc, pr), (rc, rr) = policy, (jax.lax.stop_gradient(reference[0]), jax.lax.stop_gradient(reference[1]))
    m = pair_mask.astype(jnp.float32)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    losses = -jax.nn.log_sigmoid(chosen - rejected)
    stats = {"dpo_reward_chosen": jnp.sum(chosen * m), "dpo_reward_rejected": jnp.sum(rejected * m),
             "dpo_correct": jnp.sum((chosen > rejected) * m), "dpo_pairs": jnp.sum(m)}
    return jnp.sum(losses * m), stats


def _logits(model: Any, batch: dict) -> jax.Array:
    if hasattr(model, "encoders"):  # the multimodal assembly: (logits, aux)
        return model(batch)[0]
    return model(batch["tokens"], batch["segment_ids"], batch["positions"])


def dpo_loss(beta: float = 0.1, logits_fn: Callable[[Any, dict], jax.Array] = _logits):
    """A `LossFn` (model, batch) -> (loss_sum, token_count, aux) whose global mean is the mean pair loss.

    The trainer divides `loss_sum` by the batch's answer tokens; the pair losses are scaled by tokens / pairs
    so that quotient is the mean over pairs. That holds for a batch seen whole (trainer.grad_accum=1);
    `aux` carries the sums of rewards and correct orderings with the pair count."""
    def loss_fn(model: Any, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
        pairs = batch["pair_mask"].shape[-1]
        mask = batch["loss_mask"]
        policy = pair_logps(token_logps(logits_fn(model, batch), batch["targets"], mask), batch["pref_index"], pairs)
        if "ref_chosen_logps" in batch:
            reference = (batch["ref_chosen_logps"], batch["ref_rejected_logps"])
        else:
            if not adapters.has_adapters(nnx.state(model, nnx.Param)):
                raise ConfigError("DPO needs a reference: train adapters (trainer.lora) so the reference is the "
                                  "model with them off, or precompute its log-probabilities into the batch")
            with lora.disabled():
                ref_logits = logits_fn(model, batch)
            reference = pair_logps(token_logps(ref_logits, batch["targets"], mask), batch["pref_index"], pairs)
        total, stats = dpo_terms(policy, reference, batch["pair_mask"], beta)
        tokens = jnp.sum(mask.astype(jnp.float32))
        scale = tokens / jnp.maximum(stats["dpo_pairs"], 1.0)
        return total * scale, tokens, stats
    return loss_fn
