"""finetune: LLaVA-style training from pretrained parts on your converted shards.

Stage 1 (projector only, from Hugging Face folders):
  python -m recipes finetune init.llm=LLAMA_DIR init.encoders.vision=SIGLIP_DIR init.encoders.audio=WHISPER_DIR \
      trainer.trainable=[projector] data.sources=[shards/train] trainer.run_name=stage1
Stage 2 (LLM + projector, from stage 1's latest checkpoint):
  python -m recipes finetune init.checkpoint=runs/stage1 trainer.trainable=[llm,projector] \
      data.sources=[shards/train] trainer.run_name=stage2

`model.llm` comes from `init.llm`'s config.json, each `model.encoders.NAME` from its folder (SigLIP or
Whisper, with the preprocessing it was trained on); `init.checkpoint` takes the model and the tokenizer
of that run. The data wiring (data plane, held-out loss, parallel layouts) is tiny_omni's.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnijax.config import build, from_dict, parse_overrides
from omnijax.errors import ConfigError
from omnijax.mm_config import MMConfig
from recipes import tiny_omni

DESCRIPTION = ("LLaVA-style fine-tuning from pretrained HF folders (init.llm, init.encoders.NAME) or a previous "
               "run (init.checkpoint), with frozen parts (trainer.trainable) on your converted shards")

# LLM fields that are a choice of this run, not of the pretrained architecture: an override may set them
_RUNTIME_LLM_KEYS = {"attention"}


@dataclass
class InitConfig:
    llm: str = ""                # Hugging Face Llama/Qwen2 folder: model.llm and the tokenizer come from it
    encoders: dict[str, str] = field(default_factory=dict)  # encoder name -> SigLIP or Whisper folder
    checkpoint: str = ""         # a previous run's folder: its latest checkpoint's parameters, its model and tokenizer
    adapter: str = ""            # a PEFT LoRA adapter folder: the LLM's adapters start from it (trainer.lora from its config)


@dataclass
class FinetuneConfig(tiny_omni.OmniConfig):
    init: InitConfig = field(default_factory=InitConfig)


def _explicit(argv: list[str], prefix: str) -> dict:
    """The `prefix.*` keys given on the command line, as dotted paths below `prefix` -> value."""
    tree = parse_overrides([a for a in argv if a.partition("=")[0].strip().startswith(prefix + ".")])
    for part in prefix.split("."):
        tree = tree.get(part, {})
    out: dict = {}

    def walk(node, path):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif path:
            out[path] = node
    walk(tree, "")
    return out


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def _agree(where: str, source: str, built, explicit: dict, allowed: set[str] = frozenset()) -> None:
    """An explicit override that disagrees with the config a pretrained folder/run implies: one line."""
    for key, value in explicit.items():
        if key.split(".")[-1] in allowed:
            continue
        try:
            have = _get(built, key)
        except (AttributeError, KeyError, TypeError):
            raise ConfigError(f"{where}.{key}: not a field of the model {source} defines") from None
        if have != value and not (isinstance(have, float) and isinstance(value, (int, float)) and float(value) == have):
            raise ConfigError(f"{where}.{key}={value!r} disagrees with {source} ({have!r}); drop the override "
                              f"(the model comes from {source})")


def resolve(cfg: FinetuneConfig, argv: list[str]) -> FinetuneConfig:
    """The model and tokenizer from the pretrained folders or the previous run, checked against overrides."""
    from omnijax.train import warmstart

    init = cfg.init
    if init.adapter:  # trainer.lora follows the adapter (rank, alpha, targets); a different explicit rank is an error
        from omnijax.interop import peft

        lora = peft.lora_config(init.adapter)
        if cfg.trainer.lora.rank not in (0, lora.rank):
            raise ConfigError(f"trainer.lora.rank={cfg.trainer.lora.rank}: init.adapter={init.adapter} has rank "
                              f"{lora.rank}; drop trainer.lora.rank")
        cfg.trainer.lora = dataclasses.replace(lora, base_dtype=cfg.trainer.lora.base_dtype)
    if init.checkpoint:
        if init.llm or init.encoders:
            raise ConfigError("init.checkpoint starts from a previous run's parameters: drop init.llm / "
                              "init.encoders (that run was initialised from them already)")
        warmstart.latest_step(init.checkpoint)
        prev = warmstart.run_config(init.checkpoint)
        try:
            model = from_dict(MMConfig, prev["model"], prefix="model.")
        except (KeyError, TypeError):
            raise ConfigError(f"init.checkpoint={init.checkpoint}: its config.json has no multimodal model "
                              "(not a finetune/tiny_omni run)") from None
        _agree("model", f"init.checkpoint={init.checkpoint}", model, _explicit(argv, "model"), allowed=_RUNTIME_LLM_KEYS)
        for key in _RUNTIME_LLM_KEYS:
            setattr(model.llm, key, getattr(cfg.model.llm, key))
        cfg.model = model
        prev_tok = (prev.get("tokenizer") or {}).get("path", "")
        if cfg.tokenizer.path and cfg.tokenizer.path != prev_tok:
            raise ConfigError(f"tokenizer.path={cfg.tokenizer.path}: init.checkpoint={init.checkpoint} was trained "
                              f"with {prev_tok or 'the byte-level tokenizer'}; drop tokenizer.path")
        cfg.tokenizer.path = prev_tok
        return cfg
    from omnijax.interop import pretrained

    if init.llm:
        llm = pretrained.llm_config_from_folder(init.llm)
        explicit = {k.removeprefix("llm."): v for k, v in _explicit(argv, "model").items() if k.startswith("llm.")}
        _agree("model.llm", f"init.llm={init.llm}", llm, explicit, allowed=_RUNTIME_LLM_KEYS)
        for key in _RUNTIME_LLM_KEYS:
            setattr(llm, key, getattr(cfg.model.llm, key))
        cfg.model.llm = llm
        if not cfg.tokenizer.path:
            cfg.tokenizer.path = str(Path(init.llm))
    for name, path in init.encoders.items():
        enc = pretrained.encoder_config_from_folder(path)
        explicit = {k.removeprefix(f"encoders.{name}."): v for k, v in _explicit(argv, "model").items()
                    if k.startswith(f"encoders.{name}.")}
        explicit.pop("kind", None) if explicit.get("kind") == enc.kind else None
        _agree(f"model.encoders.{name}", f"init.encoders.{name}={path}", enc, explicit, allowed={"attention"})
        if "attention" in explicit:
            enc.attention = explicit["attention"]
        cfg.model.encoders[name] = dataclasses.asdict(enc)
    return cfg


def load(argv: list[str], name: str = "finetune") -> FinetuneConfig:
    """recipes/configs/finetune.yaml <- key=value overrides, the model resolved from `init.*`, then checked."""
    from recipes.common import CONFIGS

    named = any(o.startswith("trainer.run_name=") for o in argv)
    cfg = build(FinetuneConfig, CONFIGS / f"{name}.yaml", argv,
                defaults=None if named else {"trainer": {"run_name": name}}, check=None)
    if not cfg.data.sources or tiny_omni.WORLD in cfg.data.sources:
        raise ConfigError("finetune trains on your converted shards: data.sources=[DIR,...] (from `python -m recipes "
                          "convert input=FILE output=DIR tokenizer.path=LLM_DIR`); the built-in world is tiny_omni's")
    return tiny_omni.check(resolve(cfg, argv))


def _check_tokenizer(cfg: FinetuneConfig, tok) -> None:
    """The tokenizer must be the LLM's: its text ids fit the LLM's table, and under init.llm it is the folder's own."""
    from omnijax.data.tokenizer import check_llm_vocab, load_tokenizer

    where = f"init.llm={cfg.init.llm}" if cfg.init.llm else (
        f"init.checkpoint={cfg.init.checkpoint}" if cfg.init.checkpoint else "model.llm")
    check_llm_vocab(tok, cfg.model.llm.vocab_size, where)
    own = Path(cfg.init.llm) / "tokenizer.json" if cfg.init.llm else None
    if own is not None and own.is_file() and Path(cfg.tokenizer.path).resolve() != Path(cfg.init.llm).resolve():
        if load_tokenizer(cfg.init.llm).fingerprint != tok.fingerprint:
            raise ConfigError(f"tokenizer.path={cfg.tokenizer.path} is not the tokenizer of init.llm={cfg.init.llm} "
                              "(the LLM was trained with its own): drop tokenizer.path and convert the data with "
                              f"tokenizer.path={cfg.init.llm}")


def main(argv: list[str], name: str = "finetune") -> int:
    from recipes.common import setup_devices

    setup_devices(argv)
    cfg = load(argv, name)
    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()
    t0 = time.perf_counter()

    import jax
    from flax import nnx

    from omnijax.data.tokenizer import load_tokenizer
    from omnijax.interop import peft
    from omnijax.models import adapters
    from omnijax.models.mllm import MultimodalModel, mm_loss
    from omnijax.train import warmstart
    from omnijax.train.loop import Trainer

    tok = load_tokenizer(cfg.tokenizer.path)
    _check_tokenizer(cfg, tok)
    placement = tiny_omni.multiplexed(cfg)
    if placement is not None and placement.engine.schedule is not None and (cfg.init.llm or cfg.init.checkpoint):
        raise ConfigError(f"parallel.llm={cfg.parallel.llm}: starting from pretrained or previous parameters is not "
                          "supported under pipeline parallelism yet; use dp/fsdp/tp/cp layouts")
    loader = tiny_omni.make_loader(cfg, tok, placement)  # opens (and checks) the data before the model is built
    held_out = tiny_omni.held_out_batches(cfg, tok)
    build_model = lambda: MultimodalModel(cfg.model, rngs=nnx.Rngs(cfg.trainer.seed))  # noqa: E731
    train_model, loss_fn = ((build_model, mm_loss) if placement is None else
                            (lambda: placement.prepare(build_model()), placement.loss_fn))
    trainer = Trainer(cfg, train_model, loss_fn, loader, placement=placement, eval_data=held_out)
    resuming = trainer.checkpointer is not None and trainer.checkpointer.latest_step() is not None
    if not resuming:  # a fresh start: the parameters come from init.*; a resumed run from its own checkpoint
        params = trainer.state.params
        if cfg.init.checkpoint:  # adapters come from a LoRA run; from a run without them they start fresh
            from_run = lambda p: warmstart.params_from_run(cfg.init.checkpoint, p)  # noqa: E731
            if adapters.has_adapters(params) and not peft.lora_of(warmstart.run_config(cfg.init.checkpoint)):
                step = warmstart.latest_step(cfg.init.checkpoint)
                params = adapters.with_base(params, lambda base: from_run(base)[0])
            else:
                params, step = from_run(params)
            print(f"{name}: parameters of {cfg.init.checkpoint} step {step}", file=sys.stderr)
        elif cfg.init.llm or cfg.init.encoders:  # into the base; trainer.lora's adapters stay as initialised
            params = adapters.with_base(params, lambda base: warmstart.load_pretrained(base, cfg.init.llm,
                                                                                      cfg.init.encoders))
            froms = ([f"llm <- {cfg.init.llm}"] if cfg.init.llm else []) + [
                f"{k} <- {v}" for k, v in cfg.init.encoders.items()]
            print(f"{name}: pretrained " + ", ".join(froms), file=sys.stderr)
        if cfg.init.adapter:
            params = peft.load_adapter(cfg.init.adapter, params)
            print(f"{name}: adapters <- {cfg.init.adapter}", file=sys.stderr)
        trainer.state = trainer.state.replace(params=params)
    result = trainer.fit()
    if result.status != "finished":
        return result.exit_code  # preempted: saved, not finished (EXIT_PREEMPTED)
    held = (f"eval_loss {result.eval['eval_loss']:.4f} over {result.eval['eval_tokens']} held-out tokens"
            if result.eval and "eval_loss" in result.eval else "no data.eval_sources: no held-out loss")
    data = {k: v for k, v in loader.metrics().items() if k.startswith(("skipped", "dropped"))}
    if jax.process_index() == 0:
        import json

        (trainer.run_dir / "eval.json").write_text(json.dumps({"metrics": result.eval or {}, "data": data,
                                                               "steps": cfg.trainer.steps}, indent=2))
    print(f"{held}; {data.get('skipped_bad_records', 0)} bad records skipped ({cfg.trainer.steps} steps, "
          f"{time.perf_counter() - t0:.0f} s) -> {trainer.run_dir}; export it with "
          f"`python -m recipes export {trainer.run_dir} output=DIR`", file=sys.stderr)
    return 0
