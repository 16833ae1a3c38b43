"""Training-step throughput of the LLM backbone: tokens/s, model FLOPs per token and MFU."""
from __future__ import annotations

import time
from typing import Iterator

DESCRIPTION = "LLM train-step throughput: tokens/s, FLOPs/token (6N + 12·L·H·Dh·T) and MFU vs device peak"


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import load_config, setup_devices

    setup_devices(overrides)
    extra = [o for o in overrides if o.split("=")[0] in {"bench.warmup", "bench.steps"}]
    overrides = [o for o in overrides if o not in extra]
    opts = {k.split(".")[1]: int(v) for k, v in (o.split("=") for o in extra)}
    cfg = load_config("tiny_lm", overrides)

    import jax
    import numpy as np
    from flax import nnx

    from omnijax.data import stdlib_text
    from omnijax.models.llm import LLM
    from omnijax.train.loop import Trainer
    from omnijax.train.losses import lm_loss
    from omnijax.train.metrics import device_peak_flops, llm_flops_per_token, llm_param_counts, mfu
    from recipes.common import IndexedLoader

    source = stdlib_text.packed("train", cfg.data.seq_len, seed=cfg.trainer.seed)
    loader = IndexedLoader(source, cfg.data.batch_size)
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = 0
    trainer = Trainer(cfg, LLM(cfg.model, rngs=nnx.Rngs(0)), lm_loss, loader)
    batches = [trainer.placement.put_batch(next(loader)) for _ in range(4)]
    state = trainer.state
    t0 = time.perf_counter()
    state, m = trainer._step(state, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for i in range(opts.get("warmup", 2)):
        state, m = trainer._step(state, batches[i % 4])
    jax.block_until_ready(m)
    steps = opts.get("steps", 10)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = trainer._step(state, batches[i % 4])
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / steps
    tokens = cfg.data.batch_size * cfg.data.seq_len
    fpt = llm_flops_per_token(cfg.model, cfg.data.seq_len)
    peak, kind = device_peak_flops()
    tok_s = tokens / step_s
    total, active = llm_param_counts(cfg.model)
    yield {"variant": "tiny_lm", "tokens_per_s": round(tok_s, 1), "flops_per_token": fpt,
           "mfu": mfu(tok_s, fpt, jax.device_count(), peak), "device": kind, "num_devices": jax.device_count(),
           "peak_flops_per_device": peak, "step_s": round(step_s, 4), "compile_s": round(compile_s, 2),
           "params": total, "active_params": active, "seq_len": cfg.data.seq_len,
           "batch_size": cfg.data.batch_size, "loss": float(np.asarray(m["loss"])),
           "flops_formula": "6*N_active + 12*layers*heads*head_dim*seq_len",
           **({} if peak else {"mfu_note": f"no datasheet peak FLOP/s for device kind '{kind}'; MFU not computed"})}
