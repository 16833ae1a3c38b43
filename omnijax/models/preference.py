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

The objective is the mean over the step's pairs, whatever splits the step: the loss declares its global
denominator (`global_counts`: real pairs, chosen answer tokens) and `objective.loss_and_grads` computes it once
over the whole batch and hands it to every microbatch (trainer.grad_accum > 1), so the microbatches' sums add up
to the global mean. The per-token log-probabilities come from the final hidden states through the LLM head a row
chunk at a time (`head_logps`, `model.loss_chunk`): no [B, L, V] logits buffer at a real vocabulary.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from flax import nnx

from omnijax.errors import ConfigError
from omnijax.layers import lora
from omnijax.models import adapters
from omnijax.models.losses import _chunk_logits, _picked, head_weight, loss_chunk_of, loss_first_chunks
from omnijax.models.objective import GLOBAL_COUNTS

# (model, batch) -> log p(target) per position [B, L] (0 off the loss tokens)
LogpsFn = Callable[[Any, dict], jax.Array]
# (model, batch) -> (final-normed hidden states [B, L, D], the LLM whose head turns them into logits)
HiddenFn = Callable[[Any, dict], tuple[jax.Array, Any]]
STAT_KEYS = ("dpo_reward_chosen", "dpo_reward_rejected", "dpo_correct", "dpo_pairs", "dpo_logps_chosen",
             "dpo_logps_rejected")


def token_logps(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """log p(target) per position [B, L] (0 where mask is 0)."""
    logits = logits.astype(jnp.float32)
    targets = jnp.where(mask > 0, targets, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (picked - jax.nn.logsumexp(logits, axis=-1)) * mask.astype(jnp.float32)


def head_logps(llm: Any, h: jax.Array, targets: jax.Array, mask: jax.Array, chunk: int | None = None) -> jax.Array:
    """`token_logps(llm.logits(h), targets, mask)` holding one [B, chunk, V] block of logits at a time.

    `chunk` (default the LLM's `model.loss_chunk`; 0 or ≥ L: the full logits). As `losses.head_cross_entropy`
    does, each row's loss positions are moved to its front first and a chunk past every row's count is skipped;
    each chunk is rematerialised in the backward pass (`jax.checkpoint`), so only [B, L] values are kept."""
    chunk = loss_chunk_of(llm) if chunk is None else chunk
    b, l = targets.shape
    if chunk <= 0 or chunk >= l:
        return token_logps(llm.logits(h), targets, mask)
    w, tied = head_weight(llm, h.dtype)
    (hs, ts, ms), order, split = loss_first_chunks(h, targets, mask, chunk)
    nc = ts.shape[1] // chunk
    per_chunk = jnp.sum(split(ms), axis=(1, 2))
    needed = jnp.sum((per_chunk > 0).astype(jnp.int32))  # compacted rows: the chunks with loss are a prefix

    @jax.checkpoint
    def one(w, hc, tc, mc):
        logits = _chunk_logits(hc, w, tied)
        return (_picked(logits, tc) - jax.nn.logsumexp(logits, axis=-1)) * mc

    def body(_, xs):
        hc, tc, mc, k = xs
        return None, jax.lax.cond(k < needed, lambda: one(w, hc, tc, mc), lambda: jnp.zeros(mc.shape, jnp.float32))

    _, out = jax.lax.scan(body, None, (split(hs), split(ts), split(ms), jnp.arange(nc)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, nc * chunk)[:, :l]
    return jnp.take_along_axis(out, jnp.argsort(order, axis=1), axis=1)  # back to the positions' order


def model_hidden(model: Any, batch: dict) -> tuple[jax.Array, Any]:
    """(final-normed hidden states [B, L, D], the LLM) of a plain LLM or of the multimodal assembly."""
    if hasattr(model, "encoders"):  # the multimodal assembly
        h, _ = model.llm.forward_embeddings(model.embed(batch), batch["segment_ids"], batch["positions"], head=False,
                                            rope_positions=batch.get("rope_positions"))
        return h, model.llm
    h, _ = model.forward_embeddings(model.embed(batch["tokens"]), batch["segment_ids"], batch["positions"],
                                    head=False)
    return h, model


def hidden_logps(hidden_fn: HiddenFn = model_hidden, chunk: int | None = None) -> LogpsFn:
    """A `LogpsFn` from `hidden_fn` through the LLM head (`head_logps`): e.g. the joint step's
    `Multiplexer.hidden_states` (encoder outputs routed in, the LLM in its layout) with the prepared LLM's head."""
    def fn(model: Any, batch: dict) -> jax.Array:
        h, llm = hidden_fn(model, batch)
        return head_logps(llm, h, batch["targets"], batch["loss_mask"], chunk)
    return fn


model_logps = hidden_logps()  # the single-device model's (plain LLM or multimodal assembly)


def logits_logps(logits_fn: Callable[[Any, dict], jax.Array]) -> LogpsFn:
    """A `LogpsFn` from a full-logits function (model, batch) -> [B, L, V]."""
    return lambda model, batch: token_logps(logits_fn(model, batch), batch["targets"], batch["loss_mask"])


def pair_sums(values: jax.Array, pref_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) sums of `values` [B, L] per pair slot of each row: two [B * S] arrays, S = L // 2 + 1
    slots a row (a pair takes at least two tokens). Summed row by row (a batched segment sum), so rows sharded
    over devices stay where they are."""
    l = pref_index.shape[1]
    width = 2 * (l // 2 + 1) + 1
    sums = jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=width))(
        values.astype(jnp.float32), pref_index.astype(jnp.int32))
    return sums[:, 1::2].reshape(-1), sums[:, 2::2].reshape(-1)


def pair_logps(logps: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen, rejected) sequence log-probabilities per pair slot of the batch's rows from per-token
    log-probabilities `logps` [B, L], and which slots hold a real pair (both answers have loss tokens)."""
    mask = batch["loss_mask"].astype(jnp.float32)
    chosen, rejected = pair_sums(logps * mask, batch["pref_index"])
    counts = pair_sums(mask, batch["pref_index"])
    return chosen, rejected, (counts[0] > 0) & (counts[1] > 0)


def global_counts(batch: dict) -> dict[str, jax.Array]:
    """The step's denominators over a whole batch: `count` (real pairs, what the trainer divides the summed loss
    by) and `chosen_tokens` (the real pairs' chosen answer tokens, the RPO term's)."""
    if "pref_index" not in batch:
        zero = jnp.zeros((), jnp.float32)
        return {"count": zero, "chosen_tokens": zero}
    mask = batch["loss_mask"].astype(jnp.float32)
    c, r = pair_sums(mask, batch["pref_index"])
    real = ((c > 0) & (r > 0)).astype(jnp.float32)
    return {"count": jnp.sum(real), "chosen_tokens": jnp.sum(c * real)}


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


def means(stats: dict, pairs: jax.Array | None = None) -> dict:
    """The metrics a DPO step reports: rewards (β·(π−ρ)) of the chosen and the rejected answers, their margin,
    the share of pairs ordered right (accuracy), the policy's sequence log-probabilities, each as the sums of
    `stats` over `pairs` (default: the batch's own, `stats["dpo_pairs"]`; the step's global count under
    gradient accumulation, so the microbatches' metrics add up to the step's means), and the pair count."""
    n = jnp.maximum(stats["dpo_pairs"] if pairs is None else pairs, 1.0)
    return {"dpo_reward_chosen": stats["dpo_reward_chosen"] / n, "dpo_reward_rejected": stats["dpo_reward_rejected"] / n,
            "dpo_reward_margin": (stats["dpo_reward_chosen"] - stats["dpo_reward_rejected"]) / n,
            "dpo_accuracy": stats["dpo_correct"] / n, "dpo_logps_chosen": stats["dpo_logps_chosen"] / n,
            "dpo_logps_rejected": stats["dpo_logps_rejected"] / n, "dpo_pairs": stats["dpo_pairs"]}


def model_logits(model: Any, batch: dict) -> jax.Array:
    """Logits [B, L, V] of a plain LLM or of the multimodal assembly (which returns (logits, aux))."""
    if hasattr(model, "encoders"):  # the multimodal assembly: (logits, aux)
        return model(batch)[0]
    return model(batch["tokens"], batch["segment_ids"], batch["positions"])


def reference_logps(model: Any, batch: dict, logps_fn: LogpsFn = model_logps) -> jax.Array:
    """Per-token log-probabilities of the batch's targets [B, L] under `model` with its adapters off (0 off the
    loss tokens): what `dpo.reference=precompute` computes once and carries as `ref_logps`."""
    with lora.disabled():
        return logps_fn(model, batch) * batch["loss_mask"].astype(jnp.float32)


def dpo_loss(beta: float = 0.1, logits_fn: Callable[[Any, dict], jax.Array] | None = None, rpo_alpha: float = 0.0,
             dpop_lambda: float = 0.0, logps_fn: LogpsFn | None = None):
    """A `LossFn` (model, batch) -> (loss_sum, pairs, aux) whose global mean is the mean pair loss.

    The per-token log-probabilities: `logps_fn` (e.g. `hidden_logps` of the joint step's hidden states), else
    `logits_fn`'s full logits, else `model_logps` (the single-device model through the chunked head).
    `rpo_alpha` > 0 adds that weight times the chosen answers' mean token negative log-likelihood (TRL's
    `rpo_alpha`, Pang et al. 2024), which keeps the chosen answers' own probability from falling with the
    rejected ones'; `dpop_lambda` > 0 is DPO-Positive's penalty inside the sigmoid (`dpo_terms`).

    `loss_sum` is the sum of the batch's pair losses (plus the RPO term scaled to the same denominator) and the
    trainer divides it by the step's real pairs (`global_counts`, computed once over the whole step's batch and
    given to each microbatch as `batch[GLOBAL_COUNTS]`; a call without them, e.g. an evaluation, uses the batch's
    own): so any split into microbatches or shards gives the mean over all pairs, and `aux`'s metrics add up to
    the step's means. The reference: `ref_logps` in the batch, else the model with its adapters off."""
    if logps_fn is None:
        logps_fn = logits_logps(logits_fn) if logits_fn is not None else model_logps

    def loss_fn(model: Any, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
        totals = batch.get(GLOBAL_COUNTS) or global_counts(batch)
        pairs = jnp.maximum(totals["count"], 1.0)
        pref = batch.get("pref_index")
        if pref is None:  # a batch without pairs (nothing packed): no loss
            zero = jnp.zeros((), jnp.float32)
            return zero, zero, means({k: zero for k in STAT_KEYS})
        mask = batch["loss_mask"].astype(jnp.float32)
        chosen, rejected, real = pair_logps(logps_fn(model, batch), batch)
        if "ref_logps" in batch:
            ref = batch["ref_logps"]
        else:
            if not adapters.has_adapters(nnx.state(model, nnx.Param)):
                raise ConfigError("DPO needs a reference: train adapters (trainer.lora) so the reference is the "
                                  "model with them off, or precompute its log-probabilities (dpo.reference=precompute)")
            ref = reference_logps(model, batch, logps_fn)
        reference = pair_sums(ref * mask, pref)
        total, stats = dpo_terms((chosen, rejected), reference, real, beta, dpop_lambda)
        aux = means(stats, pairs)
        if rpo_alpha:
            aux["dpo_nll_chosen"] = -jnp.sum(chosen * real) / jnp.maximum(totals["chosen_tokens"], 1.0)
            total = total + rpo_alpha * aux["dpo_nll_chosen"] * pairs
        return total, stats["dpo_pairs"], aux

    loss_fn.global_counts = global_counts
    return loss_fn
