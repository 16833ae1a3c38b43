"""Sigmoid DPO (omnijax/models/preference.py) against TRL's formula computed independently with torch: the loss
and its gradient w.r.t. the policy's logits (1e-5), the reference being the model with its LoRA adapters off."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import LoraConfig
from omnijax.errors import ConfigError
from omnijax.layers import lora
from omnijax.models import adapters, preference
from omnijax.models.llm import LLM
from omnijax.train.parts import Partition
from omnijax.train.step import loss_and_grads
from test_parallel_llm import DENSE

torch = pytest.importorskip("torch")
BETA = 0.3
B, L, PROMPT = 4, 32, 4
DOCS = [(16, 16), (8, 8, 8, 8), (24,), (16, 16)]  # document lengths per row (row 2: one document, no pair)
# (row, chosen document's segment id, rejected one's, the row's pair slot)
PAIRS = [(0, 1, 2, 0), (1, 1, 2, 0), (1, 3, 4, 1), (3, 1, 2, 0)]


def _batch() -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (B, L)).astype(np.int32)
    seg = np.zeros((B, L), np.int32)
    pos = np.zeros((B, L), np.int32)
    for r, docs in enumerate(DOCS):
        a = 0
        for s, n in enumerate(docs, start=1):
            seg[r, a: a + n], pos[r, a: a + n] = s, np.arange(n)
            a += n
    mask = ((seg > 0) & (pos >= PROMPT)).astype(np.float32)  # the answers: every document's tokens after its prompt
    mask[:, -1] = 0
    pref = np.zeros((B, L), np.int32)
    for r, c, rj, slot in PAIRS:
        pref[r, seg[r] == c], pref[r, seg[r] == rj] = 2 * slot + 1, 2 * slot + 2
    return dict(tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=seg, positions=pos, loss_mask=mask,
                pref_index=pref)


def _trl_loss(policy_logits: "torch.Tensor", ref_logits: "torch.Tensor", batch: dict,
              dpop: float = 0.0) -> "torch.Tensor":
    """TRL DPOTrainer's sigmoid loss, written out per sequence with torch (no segment sums); `dpop` > 0: DPO-Positive
    (Pal et al. 2024, eq. 3), the margin less dpop·max(0, ρ_c − π_c) inside the sigmoid."""
    def seq_logp(logits, r, s):
        sel = (batch["segment_ids"][r] == s) & (batch["loss_mask"][r] > 0)
        lp = torch.log_softmax(logits[r], dim=-1)
        tgt = torch.as_tensor(batch["targets"][r]).long()
        return (lp.gather(-1, tgt[:, None])[:, 0] * torch.as_tensor(sel, dtype=lp.dtype)).sum()
    losses = []
    for r, c, rj, _ in PAIRS:
        pc, pr = seq_logp(policy_logits, r, c), seq_logp(policy_logits, r, rj)
        rc, rr = seq_logp(ref_logits, r, c), seq_logp(ref_logits, r, rj)
        losses.append(-torch.nn.functional.logsigmoid(BETA * ((pc - rc) - (pr - rr) - dpop * torch.relu(rc - pc))))
    return torch.stack(losses).mean()


def test_dpo_equals_trl_formula_and_trains_adapters_only():
    batch = _batch()
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    model = adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0))
    g, p, r = nnx.split(model, nnx.Param, ...)
    keys = iter(jax.random.split(jax.random.key(2), 64))
    p = jax.tree_util.tree_map_with_path(   # a policy that has moved away from the reference
        lambda path, x: 0.1 * jax.random.normal(next(keys), x.shape) if adapters.is_adapter(path) else x, p)
    # each forward one compiled program (op by op, every op of the model compiled alone: most of the test's time)
    fwd = lambda q: nnx.merge(g, q, r)(jb["tokens"], jb["segment_ids"], jb["positions"])  # noqa: E731

    def fwd_off(q):
        with lora.disabled():  # a trace-time switch: its own jitted function, never a cache hit of fwd's
            return fwd(q)
    policy, reference = jax.jit(fwd)(p), jax.jit(fwd_off)(p)
    bg, bp = nnx.split(LLM(DENSE, rngs=nnx.Rngs(0)))
    base = jax.jit(lambda q: nnx.merge(bg, q)(jb["tokens"], jb["segment_ids"], jb["positions"]))(bp)
    np.testing.assert_allclose(reference, base, atol=1e-5)  # adapters off = the base model
    assert float(jnp.abs(policy - reference).max()) > 1e-2

    def ours(logits, dpop=0.0):
        pol = preference.pair_sums(preference.token_logps(logits, jb["targets"], jb["loss_mask"]), jb["pref_index"])
        ref = preference.pair_sums(preference.token_logps(reference, jb["targets"], jb["loss_mask"]), jb["pref_index"])
        counts = preference.pair_sums(jb["loss_mask"], jb["pref_index"])
        total, stats = preference.dpo_terms(pol, ref, (counts[0] > 0) & (counts[1] > 0), BETA, dpop)
        assert float(stats["dpo_pairs"]) == len(PAIRS)
        return total / stats["dpo_pairs"]
    for dpop in (0.0, 5.0):  # plain DPO, then DPO-Positive (dpo.dpop_lambda)
        loss, grad = jax.value_and_grad(ours)(policy, dpop)
        tp = torch.tensor(np.asarray(policy), dtype=torch.float64, requires_grad=True)
        theirs = _trl_loss(tp, torch.tensor(np.asarray(reference), dtype=torch.float64), batch, dpop)
        theirs.backward()
        theirs = float(theirs.detach())
        assert abs(float(loss) - theirs) <= 1e-5 * abs(theirs)
        tg = tp.grad.numpy()
        assert np.abs(np.asarray(grad) - tg).max() <= 1e-5 * np.abs(tg).max()
        if dpop == 0.0:
            plain = theirs
    assert theirs > plain + 1e-3  # the penalty acts: some chosen answer is below the reference here
    theirs = plain
    # the trainer's objective: loss_sum / answer tokens is the mean pair loss; gradients reach the adapters only
    mask = Partition(p).mask()
    step_loss, grads, aux = jax.jit(lambda q: loss_and_grads(g, r, preference.dpo_loss(BETA), q, jb, trainable=mask))(p)
    assert abs(float(step_loss) - float(theirs)) <= 1e-5 * abs(float(theirs))
    assert float(aux["dpo_pairs"]) == len(PAIRS) and 0 <= float(aux["dpo_accuracy"]) <= 1
    np.testing.assert_allclose(float(aux["dpo_reward_margin"]),
                               float(aux["dpo_reward_chosen"]) - float(aux["dpo_reward_rejected"]), rtol=1e-5, atol=1e-6)
    # dpo.reference=precompute: the adapters-off log-probabilities computed once and carried in the batch
    ref_logps = jax.jit(lambda q: preference.reference_logps(nnx.merge(g, q, r), jb))(p)
    pre_loss, pre_grads, _ = jax.jit(lambda q: loss_and_grads(g, r, preference.dpo_loss(BETA), q,
                                                              {**jb, "ref_logps": ref_logps}, trainable=mask))(p)
    assert abs(float(pre_loss) - float(step_loss)) <= 1e-5 * abs(float(step_loss))
    for t, leaf in zip(mask, jax.tree.leaves(grads)):
        assert t or not np.any(np.asarray(leaf))
    assert any(np.any(np.asarray(leaf)) for t, leaf in zip(mask, jax.tree.leaves(grads)) if t)


def test_dpo_without_a_reference_is_one_line_error():
    jb = {k: jnp.asarray(v) for k, v in _batch().items()}
    g, p, r = nnx.split(LLM(DENSE, rngs=nnx.Rngs(0)), nnx.Param, ...)
    with pytest.raises(ConfigError, match="DPO needs a reference"):
        loss_and_grads(g, r, preference.dpo_loss(BETA), p, jb)


def test_held_out_pair_scores_match_the_losss_metrics():
    """`train/reference.pair_logps` + `pair_report` (the held-out pairs `recipes dpo` scores on the world) give the
    training loss's own numbers on the same batch: reward accuracy, margin, log-probabilities and loss."""
    from omnijax.train import reference

    batch = _batch()
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    g, p, r = nnx.split(adapters.adapt(LLM(DENSE, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0)), nnx.Param, ...)
    keys = iter(jax.random.split(jax.random.key(3), 64))
    p = jax.tree_util.tree_map_with_path(
        lambda path, x: 0.1 * jax.random.normal(next(keys), x.shape) if adapters.is_adapter(path) else x, p)
    put = lambda b: {k: jnp.asarray(v) for k, v in b.items()}  # noqa: E731
    policy = reference.pair_logps([batch], g, p, r, put)
    ref = reference.pair_logps([batch], g, p, r, put, adapters_off=True)
    assert len(policy[0]) == len(PAIRS) and not np.allclose(policy[0], ref[0])
    rep = reference.pair_report(policy, ref, BETA)
    _, aux = jax.jit(lambda q: preference.dpo_loss(BETA)(nnx.merge(g, q, r), jb)[1:])(p)
    loss = jax.jit(lambda q: (lambda s, n, _: s / n)(*preference.dpo_loss(BETA)(nnx.merge(g, q, r), jb)))(p)
    assert rep["pairs"] == int(aux["dpo_pairs"]) and rep["reward_accuracy"] == round(float(aux["dpo_accuracy"]), 4)
    for ours, theirs in (("reward_margin", "dpo_reward_margin"), ("logps_chosen", "dpo_logps_chosen"),
                         ("logps_rejected", "dpo_logps_rejected")):
        assert abs(rep[ours] - float(aux[theirs])) <= 1e-4 * max(1.0, abs(float(aux[theirs])))
    assert abs(rep["dpo_loss"] - float(loss)) <= 1e-4
    assert rep["preference_accuracy"] == round(float(np.mean(policy[0] > policy[1])), 4)
    assert reference.pair_report(ref, ref, BETA)["reward_margin"] == 0.0
