"""Byte-level LM on the Python standard library's sources; eval loss vs the unigram baseline."""
from __future__ import annotations

import json
import sys

DESCRIPTION = "byte-level LLM on the Python stdlib's .py files (CPU-sized); eval loss vs unigram baseline"


def unigram_loss(train_files, eval_rows: list[dict]) -> float:
    """Cross entropy (nats/byte) of the eval targets under the train set's byte unigram distribution."""
    import numpy as np

    counts = np.ones(512, np.float64)  # add-one smoothing
    for f in train_files:
        counts[:256] += np.bincount(np.frombuffer(f.read_bytes(), np.uint8), minlength=256)
        counts[257] += 1  # EOS
    logp = np.log(counts / counts.sum())
    num = den = 0.0
    for r in eval_rows:
        m = r["loss_mask"]
        num -= float((logp[r["targets"]] * m).sum())
        den += float(m.sum())
    return num / den


def main(argv: list[str]) -> int:
    from recipes.common import IndexedLoader, load_config, setup_devices

    setup_devices(argv)
    cfg = load_config("tiny_lm", argv)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()

    import jax
    import numpy as np
    from flax import nnx

    from omnijax.data import stdlib_text
    from omnijax.models.llm import LLM
    from omnijax.train.loop import Trainer
    from omnijax.models.losses import lm_loss
    from omnijax.train.metrics import FlopCounter

    if cfg.data.source != "stdlib":
        from omnijax.errors import ConfigError

        raise ConfigError(f"data.source={cfg.data.source!r}: tiny_lm reads only 'stdlib'")
    train = stdlib_text.packed("train", cfg.data.seq_len, seed=cfg.trainer.seed)
    held_out = stdlib_text.packed("eval", cfg.data.seq_len)
    eval_rows = [held_out.row(i) for i in range(cfg.data.eval_batches * cfg.data.batch_size)]
    eval_batches = [{k: np.stack([r[k] for r in eval_rows[i:i + cfg.data.batch_size]]) for k in eval_rows[0]}
                    for i in range(0, len(eval_rows), cfg.data.batch_size)]

    # a constructor, not a model: the trainer creates the parameters directly in their shardings
    model = lambda: LLM(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    placement, loss_fn = None, lm_loss
    if cfg.parallel.llm:  # a 5D layout; otherwise plain data parallelism over every device
        from omnijax.parallel.engine import LLMParallel

        placement = LLMParallel.from_config(cfg)
        build, model, loss_fn = model, lambda: placement.prepare(build()), placement.loss_fn
    # this host loads exactly the rows its devices hold (hosts that share a batch shard, e.g. across pp
    # or tp, load the same rows), for batches of the train and the held-out split alike
    from omnijax.parallel.hosts import take_rows
    from omnijax.train.placement import DataParallel

    host_rows = (placement or DataParallel()).host_rows
    loader = IndexedLoader(train, cfg.data.batch_size, seed=cfg.trainer.seed, rows=host_rows(cfg.data.batch_size))
    held_out = [take_rows(b, host_rows(len(b["tokens"]))) for b in eval_batches]  # this host's rows of each

    trainer = Trainer(cfg, model, loss_fn, loader, placement=placement, eval_data=lambda: held_out,
                      step_flops=FlopCounter.for_model(cfg.model, {}, {}, {}),
                      aux_weights={"moe_aux_loss": 1.0})  # already weighted by model.moe.aux_loss_weight
    result = trainer.fit()
    if result.status != "finished":
        return result.exit_code  # preempted: saved, not finished (EXIT_PREEMPTED)
    baseline = unigram_loss(stdlib_text.train_files(), eval_rows)
    report = {"metrics": {"eval_loss": result.eval["eval_loss"]}, "baselines": {"unigram_loss": baseline},
              "steps": cfg.trainer.steps}
    if jax.process_index() == 0:
        (trainer.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"eval loss {result.eval['eval_loss']:.3f} nats/byte vs unigram baseline {baseline:.3f} "
          f"-> {trainer.run_dir}/eval.json", file=sys.stderr)
    return 0
