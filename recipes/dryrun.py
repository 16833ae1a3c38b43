"""Validate a recipe on the CPU for the accelerators it is laid out for.

Without `target=`: the analytic check (config, meshes, shardings, estimated memory per device, step shapes).
With `target=h100x8` (h100, h200, a100; CARDxN, more than 8 are hosts of 8): the recipe's own train step
(the trainer's jit, its layout, encoders and multiplexing) compiled by XLA:GPU for abstract devices of that
card, nothing allocated; a report per device, the last line one JSON object (docs/real-size.md).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

DESCRIPTION = ("check a recipe without running it: dryrun NAME [devices=N] (analytic), or dryrun NAME target=h100x8 "
               "(its own step compiled for that GPU here: memory, largest buffers, kernels, collectives, FLOPs; dump=DIR keeps "
               "XLA's HLO)")
LLM_RECIPES = ("tiny_lm",)


def main(argv: list[str]) -> int:
    from omnijax.errors import UserError

    if not argv or "=" in argv[0]:
        raise UserError("usage: python -m recipes dryrun NAME [devices=64 | target=h100x8] [key=value ...], "
                        "e.g. dryrun omni_8b target=h100x64")
    name, rest = argv[0], argv[1:]
    devices, target, dump, overrides = 64, None, None, []
    for item in rest:
        key, _, value = item.partition("=")
        if key == "devices":
            devices = int(value)
        elif key == "target":
            target = value
        elif key == "dump":
            dump = value
        else:
            overrides.append(item)
    if target is not None:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; run nothing, on no device
        return compiled_dryrun(name, target, overrides, dump=dump)
    from omnijax.train.dryrun import dry_run

    cfg = _load_multimodal(name, overrides)
    print(json.dumps(dry_run(cfg, devices), indent=2))
    return 0


def _load_multimodal(name: str, overrides: list[str]):
    """The recipe's config as it trains (capacity.* left out: sized from data.sources' metadata)."""
    from omnijax.train.multimodal import training_capacity
    from recipes.tiny_omni import load

    if name.startswith("finetune"):
        from recipes import finetune

        cfg = finetune.load(overrides, name, require_data=False)
    else:
        cfg = load(overrides, name)
    training_capacity(cfg)
    return cfg


def _llm_parts(cfg, devices):
    """tiny_lm's trainer wiring (recipes/tiny_lm.py) on `devices`."""
    from flax import nnx

    from omnijax.models.llm import LLM
    from omnijax.models.losses import lm_loss
    from omnijax.parallel.mesh import Layout
    from omnijax.train.placement import DataParallel

    model = lambda: LLM(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    if cfg.parallel.llm:
        from omnijax.parallel.engine import LLMParallel

        placement = LLMParallel.from_config(cfg, devices=devices)
        return (lambda: placement.prepare(model())), placement.loss_fn, placement, placement.layout
    return model, lm_loss, DataParallel(devices), Layout(dp=len(devices))


def _multimodal_parts(cfg, devices):
    """tiny_omni / finetune / omni_8b / omni_moe's trainer wiring on `devices`."""
    from flax import nnx

    from omnijax.models.mllm import MultimodalModel, mm_loss
    from omnijax.parallel.mesh import Layout
    from omnijax.train.placement import DataParallel, multimodal_placement

    build = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    placement = multimodal_placement(cfg.parallel, cfg.model, devices=devices)
    if placement is None:
        return build, mm_loss, DataParallel(devices), Layout(dp=len(devices))
    return (lambda: placement.prepare(build())), placement.loss_fn, placement, placement.engine.layout


def _plan_capacities(cfg, mux) -> dict[str, int]:
    """The encoder-buffer and route capacities of the compiled step.

    What the trainer's first window would reserve (one data-plane window of the recipe's sources, metadata
    only, sized by `Multiplexer.size_window`), grown to the load the config declares: `capacity.NAME`
    (encoder input rows of a global batch) spread evenly over the devices' short buffers, and a route
    capacity that holds every output token of a device going to one destination (an upper bound). The
    built-in world's media are small, so a window of it alone would compile omni_8b with a few dozen
    encoder rows per device instead of the 4096 vision rows its capacity says."""
    import math

    from omnijax.train import multimodal

    tok = None
    if cfg.tokenizer.path:
        from omnijax.data.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg.tokenizer.path)
    loader = multimodal.train_loader(cfg, tok, None)
    window = [next(loader) for _ in range(loader.window)]
    caps = dict(mux.size_window(window))
    D, tokens = mux.grid.num_devices, 0
    for name, r in mux.reductions.items():
        even = math.ceil(int(cfg.capacity[name]) / D / r) * r
        caps[f"{name}_short"] = max(int(caps.get(f"{name}_short", 0)), even)
        tokens += (caps[f"{name}_short"] + int(caps.get(f"{name}_long", 0))) // r
    caps["route"] = max(int(caps.get("route", 0)), tokens)
    return caps


def compiled_dryrun(name: str, target_name: str, overrides: list[str], dump: str | None = None) -> int:
    """Compile `name`'s step for `target_name`; `dump=DIR` keeps XLA's optimised HLO and buffer assignment there."""
    from omnijax import targets
    from omnijax.train import dryrun as lib

    target = targets.parse_target(target_name)
    info = targets.device_info(target.card)
    devices = targets.devices(target)
    overrides = overrides + ["trainer.checkpoint_every=0", "trainer.progress=false"]
    from omnijax.train.metrics import llm_flops_per_token

    if name in LLM_RECIPES:
        from recipes.common import load_config

        cfg = load_config(name, overrides)
        llm_cfg, aux = cfg.model, {"moe_aux_loss": 1.0}
        model, loss_fn, placement, layout = _llm_parts(cfg, devices)
    else:
        cfg = _load_multimodal(name, overrides)
        llm_cfg, aux = cfg.model.llm, None
        model, loss_fn, placement, layout = _multimodal_parts(cfg, devices)
    B, L = cfg.data.batch_size, cfg.data.seq_len
    trainer = lib.abstract_trainer_class()(cfg, model, loss_fn, iter(()), placement=placement, aux_weights=aux)
    batch = _llm_batch(placement if not hasattr(placement, "engine") else placement.engine, llm_cfg, B, L)
    if name not in LLM_RECIPES:
        if hasattr(placement, "engine"):
            batch.update(lib.plan_batch(placement, _plan_capacities(cfg, placement)))
        else:
            batch.update(lib.encoder_batch(placement, cfg.model, cfg.capacity))

    model_flops = llm_flops_per_token(llm_cfg, L) * B * L / target.devices
    with tempfile.TemporaryDirectory(prefix="omnijax_dryrun_") as tmp:
        dump = dump or tmp
        compiled, calls, compile_s = lib.compile_step(trainer, batch, dump)
        analytic = _analytic(trainer, llm_cfg, layout, cfg, calls, info)
        report = lib.target_report(compiled, calls, dump, target=target, info=info, analytic=analytic,
                                   model_flops_per_device=model_flops, compile_s=compile_s)
        report.update(_loop_flops(lib.read_dump(dump)[0], model_flops))
    report = {"recipe": name, **report, "layout": str(layout), "remat": str(cfg.parallel.remat),
              "compute_dtype": cfg.trainer.compute_dtype, "batch_size": B, "seq_len": L,
              "encoder_layout": cfg.parallel.encoder if name not in LLM_RECIPES else None}
    _print_report(report, info)
    print(json.dumps(report))
    return 0


def _llm_batch(placement, llm_cfg, batch_size: int, seq_len: int) -> dict:
    """`lib.llm_batch`, plus each token's M-RoPE positions [B, L, 3] for an M-RoPE LLM (Qwen2-VL /
    Qwen2.5-VL: `model.llm.rope.mrope_section`), as its packed batches carry them: without them the step
    compiled would be the plain-RoPE one, not the one that trains."""
    import jax
    import numpy as np

    from omnijax.train import dryrun as lib

    batch = lib.llm_batch(placement, batch_size, seq_len)
    if getattr(llm_cfg.rope, "mrope_section", None):
        sharding = placement.batch_sharding({"rope_positions": np.zeros((1, 1, 3), np.int32)})["rope_positions"]
        batch["rope_positions"] = jax.ShapeDtypeStruct((batch_size, seq_len, 3), np.int32, sharding=sharding)
    return batch


def _loop_flops(hlo: str, model_flops: float) -> dict:
    """FLOPs of the optimised program with every loop body (the pipeline's scan, the loss's chunks, blockwise
    attention) times its known trip count (`omnijax.perfmodel.step_model.program_flops`: dots and convolutions
    exactly, one FLOP per elementwise output; custom calls, cuDNN attention among them, still 0), where
    `xla_flops` (HloCostAnalysis) counts a loop body once."""
    from omnijax.perfmodel.step_model import program_flops

    if not hlo:
        return {}
    f = program_flops(hlo)
    return {"loop_flops": f["flops"], "loop_matmul_flops": f["matmul_flops"],
            "loop_flops_over_model_flops": round(f["flops"] / model_flops, 3) if model_flops else None}


def _analytic(trainer, llm_cfg, layout, cfg, calls, info) -> dict:
    """The analytic estimate beside XLA's figures, by term (`omnijax.train.dryrun.step_memory_terms`), and the
    one dryrun printed before this compile existed (16 B/param + saved activations + one [tokens x V] fp32)."""
    import jax
    import jax.numpy as jnp

    from omnijax.train import dryrun as lib

    B, L, GiB = cfg.data.batch_size, cfg.data.seq_len, lib.GiB
    dtype = jnp.dtype(cfg.trainer.compute_dtype).itemsize
    leaves = jax.tree.leaves(trainer.state.params)
    params = sum(_shard_elems(x) for x in leaves)
    mask = [True] * len(leaves) if trainer.partition.is_trivial else trainer.partition.mask()
    trained = sum(_shard_elems(x) for x, t in zip(leaves, mask) if t)
    # cuDNN's packed statistics are the LLM's where its layers take cuDNN (a pipeline's stages do not): its calls
    # are those over a row of L / cp positions with the LLM's query heads (all, or a tp share)
    heads = (llm_cfg.num_heads, llm_cfg.num_heads // layout.tp)
    packed = float(info["compute_capability"] or 0) >= 9.0 and any(
        c["impl"] == "cudnn" and c["q"][1] == L // layout.cp and c["q"][2] in heads for c in calls)
    terms = lib.step_memory_terms(llm_cfg, layout, B, L, cfg.parallel.remat, dtype, params, cudnn_packed=packed,
                                  trainable_per_device=trained)
    before = params * lib.BYTES_PER_PARAM + lib.llm_activation_bytes(llm_cfg, layout, B, L, cfg.parallel.remat, dtype)
    return {"terms_gib": {k: round(v / GiB, 2) for k, v in terms.items()},
            "state_gib_per_device": round(terms["state"] / GiB, 2),
            "working_gib_per_device": round((sum(terms.values()) - terms["state"]) / GiB, 2),
            "total_gib_per_device": round(sum(terms.values()) / GiB, 2),
            "before_fix_total_gib_per_device": round(before / GiB, 2)}


def _shard_elems(x) -> int:
    import math

    return math.prod(x.sharding.shard_shape(x.shape))


def _print_report(r: dict, info: dict) -> None:
    """The human half, on stderr (stdout's last line is the JSON object)."""
    GiB = 1 << 30
    out = sys.stderr
    print(f"{r['recipe']} compiled for {r['devices']} x {info['device_kind']} ({r['hosts']} host(s)), layout "
          f"{r['layout']}, remat {r['remat']}, {r['compute_dtype']}, batch {r['batch_size']} x {r['seq_len']} "
          f"({r['compile_s']} s to compile)", file=out)
    print(f"  per device: arguments {r['argument_bytes'] / GiB:.2f} GiB, outputs {r['output_bytes'] / GiB:.2f} GiB "
          f"(aliased {r['alias_bytes'] / GiB:.2f}), temporaries {r['temp_bytes'] / GiB:.2f} GiB -> peak "
          f"{r['peak_bytes_per_device'] / GiB:.2f} of {r['device_memory_bytes'] / GiB:.1f} GiB "
          f"({r['peak_fraction']:.0%}; {'fits' if r['fits'] else 'does NOT fit'} with 10% headroom)", file=out)
    for b in r["largest_buffers_detail"]:
        print(f"  buffer {b['shape']:<28} {b['bytes'] / GiB:7.2f} GiB  {b['op']} {b['instruction']}  {b['source'][-90:]}",
              file=out)
    print(f"  attention: {r['attention_kernels']} (cuDNN custom calls {r['cudnn_custom_calls']})"
          + (f"; cuDNN not taken: {r['cudnn_refused']}" if r.get("cudnn_refused") else ""), file=out)
    print(f"  collectives: {r['collectives']}", file=out)
    flops = r["xla_flops"]
    loops = r.get("loop_flops")
    print(f"  FLOPs per device: XLA {flops or 0:.4g} (a loop body once, custom calls 0), {loops or 0:.4g} with every "
          f"loop body times its trip count, vs the trainer's MFU formula {r['model_flops_per_device']:.4g} "
          "(6N + 12·L·H·Dh·T per token)", file=out)
    a = r.get("analytic")
    if a:
        terms = ", ".join(f"{k} {v}" for k, v in a["terms_gib"].items())
        print(f"  analytic estimate: {a['total_gib_per_device']} GiB ({terms}; before XLA's check it said "
              f"{a['before_fix_total_gib_per_device']} GiB)" + (f"; off by >20%: {'; '.join(r['estimate_check'])}"
                                                                if r.get("estimate_check") else "; within 20% of XLA's"),
              file=out)
    if r.get("advice"):
        print("  " + r["advice"], file=out)
