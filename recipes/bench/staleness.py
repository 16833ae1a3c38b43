"""Stale data parallelism vs synchronous: converged quality on real data with 8-way DP on the CPU mesh."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

DESCRIPTION = "stale DP (stale1, +dc, +wp, +dc+wp) vs sync: final digits accuracy / byte-LM loss over seeds, 8-way DP"

VARIANTS = ("sync", "stale1", "stale1+dc", "stale1+wp", "stale1+dc+wp")


@dataclass
class TaskBench:
    steps: int = 300
    batch_size: int = 64
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9


@dataclass
class StalenessBench:
    seeds: int = 3
    tasks: list[str] = field(default_factory=lambda: ["digits", "byte_lm"])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    warmup_steps: int = 10
    dc_lambda: float = 0.04
    dc_adaptive: bool = True
    cpu_devices: int = 8
    digits: TaskBench = field(default_factory=lambda: TaskBench(steps=300, batch_size=64, lr=0.1, optimizer="sgd"))
    byte_lm: TaskBench = field(default_factory=lambda: TaskBench(steps=150, batch_size=32, lr=1e-2, optimizer="adamw"))


# ------------------------------------------------------------------------------------ tasks
def _digits():
    """sklearn's bundled 8x8 digits; a fixed 80/20 split (the same for every seed and variant)."""
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(1234).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def _classifier_loss(model, batch):
    import jax.numpy as jnp
    import optax

    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]) * batch["loss_mask"]
    return jnp.sum(ce), jnp.sum(batch["loss_mask"]), {}


def _optimizer(t: TaskBench, steps: int):
    from omnijax.config import OptimizerConfig
    from omnijax.train.optimizer import make_optimizer

    cfg = OptimizerConfig(name=t.optimizer, lr=t.lr, b1=t.momentum if t.optimizer == "sgd" else 0.9,
                          warmup_steps=10, weight_decay=0.0 if t.optimizer == "sgd" else 0.1, grad_clip=1.0)
    return make_optimizer(cfg, steps)


def _make_step(variant: str, model, loss_fn, optimizer, mesh, cfg: StalenessBench):
    """Jitted step and an init(params)->placed state for one variant (compiled once, reused over seeds)."""
    import jax
    from flax import nnx

    from omnijax.config import TrainerConfig
    from omnijax.train.placement import DataParallel
    from omnijax.train.staleness import make_stale_train_step
    from omnijax.train.state import init_state
    from omnijax.train.step import make_train_step

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    placement = DataParallel(list(mesh.devices.flat))
    if variant == "sync":
        step = make_train_step(graphdef, rest, loss_fn, optimizer)
        return jax.jit(step, donate_argnums=0), lambda p: placement.put_state(init_state(p, optimizer)), placement
    tcfg = TrainerConfig(staleness=variant, dc_lambda=cfg.dc_lambda, dc_adaptive=cfg.dc_adaptive,
                         stale_warmup_steps=cfg.warmup_steps)
    holder = {}

    def init(p):
        state, step = make_stale_train_step(tcfg, graphdef, rest, loss_fn, optimizer, placement,
                                            init_state(p, optimizer))
        if "step" not in holder:
            holder["step"] = jax.jit(step, donate_argnums=0)
        return state

    init(params)
    return (lambda s, b: holder["step"](s, b)), init, placement


def _run_digits(cfg: StalenessBench, variant: str, seeds: list[int]) -> list[float]:
    import jax
    import numpy as np
    from flax import nnx

    from omnijax.models.classifier import Classifier, ClassifierConfig, accuracy

    (xtr, ytr), (xte, yte) = _digits()
    t = cfg.digits
    opt = _optimizer(t, t.steps)
    model = Classifier(ClassifierConfig(in_dim=64, hidden=[64, 64]), rngs=nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:cfg.cpu_devices]), ("dp",))
    step, init, placement = _make_step(variant, model, _classifier_loss, opt, mesh, cfg)
    out = []
    for seed in seeds:
        m = Classifier(ClassifierConfig(in_dim=64, hidden=[64, 64]), rngs=nnx.Rngs(seed))
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        state = init(params)
        rng = np.random.default_rng(seed)
        for _ in range(t.steps):
            idx = rng.choice(len(xtr), t.batch_size, replace=False)
            batch = {"x": xtr[idx], "y": ytr[idx], "loss_mask": np.ones(t.batch_size, np.float32)}
            state, metrics = step(state, placement.put_batch(batch))
            jax.block_until_ready(metrics)  # one step at a time: queued CPU collectives can starve each other
        trained = nnx.merge(graphdef, jax.device_get(state.params), rest)
        out.append(100.0 * float(accuracy(trained, xte, yte)))
    return out


def _run_byte_lm(cfg: StalenessBench, variant: str, seeds: list[int]) -> list[float]:
    import jax
    import numpy as np
    from flax import nnx

    from omnijax.config import LLMConfig
    from omnijax.data import stdlib_text
    from omnijax.models.llm import LLM
    from omnijax.models.losses import lm_loss
    from omnijax.train.step import make_eval_step

    t = cfg.byte_lm
    seq = 64
    mcfg = LLMConfig(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     mlp_dim=128, max_seq_len=seq)
    opt = _optimizer(t, t.steps)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:cfg.cpu_devices]), ("dp",))
    step, init, placement = _make_step(variant, LLM(mcfg, rngs=nnx.Rngs(0)), lm_loss, opt, mesh, cfg)
    held = stdlib_text.packed("eval", seq)
    eval_batches = [held.batch(i, 64) for i in range(4)]
    out = []
    for seed in seeds:
        m = LLM(mcfg, rngs=nnx.Rngs(seed))
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        eval_step = jax.jit(make_eval_step(graphdef, rest, lm_loss))
        state = init(params)
        train = stdlib_text.packed("train", seq, seed=seed)
        for i in range(t.steps):
            state, metrics = step(state, placement.put_batch(train.batch(i, t.batch_size)))
            jax.block_until_ready(metrics)
        total = count = 0.0
        for b in eval_batches:
            s, n = eval_step(state.params, placement.put_batch(b))
            total, count = total + float(s), count + float(n)
        out.append(total / count)
    return out


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import setup_devices

    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(StalenessBench, None, overrides, check=None)
    setup_devices([f"parallel.cpu_devices={cfg.cpu_devices}"])
    bad = [v for v in cfg.variants if v not in VARIANTS] + [t for t in cfg.tasks if t not in ("digits", "byte_lm")]
    if bad or cfg.seeds < 1:
        raise ConfigError(f"unknown variants/tasks {bad} (variants: {', '.join(VARIANTS)}; tasks: digits, byte_lm) "
                          "or seeds < 1")
    import jax
    import numpy as np

    if jax.device_count() < cfg.cpu_devices:
        raise ConfigError(f"cpu_devices={cfg.cpu_devices} but jax sees {jax.device_count()} devices "
                          "(jax started before XLA_FLAGS could be set)")
    seeds = list(range(cfg.seeds))
    for task in cfg.tasks:
        runner = _run_digits if task == "digits" else _run_byte_lm
        tcfg = getattr(cfg, task)
        base = None
        for variant in cfg.variants:
            t0 = time.perf_counter()
            vals = runner(cfg, variant, seeds)
            key = "final_accuracy" if task == "digits" else "final_loss"
            mean = float(np.mean(vals))
            row = {"variant": variant, "task": task, "seeds": len(seeds), key: round(mean, 4),
                   "std": round(float(np.std(vals)), 4), "per_seed": [round(v, 4) for v in vals],
                   "steps": tcfg.steps, "batch_size": tcfg.batch_size, "optimizer": tcfg.optimizer, "lr": tcfg.lr,
                   "dp": cfg.cpu_devices, "warmup_steps": cfg.warmup_steps if variant != "sync" else 0,
                   "seconds": round(time.perf_counter() - t0, 1)}
            if "dc" in variant:
                row.update(dc_lambda=cfg.dc_lambda, dc_adaptive=cfg.dc_adaptive)
            if variant == "sync":
                base = mean
            elif base is not None:
                row["vs"] = "sync"
                row["delta_vs_sync"] = round(mean - base, 4)   # accuracy points / nats per byte
            yield row
