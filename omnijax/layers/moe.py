"""Mixture-of-experts feed-forward: top-k softmax router, capacity-limited dispatch, SwiGLU experts.

Routing is a pure function of router logits (`route`), so expert parallelism can reuse it inside
`shard_map`: the [E, C, D] buffer built from `dispatch` is exactly what an all-to-all over the
expert axis exchanges. Groups are the rows of the batch (one packed sequence each): capacity and drops
then do not depend on how the batch is split across data-parallel devices or microbatches.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import LLMConfig


class Routing(NamedTuple):
    """Result of routing T tokens of one group to E experts with C slots each."""
    dispatch: jax.Array      # [T, E, C] 0/1 float32: token t sits in slot c of expert e
    combine: jax.Array       # [T, E, C] float32: dispatch * router weight
    expert_index: jax.Array  # [T, k] int32 chosen experts
    slot: jax.Array          # [T, k] int32 slot inside the expert, or C when dropped/masked
    weight: jax.Array        # [T, k] float32 combine weight (0 when dropped/masked)
    dropped: jax.Array       # int32 scalar: (token, expert) assignments over capacity
    lb_loss: jax.Array       # float32 scalar: Switch/GShard load-balancing loss (1.0 when uniform)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(cf * T * k / E), at least 1 and at most T."""
    c = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    return int(min(max(c, 1), num_tokens))


def route(router_logits: jax.Array, top_k: int, capacity: int, token_mask: jax.Array | None = None,
          normalize: bool | None = None) -> Routing:
    """Top-k routing of router_logits [T, E] into `capacity` slots per expert.

    Slots are filled choice-major (every token's first choice before any second choice) in token
    order, as in GShard; assignments beyond capacity are dropped and counted. Masked tokens (padding)
    take no slot and do not count in the loss. Weights are the softmax probabilities of the chosen
    experts, renormalised over the k choices when `normalize` (default: when top_k > 1).
    Load-balancing loss: E * sum_e f_e * P_e with f_e the fraction of assignments to e (before
    capacity) and P_e the mean router probability of e over unmasked tokens.
    """
    t, e = router_logits.shape
    normalize = top_k > 1 if normalize is None else normalize
    mask = jnp.ones((t,), bool) if token_mask is None else token_mask.astype(bool)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, top_k)  # [T, k]
    if normalize:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(top_i, e, dtype=jnp.int32) * mask[:, None, None]  # [T, k, E]
    order = jnp.transpose(chosen, (1, 0, 2)).reshape(top_k * t, e)           # choice-major
    position = (jnp.cumsum(order, axis=0) - 1) * order
    slot = jnp.transpose(position.sum(-1).reshape(top_k, t))                 # [T, k]
    assigned = jnp.broadcast_to(mask[:, None], (t, top_k))
    keep = assigned & (slot < capacity)
    slot = jnp.where(keep, slot, capacity).astype(jnp.int32)
    weight = jnp.where(keep, top_w, 0.0)
    slot_onehot = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)           # index C -> zeros
    dispatch = jnp.einsum("tke,tkc->tec", chosen.astype(jnp.float32), slot_onehot)
    combine = jnp.einsum("tke,tkc->tec", chosen.astype(jnp.float32) * weight[..., None], slot_onehot)
    dropped = jnp.sum(assigned & ~keep).astype(jnp.int32)
    n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    frac = jnp.sum(chosen, axis=(0, 1)).astype(jnp.float32) / (n * top_k)
    mean_prob = jnp.sum(probs * mask[:, None], axis=0) / n
    lb_loss = e * jnp.sum(frac * mean_prob)
    return Routing(dispatch, combine, top_i.astype(jnp.int32), slot, weight, dropped, lb_loss)


class MoE(nnx.Module):
    """Experts as stacked SwiGLU params on the `expert` axis; router kept in float32 maths."""

    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs):
        m, d = cfg.moe, cfg.embed_dim

        def init(shape, fan_in):
            return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)

        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.capacity_factor, self.aux_loss_weight = float(m.capacity_factor), float(m.aux_loss_weight)
        self.router = nnx.Param(init((d, m.num_experts), d), out_sharding=("embed", None))
        self.gate = nnx.Param(init((m.num_experts, d, m.mlp_dim), d), out_sharding=("expert", "embed", "mlp"))
        self.up = nnx.Param(init((m.num_experts, d, m.mlp_dim), d), out_sharding=("expert", "embed", "mlp"))
        self.down = nnx.Param(init((m.num_experts, m.mlp_dim, d), m.mlp_dim), out_sharding=("expert", "mlp", "embed"))

    def experts(self, xe: jax.Array) -> jax.Array:
        """Expert SwiGLU on dispatched buffers xe [..., E, C, D] -> [..., E, C, D]."""
        dt = xe.dtype
        g = jnp.einsum("...ecd,edf->...ecf", xe, self.gate[...].astype(dt))
        u = jnp.einsum("...ecd,edf->...ecf", xe, self.up[...].astype(dt))
        return jnp.einsum("...ecf,efd->...ecd", jax.nn.silu(g) * u, self.down[...].astype(dt))

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
        b, l, _ = x.shape
        logits = jnp.einsum("bld,de->ble", x, self.router[...].astype(x.dtype), preferred_element_type=jnp.float32)
        capacity = expert_capacity(l, self.num_experts, self.top_k, self.capacity_factor)
        r = jax.vmap(lambda lg, mk: route(lg, self.top_k, capacity, mk))(logits, segment_ids != 0)
        xe = jnp.einsum("btec,btd->becd", r.dispatch.astype(x.dtype), x)
        ye = self.experts(xe)
        y = jnp.einsum("btec,becd->btd", r.combine.astype(x.dtype), ye)
        lb = jnp.mean(r.lb_loss)
        aux = {"moe_aux_loss": self.aux_loss_weight * lb, "moe_lb_loss": lb,
               "moe_dropped_tokens": jnp.sum(r.dropped).astype(jnp.float32)}
        return y, aux
