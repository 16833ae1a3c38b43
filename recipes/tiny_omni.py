"""tiny_omni: a tiny vision+audio+LLM model trained on the built-in world (then greedy-decoded) or on the
user's own shards (`data.sources=[...]`, held-out loss on `data.eval_sources=[...]`). The data, placement and
held-out wiring is the library's (`omnijax.train.multimodal`); omni_8b and omni_moe run this recipe's main."""
from __future__ import annotations

import json
import sys
import time

from omnijax.data.sources import WORLD
from omnijax.mm_config import encoder_configs
from omnijax.train import multimodal

DESCRIPTION = ("tiny vision+audio+LLM on the built-in multimodal world (CPU, minutes; per-modality answer accuracy "
               "vs chance) or on your own shards (data.sources=[...])")


def load(argv: list[str], name: str = "tiny_omni") -> multimodal.MultimodalConfig:
    """recipes/configs/<name>.yaml <- key=value overrides, checked."""
    from recipes.common import load_config

    return load_config(name, argv, multimodal.MultimodalConfig, check=multimodal.check)


def main(argv: list[str], name: str = "tiny_omni") -> int:
    from recipes.common import setup_devices

    setup_devices(argv)
    cfg = load(argv, name)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()  # --coordinator/--num-processes/--process-id, or Slurm/MPI/k8s: one job
    t0 = time.perf_counter()

    import jax
    from flax import nnx

    from omnijax.data import world_eval
    from omnijax.data.world import World, token_report
    from omnijax.models.mllm import MultimodalModel, describe, mm_loss
    from omnijax.serve.evaluate import WorldAccuracy, eval_packer
    from omnijax.train.loop import Trainer
    from omnijax.train.metrics import FlopCounter

    tok = None
    if cfg.tokenizer.path:
        from omnijax.data.tokenizer import check_vocab, load_tokenizer

        tok = load_tokenizer(cfg.tokenizer.path)
        check_vocab(tok, cfg.model.llm.vocab_size)
    # greedy-decoded accuracy needs the built-in world's questions; other data get the held-out loss
    world_eval_on = WORLD in (cfg.data.sources or [WORLD])

    placement = multimodal.placement(cfg)
    loader = multimodal.train_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = multimodal.held_out_batches(cfg, tok)
    build = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    model = nnx.eval_shape(build)  # shapes only: the trainer creates the parameters in their shardings
    counts = describe(model)
    print(f"{name}: params {counts}", file=sys.stderr)
    flops = FlopCounter.for_model(cfg.model.llm, encoder_configs(cfg.model),
                                  {k.partition(".")[2]: v for k, v in counts.items() if k.startswith("encoder.")},
                                  {k.partition(".")[2]: v for k, v in counts.items() if k.startswith("projector.")})
    train_model, loss_fn = ((build, mm_loss) if placement is None else
                            (lambda: placement.prepare(build()), placement.loss_fn))
    evaluate = None
    if world_eval_on:  # decodes with the single-device model; a parallel layout's params are mapped back to it
        items = world_eval.eval_items(World(cfg.world, "eval"), cfg.eval.items)
        packer = eval_packer(cfg.model, cfg.eval.batch_size, cfg.data.seq_len, cfg.data.batch_size, cfg.capacity)
        evaluate = WorldAccuracy(model, packer, items, cfg.eval.max_new_tokens, cfg.eval.ablation_items, placement)
    trainer = Trainer(cfg, train_model, loss_fn, loader, placement=placement, eval_fn=evaluate, eval_data=held_out,
                      step_flops=flops)
    result = trainer.fit()
    if result.status != "finished":
        return result.exit_code  # preempted: saved, not finished (EXIT_PREEMPTED)
    if jax.process_index() != 0:  # process 0 decoded the world's questions and reports for the job
        return 0
    t_total = time.perf_counter() - t0
    data = {k: v for k, v in loader.metrics().items() if k.startswith(("skipped", "dropped", "split"))}
    if evaluate is None:
        report = {"metrics": result.eval, "steps": cfg.trainer.steps, "wall_s": round(t_total, 1), "data": data,
                  "sources": cfg.data.sources, "eval_sources": cfg.data.eval_sources}
        held = (f"eval_loss {result.eval['eval_loss']:.4f} over {result.eval['eval_tokens']} held-out tokens"
                if "eval_loss" in (result.eval or {}) else "no data.eval_sources: no held-out loss")
        summary = f"{held}; {data.get('skipped_bad_records', 0)} bad records skipped "
    else:
        chances = world_eval.chances(list(items))
        report = {"metrics": result.eval, "chance": chances, **evaluate.report(),
                  "eval_items_per_modality": cfg.eval.items, "steps": cfg.trainer.steps,
                  "wall_s": round(t_total, 1), "data": data,
                  "tokens": token_report(World(cfg.world, "train"), 1000, cfg.model)}
        summary = world_eval.accuracy_table(result.eval, chances, evaluate.zeroed, list(items)) + "\n"
    (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"{summary}({cfg.trainer.steps} steps, {t_total:.0f} s) -> {trainer.run_dir}/eval.json", file=sys.stderr)
    return 0
