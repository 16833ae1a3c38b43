"""Training-step throughput of the LLM backbone: tokens/s, model FLOPs per token and MFU.

Two rows, measured side by side in one process: the step on one device (``1dev``), and the step under
``parallel.llm`` on every device (plain data parallelism when it is empty; no second row on one device). Each row names its
``layout`` and ``state_bytes_per_device`` (parameters + optimizer state resident on the fullest device,
read from the arrays' own shards), so a layout that was not applied shows.

Both variants are compiled first, then timed in ``bench.repeats`` interleaved rounds of ``bench.steps``
steps (rotating which goes first): ``step_s`` is the median round, ``step_time_ratio`` the median of the
per-round ratios (``step_time_ratio_per_round``), and ``process_cpu_s_per_wall_s`` shows how many cores
the process actually got in each round (a shared machine gives fewer than it has; ``cpu_s_per_step`` is the
median CPU time of one step, the work a layout costs whatever the load). ``collectives`` and
``all_reduce_then_slice`` are read from the compiled step (gradients reduced whole and then sliced).
Every row names the allocator and ``xla_cpu_threads`` (XLA:CPU's intra-op pool: on CPUs it decides the step
time as much as the allocator; ``parallel.cpu_threads`` sets it). ``bench.only=parallel`` times the
``parallel.llm`` row alone (no 1dev row; what ``bench maxtext`` runs per layout). ``bench.loss_chunks=[0,512]``
measures every row once per ``model.loss_chunk`` (0: the full [tokens x vocabulary] logits), side by side in the
same rounds, each against the same layout's first listed value (``bench.loss_fraction=0.1``: only the last tenth of
each row carries loss, as answers do in fine-tuning data); every row carries XLA's compiled memory
(``memory``: argument / output / temp bytes per device) and its largest buffer with a vocabulary-sized dimension.
"""
from __future__ import annotations

import time
from typing import Iterator

from omnijax import allocator
from omnijax.errors import UserError

DESCRIPTION = ("LLM train-step throughput on 1 device and under parallel.llm (side by side): tokens/s, "
               "FLOPs/token (6N + 12·L·H·Dh·T), MFU, per-device state bytes")


def state_bytes_per_device(tree) -> int:
    """Bytes of the arrays' shards on the device that holds the most of them."""
    import jax

    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", []):
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


def _loss_chunks(text: str) -> list[int]:
    """bench.loss_chunks=[0,512] (or 0,512): the model.loss_chunk values to measure side by side."""
    text = text.strip().strip("[]")
    if not text:
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"bench.loss_chunks={text!r}: a list of model.loss_chunk values such as [0,512]") from None
    if any(v < 0 for v in values) or len(set(values)) != len(values):
        raise UserError(f"bench.loss_chunks={text!r}: distinct values >= 0 (0 = the full-logits loss)")
    return values


def _memory(analysis) -> dict:
    """XLA's compiled memory per device: arguments, outputs, temporaries, and their sum less what outputs alias."""
    get = lambda k: int(getattr(analysis, k, 0) or 0)  # noqa: E731
    out = {"argument_bytes": get("argument_size_in_bytes"), "output_bytes": get("output_size_in_bytes"),
           "temp_bytes": get("temp_size_in_bytes"), "alias_bytes": get("alias_size_in_bytes")}
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def _largest_with(hlo: str, vocab: int, tp: int = 1) -> str | None:
    """The largest array shape in the compiled HLO with a vocabulary-sized dimension (the logits where they
    exist, else a chunk of them or the head weight)."""
    import math
    import re

    dims = {vocab, vocab // max(1, tp)}
    best, size = None, 0
    for shape in set(re.findall(r"\b(?:f32|bf16|f16)\[[0-9,]+\]", hlo)):
        ns = [int(x) for x in shape.split("[")[1][:-1].split(",")]
        n = math.prod(ns) * (2 if shape.startswith(("bf16", "f16")) else 4)
        if dims & set(ns) and n > size:
            best, size = shape, n
    return best


def _cpu_s() -> float:
    """CPU seconds this process used (user + system): over wall time, how many cores it got."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(overrides: list[str]) -> Iterator[dict]:
    from recipes.common import load_config, setup_devices

    setup_devices(overrides)
    extra = [o for o in overrides if o.split("=")[0] in {"bench.warmup", "bench.steps", "bench.repeats", "bench.only",
                                                         "bench.loss_chunks", "bench.loss_fraction"}]
    overrides = [o for o in overrides if o not in extra]
    opts = {k.split(".")[1]: v for k, v in (o.split("=", 1) for o in extra)}
    only = opts.pop("only", "all").strip()
    chunks = _loss_chunks(opts.pop("loss_chunks", ""))
    try:
        fraction = float(opts.pop("loss_fraction", "1"))
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise UserError("bench.loss_fraction: the fraction (0, 1] of each row that carries loss (its last positions, "
                        "as answers in fine-tuning data); 1 = every position")
    if only not in ("all", "parallel"):
        raise UserError(f"bench.only={only!r}: use all (1dev and parallel.llm side by side) or parallel")
    opts = {k: int(v) for k, v in opts.items()}
    cfg = load_config("tiny_lm", overrides)

    import jax
    import numpy as np
    from flax import nnx

    from omnijax.data import stdlib_text
    from omnijax.models.llm import LLM
    from omnijax.parallel.engine import LLMParallel, all_reduce_then_slice, count_collectives
    from omnijax.train.loop import Trainer
    from omnijax.models.losses import lm_loss
    from omnijax.train.metrics import device_peak_flops, llm_flops_per_token, llm_param_counts, mfu, xla_cpu_threads
    from omnijax.train.placement import DataParallel
    from recipes.common import IndexedLoader

    source = stdlib_text.packed("train", cfg.data.seq_len, seed=cfg.trainer.seed)
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = 0
    loader = IndexedLoader(source, cfg.data.batch_size)
    host_batches = [next(loader) for _ in range(4)]
    if fraction < 1:  # fine-tuning-like rows: only the last `fraction` of each row carries loss
        keep = np.arange(cfg.data.seq_len) >= int(round(cfg.data.seq_len * (1 - fraction)))
        host_batches = [{**b, "loss_mask": np.asarray(b["loss_mask"]) * keep} for b in host_batches]
    tokens = cfg.data.batch_size * cfg.data.seq_len
    fpt = llm_flops_per_token(cfg.model, cfg.data.seq_len)
    peak, kind = device_peak_flops()
    total, active = llm_param_counts(cfg.model)
    import dataclasses

    def build(chunk=None):
        model_cfg = cfg.model if chunk is None else dataclasses.replace(cfg.model, loss_chunk=chunk)
        return LLM(model_cfg, rngs=nnx.Rngs(cfg.trainer.seed))

    variants = [("1dev", "1 device", DataParallel(jax.devices()[:1]), lm_loss)]
    if cfg.parallel.llm:
        par = LLMParallel.from_config(cfg)
        variants.append((cfg.parallel.llm, str(par.layout), par, par.loss_fn))
    elif jax.device_count() > 1:
        variants.append((f"dp{jax.device_count()}", f"dp{jax.device_count()} (parameters replicated)",
                         DataParallel(), lm_loss))
    if only == "parallel":
        if len(variants) == 1:
            raise UserError("bench.only=parallel needs parallel.llm=LAYOUT (or several devices)")
        variants = variants[1:]
    # bench.loss_chunks=[0,512]: every variant once per model.loss_chunk (0 = the full-logits loss), side by side
    variants = [(name if c is None else f"{name}:loss_chunk={c}", layout, placement, loss_fn, c)
                for name, layout, placement, loss_fn in variants for c in (chunks or [None])]

    # Every variant built and compiled first; then `repeats` rounds, each timing every variant for `steps`
    # steps in a rotated order, so load from other processes falls on all variants alike. Rows carry the
    # median step time and each round's ratio against 1dev measured in that same round.
    repeats = opts.get("repeats", 5)
    runs = []
    for name, layout, placement, loss_fn, chunk in variants:
        model = ((lambda p=placement, c=chunk: p.prepare(build(c))) if hasattr(placement, "prepare")
                 else (lambda c=chunk: build(c)))
        trainer = Trainer(cfg, model, loss_fn, loader, placement=placement)
        batches = [placement.put_batch(b) for b in host_batches]
        state = trainer.state
        state_bytes = state_bytes_per_device((state.params, state.opt_state))
        t0 = time.perf_counter()
        compiled = trainer._step.lower(state, batches[0]).compile()  # the trainer's own program, ahead of time
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        mem = compiled.memory_analysis()
        for i in range(opts.get("warmup", 2)):
            state, m = compiled(state, batches[i % 4])
        jax.block_until_ready(m)
        runs.append({"name": name, "layout": layout, "placement": placement, "step": compiled, "state": state,
                     "loss_chunk": cfg.model.loss_chunk if chunk is None else chunk, "memory": _memory(mem),
                     "largest_vocab_buffer": _largest_with(hlo, cfg.model.vocab_size, tp=getattr(
                         getattr(placement, "layout", None), "tp", 1)),
                     "batches": batches, "state_bytes": state_bytes, "compile_s": compile_s, "times": [],
                     "cpu": [], "m": m, "collectives": count_collectives(hlo),
                     "all_reduce_then_slice": all_reduce_then_slice(hlo)})
        del trainer
    steps = opts.get("steps", 3)
    for r in range(repeats):
        for k in range(len(runs)):
            run_ = runs[(r + k) % len(runs)]
            state = run_["state"]
            c0, t0 = _cpu_s(), time.perf_counter()
            for i in range(steps):
                state, m = run_["step"](state, run_["batches"][i % 4])
            jax.block_until_ready(m)
            wall = time.perf_counter() - t0
            run_["times"].append(wall / steps)
            run_["cpu"].append((_cpu_s() - c0) / wall)
            run_["state"], run_["m"] = state, m

    base = runs[0]["times"]
    for run_ in runs:
        step_s = float(np.median(run_["times"]))
        n_dev = run_["placement"].mesh.size
        tok_s = tokens / step_s
        row = {"variant": run_["name"], "layout": run_["layout"], "num_devices": n_dev,
               "state_bytes_per_device": run_["state_bytes"], "tokens_per_s": round(tok_s, 1),
               "step_s": round(step_s, 4), "step_s_per_round": [round(t, 4) for t in run_["times"]],
               "rounds": repeats, "steps_per_round": steps,
               "process_cpu_s_per_wall_s": [round(c, 2) for c in run_["cpu"]],
               "cpu_s_per_step": round(float(np.median([t * c for t, c in zip(run_["times"], run_["cpu"])])), 4),
               "compile_s": round(run_["compile_s"], 2), "collectives": run_["collectives"],
               "all_reduce_then_slice": run_["all_reduce_then_slice"],
               "flops_per_token": fpt, "mfu": mfu(tok_s, fpt, n_dev, peak), "device": kind,
               "peak_flops_per_device": peak, "params": total, "active_params": active, "seq_len": cfg.data.seq_len,
               "batch_size": cfg.data.batch_size, "loss_fraction": fraction, "loss": float(np.asarray(run_["m"]["loss"])), "allocator": allocator.in_use(),
               "xla_cpu_threads": xla_cpu_threads(),
               "flops_formula": "6*N_active + 12*layers*heads*head_dim*seq_len",
               **({} if peak else {"mfu_note": f"no datasheet peak FLOP/s for device kind '{kind}'; MFU not computed"})}
        row.update({"loss_chunk": run_["loss_chunk"], "memory": run_["memory"],
                    "largest_vocab_buffer": run_["largest_vocab_buffer"]})
        ref = runs[0]
        if chunks:  # against the same layout with the first loss_chunk listed
            ref = next(r for r in runs if r["layout"] == run_["layout"])
        if run_ is not ref and (chunks or ref["name"] == "1dev"):
            ratios = [t / b for t, b in zip(run_["times"], ref["times"])]
            row.update({"vs": ref["name"], "step_time_ratio": round(float(np.median(ratios)), 3),
                        "step_time_ratio_per_round": [round(x, 3) for x in ratios]})
            if chunks:
                row["temp_bytes_ratio"] = round(run_["memory"]["temp_bytes"] / max(1, ref["memory"]["temp_bytes"]), 4)
        yield row
