"""Learned scheduler: a flax NNX policy over per-job features, imitation warm-up, then actor-critic.

The decision process is the fitted-model scheduler's models (remaining steps, step times, allowed sizes,
resize penalty: `FittedModel.gains`) handed out level by level: devices go step by step (a job's next
allowed size, or "stop"). The teacher is the completion-rate greedy over those levels; the fitted-model
scheduler itself additionally jumps over sizes and runs an efficiency-first pass, so teacher and
`fitted` are close but not identical. The policy scores every candidate (one row of features per job's next step,
plus a stop row) with a shared MLP, and invalid candidates (steps that do not fit the free devices, jobs
at their cap) are masked out of the softmax. Features are per-job observables: fitted remaining times,
the fitted marginal gain (and its ratio to the slot's best), sizes, attained service, age.

Training: (1) supervised warm-up on the decisions of a teacher scheduler recorded on traces
(cross-entropy); (2) online actor-critic on simulated episodes with reward = −(jobs in system) per slot
(by Little's law the undiscounted return is minus the sum of JCTs), discounted returns, a critic
baseline, an entropy bonus, and an experience-replay buffer of past episodes reused with clipped
importance ratios (PPO-style). Training traces (`learned.warmup_workloads`, `learned.rl_workloads`)
default to workloads-0.5/workload-{7,8}, which the bench does not report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from omnijax.cluster.jobs import Cluster, Job
from omnijax.cluster.schedulers import FittedModel

NUM_FEATURES = 13
REWARD_SCALE = 32.0      # jobs in system per reward unit (keeps critic targets O(1))


class PolicyNet(nnx.Module):
    """Shared candidate scorer (actor) and a pooled-state critic."""

    def __init__(self, features: int = NUM_FEATURES, hidden: int = 64, *, rngs: nnx.Rngs):
        self.a1 = nnx.Linear(features, hidden, rngs=rngs)
        self.a2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.a3 = nnx.Linear(hidden, 1, rngs=rngs)
        self.v1 = nnx.Linear(2 * features, hidden, rngs=rngs)
        self.v2 = nnx.Linear(hidden, 1, rngs=rngs)

    def logits(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.a1(x))
        h = jax.nn.relu(self.a2(h))
        return self.a3(h)[..., 0]

    def value(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        m = mask[..., None].astype(x.dtype)
        mean = (x * m).sum(-2) / jnp.maximum(m.sum(-2), 1.0)
        mx = jnp.where(m > 0, x, -1e3).max(-2)
        return self.v2(jax.nn.relu(self.v1(jnp.concatenate([mean, mx], -1))))[..., 0]


def masked_log_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
    logits = jnp.where(mask, logits, -1e9)
    return jax.nn.log_softmax(logits, axis=-1)


@jax.jit
def _score(graphdef, state, x):
    return nnx.merge(graphdef, state).logits(x)


@dataclass
class Decision:
    x: np.ndarray          # [C, F] candidate features (row 0 = stop)
    mask: np.ndarray       # [C] valid candidates
    action: int            # chosen row
    teacher: int           # teacher's row
    logp: float            # behaviour log-probability of `action`
    slot: int              # index of the slot (for returns)


@dataclass
class Recorder:
    decisions: list[Decision] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)     # per slot


class LearnedScheduler(FittedModel):
    """mode: "greedy" (argmax, for evaluation), "sample" (RL episodes) or "teacher" (record the teacher)."""
    name = "learned"
    pack = True

    def __init__(self, net: PolicyNet | None = None, max_candidates: int = 65, mode: str = "greedy",
                 seed: int = 0, **kw):
        super().__init__(**kw)
        self.net = net or PolicyNet(rngs=nnx.Rngs(seed))
        self.max_candidates = max_candidates
        self.mode = mode
        self.rng = np.random.default_rng(seed)
        self.recorder: Recorder | None = None
        self.name = "learned"

    # ---------------------------------------------------------------- features
    def _rows(self, now: float, jobs: list[Job], cluster: Cluster):
        """Per job: (sizes, gains, feature rows per level); all static within a slot."""
        tables = {}
        best = 0.0
        for j in jobs:
            sizes, gains = self.gains(j, cluster)
            r = self.remaining_steps(j) * j.speed_model.predict_many(sizes, np.ceil(sizes / cluster.gpus_per_node))
            tables[j.name] = (sizes, gains, r)
            if len(gains):
                best = max(best, float(gains.max()))
        best = best if best > 0 else 1.0
        out = {}
        gpn = cluster.gpus_per_node
        for j in jobs:
            sizes, gains, r = tables[j.name]
            prev = np.concatenate([[np.inf], r[:-1]])
            steps = np.diff(np.concatenate([[0], sizes]))
            f = np.zeros((len(sizes), NUM_FEATURES), np.float32)
            f[:, 0] = np.log1p(np.minimum(prev, 1e7) / 3600.0) / 5
            f[:, 1] = np.log1p(r / 3600.0) / 5
            f[:, 2] = np.clip(gains / best, -2.0, 1.0)
            # signed log: monotone in the gain over all signs and magnitudes (stop row: 0)
            f[:, 3] = np.sign(gains) * np.maximum(np.log10(np.abs(gains) + 1e-30) + 12.0, 0.0) / 10
            f[:, 4] = np.log2(1 + sizes) / 6
            f[:, 5] = steps / gpn
            f[:, 6] = np.arange(len(sizes)) == 0
            f[:, 7] = sizes == j.allocation
            f[:, 8] = np.log1p(j.attained_service / 3600.0) / 5
            f[:, 9] = np.log1p(max(now - j.arrival, 0.0) / 3600.0) / 5
            out[j.name] = (sizes, gains, f)
        return out

    def _stop_row(self, free_frac: float) -> np.ndarray:
        f = np.zeros(NUM_FEATURES, np.float32)
        f[11] = 1.0
        f[12] = free_frac
        return f

    # ---------------------------------------------------------------- deciding
    def _policy_logits(self, rows: dict, cluster: Cluster) -> tuple[dict, np.ndarray]:
        """Scores of every job-level row and of the stop row for every free-device count, one call."""
        names = list(rows)
        blocks = [rows[n][2] for n in names]
        stops = np.stack([self._stop_row(k / cluster.gpus) for k in range(cluster.gpus + 1)])
        x = np.concatenate(blocks + [stops]) if blocks else stops
        pad = 1 << max(6, math.ceil(math.log2(len(x))))
        xp = np.zeros((pad, NUM_FEATURES), np.float32)
        xp[: len(x)] = x
        graphdef, state = nnx.split(self.net)
        logits = np.asarray(_score(graphdef, state, jnp.asarray(xp)))[: len(x)]
        out, i = {}, 0
        for n, b in zip(names, blocks):
            out[n] = logits[i: i + len(b)]
            i += len(b)
        return out, logits[i:]

    def allocate(self, now, jobs, cluster):
        rec = self.recorder
        if rec is not None and (rec.decisions or rec.rewards):
            # reward of the slot that just ended: minus the jobs still in the system (Little's law: the sum
            # over slots of jobs in system × slot length is the sum of JCTs, so the undiscounted return is
            # minus the total JCT, scaled)
            rec.rewards.append(-len(jobs) / REWARD_SCALE)
        alloc = {j.name: 0 for j in jobs}
        gpus, cpus = cluster.gpus, cluster.cpus
        rows = self._rows(now, list(jobs), cluster)
        if self.mode != "teacher":
            logits, stop_logits = self._policy_logits(rows, cluster)
        level = {j.name: 0 for j in jobs}
        byname = {j.name: j for j in jobs}
        slot = len(rec.rewards) if rec is not None else 0
        while gpus > 0:
            cand = []
            for name, j in byname.items():
                sizes, gains, _ = rows[name]
                if level[name] < len(sizes):
                    step = int(sizes[level[name]]) - alloc[name]
                    if step <= gpus and step * j.cpus_per_replica <= cpus:
                        cand.append(name)
            if not cand:
                break
            tgains = np.array([rows[n][1][level[n]] for n in cand])
            order = np.argsort(-tgains, kind="stable")[: self.max_candidates - 1]
            cand = [cand[i] for i in order]
            tgains = tgains[order]
            teacher = 1 + int(np.argmax(tgains)) if tgains.max() > self.min_gain else 0
            if self.mode == "teacher":
                action, logp = teacher, 0.0
            else:
                lg = np.concatenate([[stop_logits[gpus]], [logits[n][level[n]] for n in cand]])
                lg = lg - lg.max()
                p = np.exp(lg) / np.exp(lg).sum()
                action = int(self.rng.choice(len(p), p=p)) if self.mode == "sample" else int(np.argmax(lg))
                logp = float(np.log(p[action] + 1e-12))
            if rec is not None:
                x = np.zeros((self.max_candidates, NUM_FEATURES), np.float32)
                mask = np.zeros(self.max_candidates, bool)
                x[0] = self._stop_row(gpus / cluster.gpus)
                for i, n in enumerate(cand):
                    x[1 + i] = rows[n][2][level[n]]
                mask[: 1 + len(cand)] = True
                rec.decisions.append(Decision(x, mask, action, teacher, logp, slot))
            if action == 0:
                break
            name = cand[action - 1]
            step = int(rows[name][0][level[name]]) - alloc[name]
            alloc[name] += step
            gpus -= step
            cpus -= step * byname[name].cpus_per_replica
            level[name] += 1
        return alloc

    def reset(self):
        super().reset()
        self.recorder = None


# -------------------------------------------------------------------- training
def _stack(decisions: list[Decision], width: int | None = None) -> dict[str, np.ndarray]:
    """Arrays of decisions; `width` keeps only the first candidate rows (valid rows come first)."""
    w = width or len(decisions[0].mask)
    return {"x": np.stack([d.x[:w] for d in decisions]), "mask": np.stack([d.mask[:w] for d in decisions]),
            "action": np.array([d.action for d in decisions], np.int32),
            "teacher": np.array([d.teacher for d in decisions], np.int32),
            "logp": np.array([d.logp for d in decisions], np.float32)}


_WIDTHS = (8, 16, 32, 65)


def _buckets(decisions: list[Decision], extra: np.ndarray | None = None) -> list[tuple[dict, np.ndarray | None]]:
    """Group decisions by candidate count into a few padded widths (few compiled shapes, little padding)."""
    count = np.array([int(d.mask.sum()) for d in decisions])
    out = []
    lo = 0
    for w in _WIDTHS:
        idx = np.nonzero((count > lo) & (count <= w))[0]
        lo = w
        if len(idx):
            w = min(w, len(decisions[0].mask))
            out.append((_stack([decisions[i] for i in idx], w), None if extra is None else extra[idx]))
    return out


def _batches(buckets, batch: int, rng: np.random.Generator):
    """Shuffled fixed-size minibatches drawn within buckets (the last one of each topped up)."""
    plan = []
    for b, (data, _) in enumerate(buckets):
        n = len(data["action"])
        perm = rng.permutation(n)
        for i in range(0, n, batch):
            idx = perm[i: i + batch]
            if len(idx) < batch:
                idx = np.concatenate([idx, rng.choice(n, batch - len(idx))])
            plan.append((b, idx))
    rng.shuffle(plan)
    return plan


def record_teacher(specs_list, sim_cfg, max_candidates: int = 65) -> list[Decision]:
    """Teacher (fitted-model) decisions on the given workloads."""
    from omnijax.cluster.simulator import run_workload
    out = []
    for specs in specs_list:
        s = LearnedScheduler(mode="teacher", max_candidates=max_candidates)
        s.recorder = Recorder()
        run_workload(specs, s, sim_cfg)
        out.extend(s.recorder.decisions)
    return out


def supervised_warmup(net: PolicyNet, decisions: list[Decision], epochs: int = 30, lr: float = 3e-3,
                      batch: int = 256, seed: int = 0) -> list[float]:
    """Cross-entropy on the teacher's choices; returns the loss per epoch."""
    buckets = _buckets(decisions)
    graphdef, params = nnx.split(net)
    tx = optax.adam(lr)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, x, mask, y):
        def loss_fn(p):
            lp = masked_log_softmax(nnx.merge(graphdef, p).logits(x), mask)
            return -jnp.take_along_axis(lp, y[:, None], 1).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(epochs):
        tot = []
        for b, idx in _batches(buckets, batch, rng):
            data = buckets[b][0]
            params, opt, loss = step(params, opt, data["x"][idx], data["mask"][idx], data["teacher"][idx])
            tot.append(loss)
        losses.append(float(np.mean(jax.device_get(tot))))
    nnx.update(net, params)
    return losses


def agreement(net: PolicyNet, decisions: list[Decision]) -> float:
    """Fraction of decisions where the policy's argmax equals the teacher's choice."""
    graphdef, state = nnx.split(net)
    hits = 0
    for data, _ in _buckets(decisions):
        logits = np.asarray(_score(graphdef, state, jnp.asarray(data["x"])))
        logits = np.where(data["mask"], logits, -np.inf)
        hits += int(np.sum(logits.argmax(-1) == data["teacher"]))
    return hits / len(decisions)


def actor_critic(net: PolicyNet, episodes: list, sim_cfg, *, lr: float = 3e-4, entropy: float = 0.01,
                 gamma: float = 0.97, replay: int = 4, clip: float = 0.2, batch: int = 256, buffer_episodes: int = 4,
                 seed: int = 0, log=None) -> list[dict]:
    """Online actor-critic with entropy bonus and an experience-replay buffer (clipped importance ratios).

    `episodes`: workloads (lists of JobSpec) simulated in turn with the sampling policy.
    """
    from omnijax.cluster.simulator import run_workload
    graphdef, params = nnx.split(net)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, x, mask, a, old_logp, ret):
        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            lp = masked_log_softmax(model.logits(x), mask)
            v = model.value(x, mask)
            adv = jax.lax.stop_gradient(ret - v)
            adv = (adv - adv.mean()) / (adv.std() + 1e-6)
            logp = jnp.take_along_axis(lp, a[:, None], 1)[:, 0]
            ratio = jnp.exp(logp - old_logp)
            pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv).mean()
            ent = -(jnp.where(mask, jnp.exp(lp) * lp, 0.0)).sum(-1).mean()
            vloss = ((v - ret) ** 2).mean()
            return pg - entropy * ent + 0.5 * vloss, (pg, ent, vloss)
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, aux

    rng = np.random.default_rng(seed)
    buffer: list[tuple[dict, np.ndarray]] = []
    history = []
    for ep, specs in enumerate(episodes):
        nnx.update(net, params)
        sched = LearnedScheduler(net=net, mode="sample", seed=seed + ep)
        sched.recorder = rec = Recorder()
        result = run_workload(specs, sched, sim_cfg)
        if not rec.decisions:
            continue
        rewards = np.array(rec.rewards + [0.0] * (1 + max(d.slot for d in rec.decisions) - len(rec.rewards)))
        returns = np.zeros_like(rewards)
        acc = 0.0
        for t in range(len(rewards) - 1, -1, -1):
            acc = rewards[t] + gamma * acc
            returns[t] = acc
        buffer.append((rec.decisions, returns[[d.slot for d in rec.decisions]].astype(np.float32)))
        buffer = buffer[-buffer_episodes:]
        buckets = _buckets([d for b in buffer for d in b[0]], np.concatenate([b[1] for b in buffer]))
        stats = []
        for _ in range(replay):
            for b, idx in _batches(buckets, batch, rng):
                data, rets = buckets[b]
                params, opt, aux = step(params, opt, data["x"][idx], data["mask"][idx], data["action"][idx],
                                        data["logp"][idx], rets[idx])
                stats.append(aux)
        s = np.mean(np.array(jax.device_get(stats)), 0)
        data = _stack(rec.decisions)
        row = {"episode": ep, "avg_jct_s": round(result.avg_jct_s, 1), "decisions": len(rec.decisions),
               "policy_loss": round(float(s[0]), 4), "entropy": round(float(s[1]), 4), "value_loss": round(float(s[2]), 5),
               "agreement_with_teacher": round(float(np.mean(data["action"] == data["teacher"])), 3)}
        history.append(row)
        if log:
            log(row)
    nnx.update(net, params)
    return history


def train_learned(cfg) -> LearnedScheduler:
    """Warm-up on the teacher's decisions, then actor-critic; returns a greedy scheduler."""
    import sys

    from omnijax.cluster.traces import load_workload
    lc = cfg.learned
    if lc.teacher != "fitted":
        raise ValueError("the learned scheduler's decision process mirrors the fitted-model scheduler; "
                         "learned.teacher must be 'fitted'")
    net = PolicyNet(hidden=lc.hidden, rngs=nnx.Rngs(lc.seed))
    decisions = record_teacher([load_workload(w) for w in lc.warmup_workloads], cfg.sim)
    split = int(0.8 * len(decisions))
    supervised_warmup(net, decisions[:split], epochs=lc.warmup_epochs, lr=lc.lr, seed=lc.seed)
    held = agreement(net, decisions[split:])
    print(f"# learned: warm-up on {split} teacher decisions, held-out agreement {held:.3f}", file=sys.stderr)
    if lc.rl_episodes:
        eps = [load_workload(lc.rl_workloads[i % len(lc.rl_workloads)], lc.rl_limit) for i in range(lc.rl_episodes)]
        actor_critic(net, eps, cfg.sim, lr=lc.rl_lr, entropy=lc.entropy, gamma=lc.gamma, replay=lc.replay,
                     seed=lc.seed, log=lambda r: print(f"# learned rl: {r}", file=sys.stderr))
    sched = LearnedScheduler(net=net, mode="greedy", seed=lc.seed)
    sched.warmup_agreement = held
    return sched
