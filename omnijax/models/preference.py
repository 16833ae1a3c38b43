"""Direct preference optimisation (sigmoid DPO, Rafailov et al. 2023) over packed buffers.

A preference pair is one prompt with a chosen and a rejected answer: two documents (prompt + answer each),
packed whole into one row of the token buffer (`omnijax.data.packing`). `pref_index` [B, L] says which answer a
token belongs to: 2p+1 the chosen and 2p+2 the rejected document of the row's pair slot p (0: none). A
sequence's log-probability is the sum of its answer tokens' (`loss_mask`) log-probabilities, and the loss per
pair is TRL's `DPOTrainer` sigmoid loss

    -log σ(β · ((π_c − ρ_c) − (π_r − ρ_r)))

with π the policy's and ρ the reference's sequence log-probabilities. The reference is the policy with its LoRA
adapters switched off (`omnijax.layers.lora.disabled`: no second copy of the model), or per-token reference
log-probabilities computed once before training and carried in the batch (`ref_logps` [B, L]).
A pair slot is real when both of its answers have loss tokens, so no pair count travels with the batch.
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


def pair_sums(values: jax.Array, pref_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) sums of `values` [B, L] per pair slot of each row: two [B * S] arrays, S = L // 2 + 1
    slots a row (a pair takes at least two tokens)."""
    b, l = pref_index.shape
    width = 2 * (l // 2 + 1) + 1
    ids = (jnp.arange(b, dtype=jnp.int32)[:, None] * width + pref_index.astype(jnp.int32)).reshape(-1)
    sums = jax.ops.segment_sum(values.reshape(-1).astype(jnp.float32), ids, num_segments=b * width)
    sums = sums.reshape(b, width)
    return sums[:, 1::2].reshape(-1), sums[:, 2::2].reshape(-1)


def pair_logps(logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen, rejected) sequence log-probabilities per pair slot of the batch's rows, and which slots hold a
    real pair (both answers have loss tokens)."""
    mask = batch["loss_mask"].astype(jnp.float32)
    chosen, rejected = pair_sums(token_logps(logits, batch["targets"], mask), batch["pref_index"])
    counts = pair_sums(mask, batch["pref_index"])
    return chosen, rejected, (counts[0] > 0) & (counts[1] > 0)


def dpo_terms(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array], pair_mask: jax.Array,
              beta: float, dpop_lambda: float = 0.0) -> tuple[jax.Array, dict]:
    """(sum of the real pairs' sigmoid DPO losses, per-pair rewards and orderings as sums, pairs).

    `dpop_lambda` > 0: DPO-Positive (Pal et al. 2024), the margin less λ·max(0, ρ_c − π_c), so lowering the
    chosen answer below the reference costs what it would gain (rewards and accuracy stay plain DPO's)."""
    (pc, pr), (rc, rr) = policy, (jax.lax.stop_gradient(reference[0]), jax.lax.stop_gradient(reference[1]))
    m = pair_mask.astype(jnp.float32)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    penalty = dpop_lambda * jnp.maximum(rc - pc, 0.0) if dpop_lambda else 0.0
    losses = -jax.nn.log_sigmoid(chosen - rejected - beta * penalty)
    stats = {"dpo_reward_chosen": jnp.sum(chosen * m), "dpo_reward_rejected": jnp.sum(rejected * m),
             "dpo_correct": jnp.sum((chosen > rejected) * m), "dpo_pairs": jnp.sum(m),
             "dpo_logps_chosen": jnp.sum(pc * m), "dpo_logps_rejected": jnp.sum(pr * m)}
    return jnp.sum(losses * m), stats


def means(stats: dict) -> dict:
    """The metrics a DPO step reports (means over the batch's pairs): rewards (β·(π−ρ)) of the chosen and the
    rejected answers, their margin, the share of pairs ordered right (accuracy), the policy's sequence
    log-probabilities, and the pair count."""
    n = jnp.maximum(stats["dpo_pairs"], 1.0)
    return {"dpo_reward_chosen": stats["dpo_reward_chosen"] / n, "dpo_reward_rejected": stats["dpo_reward_rejected"] / n,
            "dpo_reward_margin": (stats["dpo_reward_chosen"] - stats["dpo_reward_rejected"]) / n,
            "dpo_accuracy": stats["dpo_correct"] / n, "dpo_logps_chosen": stats["dpo_logps_chosen"] / n,
            "dpo_logps_rejected": stats["dpo_logps_rejected"] / n, "dpo_pairs": stats["dpo_pairs"]}


def model_logits(model: Any, batch: dict) -> jax.Array:
    """Logits [B, L, V] of a plain LLM or of the multimodal assembly (which returns (logits, aux))."""
    if hasattr(model, "encoders"):  # the multimodal assembly: (logits, aux)
        return model(batch)[0]
    return model(batch["tokens"], batch["segment_ids"], batch["positions"])


def reference_logps(model: Any, batch: dict, logits_fn: Callable[[Any, dict], jax.Array] = model_logits) -> jax.Array:
    """Per-token log-probabilities of the batch's targets [B, L] under `model` with its adapters off (0 off the
    loss tokens): what `dpo.reference=precompute` computes once and carries as `ref_logps`."""
    with lora.disabled():
        return token_logps(logits_fn(model, batch), batch["targets"], batch["loss_mask"])


def dpo_loss(beta: float = 0.1, logits_fn: Callable[[Any, dict], jax.Array] = model_logits, rpo_alpha: float = 0.0,
             dpop_lambda: float = 0.0):
    """A `LossFn` (model, batch) -> (loss_sum, token_count, aux) whose global mean is the mean pair loss.

    `rpo_alpha` > 0 adds that weight times the chosen answers' mean token negative log-likelihood (TRL's
    `rpo_alpha`, Pang et al. 2024), which keeps the chosen answers' own probability from falling with the
    rejected ones'; `dpop_lambda` > 0 is DPO-Positive's penalty inside the sigmoid (`dpo_terms`).

    The trainer divides `loss_sum` by the batch's answer tokens; the pair losses are scaled by tokens / pairs
    so that quotient is the mean over pairs. That holds for a batch seen whole (trainer.grad_accum=1, the jitted
    step over the global batch); `aux` carries the means of `means`. The reference: `ref_logps` in the batch,
    else the model with its adapters off."""
    def loss_fn(model: Any, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
        mask = batch["loss_mask"].astype(jnp.float32)
        tokens = jnp.sum(mask)
        pref = batch.get("pref_index")
        if pref is None:  # a batch without pairs (nothing packed): no loss
            zero = jnp.zeros((), jnp.float32)
            return zero, tokens, means({k: zero for k in ("dpo_reward_chosen", "dpo_reward_rejected", "dpo_correct",
                                                         "dpo_pairs", "dpo_logps_chosen", "dpo_logps_rejected")})
        chosen, rejected, real = pair_logps(logits_fn(model, batch), batch)
        if "ref_logps" in batch:
            ref = batch["ref_logps"]
        else:
            if not adapters.has_adapters(nnx.state(model, nnx.Param)):
                raise ConfigError("DPO needs a reference: train adapters (trainer.lora) so the reference is the "
                                  "model with them off, or precompute its log-probabilities (dpo.reference=precompute)")
            ref = reference_logps(model, batch, logits_fn)
        reference = pair_sums(ref * mask, pref)
        total, stats = dpo_terms((chosen, rejected), reference, real, beta, dpop_lambda)
        objective = total / jnp.maximum(stats["dpo_pairs"], 1.0)
        aux = means(stats)
        if rpo_alpha:
            chosen_tokens = jnp.sum(pair_sums(mask, pref)[0] * real)
            aux["dpo_nll_chosen"] = -jnp.sum(chosen * real) / jnp.maximum(chosen_tokens, 1.0)
            objective = objective + rpo_alpha * aux["dpo_nll_chosen"]
        return objective * tokens, tokens, aux
    return loss_fn
