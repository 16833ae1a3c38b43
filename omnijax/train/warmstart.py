"""Start a run from what exists: pretrained Hugging Face folders for some parts, or another run's parameters.

LLaVA-style training runs in stages: stage 1 starts the LLM and the encoders from pretrained folders
(`init.llm`, `init.encoders.NAME`), stage 2 from stage 1's latest checkpoint (`init.checkpoint`); a PEFT
adapter folder (`init.adapter`) starts the LLM's LoRA adapters. Only the parameters carry over: the
optimizer and the data start fresh. Every part is read straight into the sharding the trainer gave it (the
interop readers read only the slices this host's devices hold; the checkpoint restore reads onto the
target's shardings), so no host holds the whole model.

A recipe that starts from them gives its config an `init: InitConfig` section and calls, in order:
`resolve_init(cfg, argv)` (the model and tokenizer the folders or the run imply, checked against the
command line), `check_tokenizer`, `check_placement`, and on a fresh start (not a resume)
`initial_params(cfg, trainer.state.params)`.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from omnijax.config import explicit_overrides, from_dict
from omnijax.errors import ConfigError, UserError
from omnijax.mm_config import MMConfig
from omnijax.train.checkpoint import abstract_like

CHECKPOINTS = "checkpoints"
# LLM fields that are a choice of this run, not of the pretrained architecture: an override may set them
RUNTIME_LLM_KEYS = {"attention"}


@dataclass
class InitConfig:
    """Where a run's parameters start (`init.*`); all empty: from scratch."""
    llm: str = ""                # Hugging Face Llama/Qwen2 folder: model.llm and the tokenizer come from it
    encoders: dict[str, str] = field(default_factory=dict)  # encoder name -> SigLIP or Whisper folder
    checkpoint: str = ""         # a previous run's folder: its latest checkpoint's parameters, its model and tokenizer
    adapter: str = ""            # a PEFT LoRA adapter folder: the LLM's adapters start from it (trainer.lora from its config)
    model: str = ""              # a whole released MLLM folder (Qwen2.5-VL / Qwen2-VL): model.*, weights and tokenizer


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


def resolve_init(cfg: Any, argv: list[str]) -> Any:
    """`cfg` (a multimodal config with an `init: InitConfig` section) with its model and tokenizer taken from the
    pretrained folders or the previous run, checked against the `model.*` overrides of `argv` (an override
    that disagrees is a ConfigError); `trainer.lora` follows `init.adapter`."""
    init = cfg.init
    if init.adapter:  # trainer.lora follows the adapter (rank, alpha, targets); a different explicit rank is an error
        from omnijax.interop import peft

        lora = peft.lora_config(init.adapter)
        if cfg.trainer.lora.rank not in (0, lora.rank):
            raise ConfigError(f"trainer.lora.rank={cfg.trainer.lora.rank}: init.adapter={init.adapter} has rank "
                              f"{lora.rank}; drop trainer.lora.rank")
        cfg.trainer.lora = dataclasses.replace(lora, base_dtype=cfg.trainer.lora.base_dtype)
    if init.model:
        return _resolve_model(cfg, argv)
    if init.checkpoint:
        if init.llm or init.encoders:
            raise ConfigError("init.checkpoint starts from a previous run's parameters: drop init.llm / "
                              "init.encoders (that run was initialised from them already)")
        latest_step(init.checkpoint)
        prev = run_config(init.checkpoint)
        try:
            model = from_dict(MMConfig, prev["model"], prefix="model.")
        except (KeyError, TypeError):
            raise ConfigError(f"init.checkpoint={init.checkpoint}: its config.json has no multimodal model "
                              "(not a finetune/tiny_omni run)") from None
        _agree("model", f"init.checkpoint={init.checkpoint}", model, explicit_overrides(argv, "model"),
               allowed=RUNTIME_LLM_KEYS)
        for key in RUNTIME_LLM_KEYS:
            setattr(model.llm, key, getattr(cfg.model.llm, key))
        cfg.model = model
        _capacity_for_model(cfg, argv, keep=True)
        prev_tok = (prev.get("tokenizer") or {}).get("path", "")
        if cfg.tokenizer.path and cfg.tokenizer.path != prev_tok:
            raise ConfigError(f"tokenizer.path={cfg.tokenizer.path}: init.checkpoint={init.checkpoint} was trained "
                              f"with {prev_tok or 'the byte-level tokenizer'}; drop tokenizer.path")
        cfg.tokenizer.path = prev_tok
        return cfg
    from omnijax.interop import pretrained

    if init.llm:
        llm = pretrained.llm_config_from_folder(init.llm)
        explicit = {k.removeprefix("llm."): v for k, v in explicit_overrides(argv, "model").items()
                    if k.startswith("llm.")}
        _agree("model.llm", f"init.llm={init.llm}", llm, explicit, allowed=RUNTIME_LLM_KEYS)
        for key in RUNTIME_LLM_KEYS:
            setattr(llm, key, getattr(cfg.model.llm, key))
        cfg.model.llm = llm
        if not cfg.tokenizer.path:
            cfg.tokenizer.path = str(Path(init.llm))
    for name, path in init.encoders.items():
        enc = pretrained.encoder_config_from_folder(path)
        explicit = {k.removeprefix(f"encoders.{name}."): v for k, v in explicit_overrides(argv, "model").items()
                    if k.startswith(f"encoders.{name}.")}
        explicit.pop("kind", None) if explicit.get("kind") == enc.kind else None
        _agree(f"model.encoders.{name}", f"init.encoders.{name}={path}", enc, explicit, allowed={"attention"})
        if "attention" in explicit:
            enc.attention = explicit["attention"]
        cfg.model.encoders[name] = dataclasses.asdict(enc)
    return cfg


def _resolve_model(cfg: Any, argv: list[str]) -> Any:
    """`init.model`: the whole model (vision tower, merger, M-RoPE LLM) and the tokenizer from a Qwen2.5-VL /
    Qwen2-VL folder; capacities not given on the command line are sized from the data (the recipe's defaults
    were for other encoders)."""
    from omnijax.interop import qwen_vl

    init = cfg.init
    if init.llm or init.encoders or init.checkpoint:
        raise ConfigError(f"init.model={init.model} is the whole model: drop init.llm / init.encoders / "
                          "init.checkpoint (a later stage starts from this run with init.checkpoint alone)")
    if not qwen_vl.is_qwen_vl(init.model):
        raise ConfigError(f"init.model={init.model}: not a Qwen2.5-VL / Qwen2-VL folder (config.json's model_type "
                          f"must be one of {', '.join(qwen_vl.MODEL_TYPES)})")
    model, _ = qwen_vl.config_from_folder(init.model)
    _agree("model", f"init.model={init.model}", model, explicit_overrides(argv, "model"), allowed=RUNTIME_LLM_KEYS)
    for key in RUNTIME_LLM_KEYS:
        setattr(model.llm, key, getattr(cfg.model.llm, key))
    cfg.model = model
    _capacity_for_model(cfg, argv, keep=False)
    if not cfg.tokenizer.path:
        cfg.tokenizer.path = str(Path(init.model))
    return cfg


def _capacity_for_model(cfg: Any, argv: list[str], keep: bool) -> None:
    """`capacity.*` for the model init.* brought: the recipe's defaults for encoders it lacks dropped (`keep`: its
    own encoders' kept; else sized from the data), what the command line gives kept (and checked later)."""
    from omnijax.mm_config import encoder_configs

    given, encs = explicit_overrides(argv, "capacity"), encoder_configs(cfg.model)
    cfg.capacity = {k: v for k, v in cfg.capacity.items() if k in given or (keep and k in encs)}


def check_tokenizer(cfg: Any, tok: Any) -> None:
    """The tokenizer must be the LLM's: its text ids fit the LLM's table, and under init.llm it is the folder's own."""
    from omnijax.data.tokenizer import check_llm_vocab, load_tokenizer

    key, folder = ("init.model", cfg.init.model) if getattr(cfg.init, "model", "") else ("init.llm", cfg.init.llm)
    where = f"{key}={folder}" if folder else (
        f"init.checkpoint={cfg.init.checkpoint}" if cfg.init.checkpoint else "model.llm")
    check_llm_vocab(tok, cfg.model.llm.vocab_size, where)
    own = Path(folder) / "tokenizer.json" if folder else None
    if own is not None and own.is_file() and Path(cfg.tokenizer.path).resolve() != Path(folder).resolve():
        if load_tokenizer(folder).fingerprint != tok.fingerprint:
            raise ConfigError(f"tokenizer.path={cfg.tokenizer.path} is not the tokenizer of {key}={folder} "
                              "(the LLM was trained with its own): drop tokenizer.path and convert the data with "
                              f"tokenizer.path={folder}")


def check_placement(cfg: Any, placement: Any) -> None:
    """Starting from pretrained parts or a previous run is not supported under a pipelined LLM layout yet; a
    whole Qwen-VL folder (`init.model`) is: its LLM's layers are read into the stages' stacks."""
    if placement is not None and placement.engine.schedule is not None and (cfg.init.llm or cfg.init.checkpoint):
        raise ConfigError(f"parallel.llm={cfg.parallel.llm}: starting from pretrained or previous parameters is not "
                          "supported under pipeline parallelism yet; use dp/fsdp/tp/cp layouts")


def initial_params(cfg: Any, params: Any, name: str) -> Any:
    """A fresh run's parameters (`params`: the trainer's, in their shardings) with `init.*` read into them, each
    source named on stderr as `NAME: ...`: a previous run's parameters (a LoRA run's adapters with them; from a
    run without adapters they start fresh), else the pretrained folders into the base (trainer.lora's adapters
    stay as initialised), then a PEFT adapter folder."""
    from omnijax.interop import peft
    from omnijax.models import adapters

    init = cfg.init
    if init.checkpoint:
        from_run = lambda p: params_from_run(init.checkpoint, p)  # noqa: E731
        if adapters.has_adapters(params) and not peft.lora_of(run_config(init.checkpoint)):
            step = latest_step(init.checkpoint)
            params = adapters.with_base(params, lambda base: from_run(base)[0])
        else:
            params, step = from_run(params)
        print(f"{name}: parameters of {init.checkpoint} step {step}", file=sys.stderr)
    elif getattr(init, "model", ""):
        from omnijax.interop import qwen_vl

        params = adapters.with_base(params, lambda base: qwen_vl.load_params(init.model, _abstract(base)))
        print(f"{name}: pretrained model <- {init.model}", file=sys.stderr)
    elif init.llm or init.encoders:
        params = adapters.with_base(params, lambda base: load_pretrained(base, init.llm, init.encoders))
        froms = ([f"llm <- {init.llm}"] if init.llm else []) + [f"{k} <- {v}" for k, v in init.encoders.items()]
        print(f"{name}: pretrained " + ", ".join(froms), file=sys.stderr)
    if init.adapter:
        params = peft.load_adapter(init.adapter, params)
        print(f"{name}: adapters <- {init.adapter}", file=sys.stderr)
    return params


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else abstract_like(x), tree)


def load_pretrained(params: Any, llm: str = "", encoders: dict[str, str] | None = None) -> Any:
    """`params` (the model's Param state, arrays in their shardings) with the LLM and the named encoders
    replaced by the weights of their Hugging Face folders, each in the sharding of the array it replaces."""
    from omnijax.interop import pretrained

    if llm:
        if "llm" not in params:
            raise UserError("init.llm: this model has no `llm` part")
        params["llm"] = pretrained.load_llm_params(llm, _abstract(params["llm"]))
    for name, path in (encoders or {}).items():
        if "encoders" not in params or name not in params["encoders"]:
            have = ", ".join(params["encoders"]) if "encoders" in params else "none"
            raise UserError(f"init.encoders.{name}: the model has no encoder {name!r} (its encoders: {have})")
        params["encoders"][name] = pretrained.load_encoder_params(path, _abstract(params["encoders"][name]))
    return params


def run_config(run_dir: str | Path) -> dict:
    """The config a run was started with (`RUN_DIR/config.json`, written by the trainer)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: no config.json (not a run folder; runs are under runs/<trainer.run_name>)")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def latest_step(run_dir: str | Path, key: str = "init.checkpoint") -> int:
    """The newest checkpoint step of a run whose files match their checksums (a damaged newer one is skipped
    with one line); a run without one is a one-line error."""
    import orbax.checkpoint as ocp

    from omnijax.train.checkpoint import newest_good_step

    folder = Path(run_dir) / CHECKPOINTS
    steps = ocp.CheckpointManager(folder.absolute()).all_steps() if folder.is_dir() else []
    if not steps:
        raise UserError(f"{key}={run_dir}: the run has no checkpoint in {folder} (it saved none: train it with "
                        "trainer.checkpoint_every > 0, or let it finish)")
    return newest_good_step(folder.absolute(), [int(s) for s in steps], f"{key}={run_dir}")  # checksums checked


def params_from_run(run_dir: str | Path, params: Any, key: str = "init.checkpoint") -> tuple[Any, int]:
    """The parameters of a run's latest checkpoint, restored onto the shapes and shardings of `params`
    (arrays or ShapeDtypeStructs); its optimizer state and data position are not read."""
    import orbax.checkpoint as ocp

    step = latest_step(run_dir, key)
    target = _abstract(params)
    args = ocp.args.PyTreeRestore(item={"params": target}, partial_restore=True,
                                  restore_args=jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding),
                                                            {"params": target}))
    manager = ocp.CheckpointManager((Path(run_dir) / CHECKPOINTS).absolute())
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=args))
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{key}={run_dir}: its checkpoint {step} does not hold this model's parameters "
                        f"({str(exc).splitlines()[0][:160]})") from None
    finally:
        manager.close()
    return restored["state"]["params"], step


def origins(run_dir: str | Path) -> dict:
    """Where a run's parts came from, following `init.checkpoint` back to the first stage:
    {"llm": HF folder or None, "encoders": {name: HF folder}, "tokenizer": folder or "", "model": a whole
    model's folder (`init.model`) or None}."""
    seen: list[Path] = []
    run = Path(run_dir)
    cfg = run_config(run)
    tokenizer = (cfg.get("tokenizer") or {}).get("path", "")
    while True:
        init = cfg.get("init") or {}
        if not init.get("checkpoint"):
            return {"llm": init.get("llm") or None, "encoders": dict(init.get("encoders") or {}),
                    "tokenizer": tokenizer, "model": init.get("model") or None}
        seen.append(run.resolve())
        run = Path(init["checkpoint"])
        if run.resolve() in seen:
            raise UserError(f"{run_dir}: init.checkpoint runs form a cycle through {run}")
        cfg = run_config(run)
