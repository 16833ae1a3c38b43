"""Full fine-tuning vs LoRA vs QLoRA (nf4, int8) on tiny_lm's model, side by side in one process on one device.

Each variant is the Trainer's own step (`trainer.lora` set per variant: rank `bench.rank`, alpha 2·rank, all seven
projections), compiled ahead of time: ``memory`` is XLA's compiled memory (argument / output / temp bytes),
``params_bytes`` / ``adapter_bytes`` / ``opt_state_bytes`` the state as held, ``base_block_bytes`` the adapted
base weights (quantised under QLoRA). Then `bench.repeats` interleaved rounds of `bench.steps` steps on the same
batches (rotating which variant goes first): ``step_s`` is the median round, ``*_vs_full`` ratios against the
``full`` row measured in the same run, and ``loss_after`` the loss after every variant has taken the same steps
on the same batches (QLoRA's margin against LoRA on a float32 base is ``loss_after`` of the two rows).

``bench.target=h100`` (any `recipes dryrun` target) also compiles each variant's step, at the same shape, for
that GPU on this machine (`python -m recipes dryrun tiny_lm target=...`, one process per variant, nothing
allocated): ``target_memory`` is XLA's plan per device there (arguments, temporaries, peak, the largest
buffers), beside the CPU's figures, with ``target_peak_vs_full``.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Iterator

import json
import os
import subprocess
import sys

from omnijax import allocator
from omnijax.errors import UserError

DESCRIPTION = ("full fine-tuning vs LoRA vs QLoRA (nf4/int8) on tiny_lm: compiled memory, state bytes, step time, "
               "loss after the same steps")


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import load_config, setup_devices

    setup_devices(overrides)
    target = next((o.split("=", 1)[1] for o in overrides if o.startswith("bench.target=")), None)
    overrides = [o for o in overrides if not o.startswith("bench.target=")]
    extra = [o for o in overrides if o.split("=")[0] in {"bench.rank", "bench.steps", "bench.repeats"}]
    overrides = [o for o in overrides if o not in extra]
    opts = {k.split(".")[1]: int(v) for k, v in (o.split("=", 1) for o in extra)}
    cfg = load_config("tiny_lm", overrides)
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = 0

    import jax
    from flax import nnx

    from omnijax.config import LoraConfig
    from omnijax.data import stdlib_text
    from omnijax.layers import lora as lora_lib
    from omnijax.models import adapters
    from omnijax.models.llm import LLM
    from omnijax.models.losses import lm_loss
    from omnijax.train.loop import Trainer
    from omnijax.train.placement import DataParallel
    from recipes.bench.llm_step import _memory
    from recipes.common import IndexedLoader

    rank = opts.get("rank", 16)
    source = stdlib_text.packed("train", cfg.data.seq_len, seed=cfg.trainer.seed)
    loader = IndexedLoader(source, cfg.data.batch_size)
    host_batches = [next(loader) for _ in range(4)]
    variants = {"full": None, "lora": "float32", "qlora_nf4": "nf4", "qlora_int8": "int8"}
    runs = []
    for name, base_dtype in variants.items():
        trainer_cfg = dataclasses.replace(cfg.trainer, lora=LoraConfig(rank=rank, alpha=2.0 * rank, base_dtype=base_dtype)
                                          if base_dtype else LoraConfig())
        run_cfg = dataclasses.replace(cfg, trainer=trainer_cfg)
        placement = DataParallel(jax.devices()[:1])
        trainer = Trainer(run_cfg, lambda: LLM(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed)), lm_loss, loader,
                          placement=placement)
        state = trainer.state
        batches = [placement.put_batch(b) for b in host_batches]
        compiled = trainer._step.lower(state, batches[0]).compile()
        flat = list(nnx.to_flat_state(state.params))
        nbytes = lambda leaves: sum(v[...].nbytes for _, v in leaves)  # noqa: E731
        blocks = [(p, v) for p, v in flat if not adapters.is_adapter(p) and not str(p[-1]).endswith(
            lora_lib.SCALE_SUFFIX) and str(p[-1]) in adapters.ALL_TARGETS]
        scales = [(p, v) for p, v in flat if str(p[-1]).endswith(lora_lib.SCALE_SUFFIX)]
        runs.append({"variant": name, "step": compiled, "state": state, "batches": batches, "times": [],
                     "memory": _memory(compiled.memory_analysis()),
                     "params_bytes": nbytes(flat), "adapter_bytes": nbytes([x for x in flat if adapters.is_adapter(x[0])]),
                     "base_block_bytes": nbytes(blocks) + nbytes(scales),
                     "opt_state_bytes": sum(x.nbytes for x in jax.tree.leaves(state.opt_state))})
        del trainer
    steps, repeats = opts.get("steps", 3), opts.get("repeats", 3)
    for r in range(repeats):
        for k in range(len(runs)):
            run_ = runs[(r + k) % len(runs)]
            state = run_["state"]
            t0 = time.perf_counter()
            for i in range(steps):
                state, m = run_["step"](state, run_["batches"][i % 4])
            jax.block_until_ready(m)
            run_["times"].append((time.perf_counter() - t0) / steps)
            run_["state"], run_["loss"] = state, float(m["loss"])
    if target:
        model_overrides = [o for o in overrides if not o.startswith("parallel.cpu_devices=")]
        for run_ in runs:
            base = variants[run_["variant"]]
            lora = ([f"trainer.lora.rank={rank}", f"trainer.lora.alpha={2.0 * rank}", f"trainer.lora.base_dtype={base}"]
                    if base else [])
            run_["target"] = target_memory(target, model_overrides + lora)
    full = runs[0]
    for run_ in runs:
        row = {"variant": run_["variant"], "rank": rank if run_["variant"] != "full" else 0,
               "model": {"embed_dim": cfg.model.embed_dim, "num_layers": cfg.model.num_layers,
                         "mlp_dim": cfg.model.mlp_dim, "vocab_size": cfg.model.vocab_size},
               "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len, "memory": run_["memory"],
               "params_bytes": run_["params_bytes"], "adapter_bytes": run_["adapter_bytes"],
               "base_block_bytes": run_["base_block_bytes"], "opt_state_bytes": run_["opt_state_bytes"],
               "step_s": statistics.median(run_["times"]), "loss_after": run_["loss"],
               "steps_taken": steps * repeats, "allocator": allocator.describe()}
        if "target" in run_:
            row["target_memory"] = run_["target"]
            if run_ is not full:
                row["target_peak_vs_full"] = (run_["target"]["peak_bytes_per_device"]
                                              / full["target"]["peak_bytes_per_device"])
        if run_ is not full:
            row.update({"vs": "full",
                        "peak_bytes_vs_full": run_["memory"]["peak_bytes"] / full["memory"]["peak_bytes"],
                        "opt_state_vs_full": run_["opt_state_bytes"] / full["opt_state_bytes"],
                        "base_block_bytes_vs_full": run_["base_block_bytes"] / full["base_block_bytes"],
                        "step_time_vs_full": statistics.median(run_["times"]) / statistics.median(full["times"])})
        yield row


def target_memory(target: str, overrides: list[str]) -> dict:
    """tiny_lm's step with `overrides` compiled for `target` by `recipes dryrun` in its own process: XLA's
    memory per device there (the dryrun report's fields)."""
    cmd = [sys.executable, "-m", "recipes", "dryrun", "tiny_lm", f"target={target}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [""])[-1]
        raise UserError(f"bench lora: dryrun target={target} exited {proc.returncode}: {tail[:200]}")
    r = json.loads(lines[-1])
    keys = ("target", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes_per_device",
            "device_memory_bytes", "fits", "largest_buffers")
    return {k: r[k] for k in keys} | {"command": " ".join(cmd[1:])}
