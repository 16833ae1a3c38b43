"""Typed configs: dataclasses filled from YAML, then `key=value` overrides, then validated.

Every field has a type and a default; unknown keys, wrong types and impossible values raise
`ConfigError` naming the dotted field and what is allowed, before any work starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from omnijax.errors import ConfigError


# ----------------------------------------------------------------------------------- sections
@dataclass
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2
    mlp_dim: int = 128
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    # Which layers are MoE: every `every`-th layer starting at `first` (every=0: none).
    every: int = 0
    first: int = 0


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0          # yarn: ramp bounds in rotations over original_max_position
    beta_slow: float = 1.0
    attention_factor: float = 0.0    # yarn: cos/sin scale; 0 = 0.1*ln(factor)+1
    # M-RoPE (Qwen2-VL / Qwen2.5-VL): rotary pairs turned by the temporal, height and width position of
    # each token (sums to head_dim / 2); [] = one position per token (omnijax/layers/mrope.py)
    mrope_section: list[int] = field(default_factory=list)


@dataclass
class LLMConfig:
    vocab_size: int = 256
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    qkv_bias: bool = False
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    max_seq_len: int = 256
    # attention implementation: auto (cudnn on GPUs where it fits, blockwise, dense for tiny lengths) |
    # reference (dense, the test oracle) | blockwise (pure-JAX flash) | cudnn (NVIDIA GPUs only)
    attention: Literal["auto", "reference", "blockwise", "cudnn"] = "auto"
    # positions per row whose logits the loss holds at once (models/losses.py::head_cross_entropy);
    # 0 = the full [tokens x vocabulary] logits (the old path)
    loss_chunk: int = 512


@dataclass
class ParallelConfig:
    llm: str = ""            # layout string such as "pp2xdp2xtp2"; "" = all devices on dp
    encoder: str = ""        # such as "edp4xesp2"; "" = all devices on edp
    cpu_devices: int = 0     # fake N CPU devices when no accelerator is present (0 = leave alone)
    # threads of XLA:CPU's intra-op pool (0 = XLA's choice, max(cores, CPU devices)); more than the cores
    # balances its parallel tasks better on small machines (docs/performance.md)
    cpu_threads: int = 0
    rules: str = "llm_5d"    # shardings/<rules>.yaml
    encoder_rules: str = "encoder_dp"  # shardings/<encoder_rules>.yaml: encoders on the (edp, esp) view
    microbatches: int = 0    # pipeline microbatches (0 = 2 x pp)
    pipeline_schedule: Literal["gpipe", "circular"] = "gpipe"
    # recompute in the backward pass: "none", "full" (every layer, LLM and encoders) or "save_dots"
    # (keep matmul outputs); true/false read as full/none
    remat: Literal["none", "full", "save_dots"] | bool = "none"
    # encoders + resharding inside the pipeline loop, one microbatch ahead of stage 0 (needs pp > 1)
    interleave_encoders: bool = False


@dataclass
class DataConfig:
    source: str = "stdlib"   # stdlib | world | a path; recipes interpret it
    seq_len: int = 128
    batch_size: int = 16     # global batch, in sequences
    eval_batches: int = 8
    workers: int = 0


@dataclass
class TokenizerConfig:
    path: str = ""           # folder with a Hugging Face tokenizer.json; "" = byte-level (the built-in world's)


@dataclass
class MediaConfig:
    """How media files become sample arrays (audio is always resampled to the encoders' 16 kHz)."""
    video_fps: float = 2.0       # frames kept per second of video
    max_video_frames: int = 64   # cap on kept frames per clip (0 = no cap)


@dataclass
class MMDataConfig:
    """The data section of a multimodal recipe: the user's shards (or the built-in world) and how to mix them."""
    sources: list[str] = field(default_factory=list)       # folders/globs of `recipes convert` shards; [] = the built-in world
    eval_sources: list[str] = field(default_factory=list)  # held-out shards: `eval_loss` every trainer.eval_every steps
    mix: Any = None          # None (uniform) | {name: weight} | [{step: N, weights: {name: weight}}]; names = folder names
    seq_len: int = 128
    batch_size: int = 16     # global batch, in rows of seq_len tokens
    eval_batches: int = 8    # batches of data.eval_sources per evaluation
    media: MediaConfig = field(default_factory=MediaConfig)
    bad_shards: Literal["stop", "skip"] = "stop"  # a shard that disagrees with its manifest: stop naming it, or skip it


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    lr_scale: dict[str, float] = field(default_factory=dict)  # part -> factor on the schedule, e.g. {vision: 0.1}


@dataclass
class LoraConfig:
    """Low-rank adapters (omnijax/models/adapters.py): rank 0 = off. The base of an adapted part stays frozen."""
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    parts: list[str] = field(default_factory=lambda: ["llm"])
    base_dtype: Literal["float32", "nf4", "int8"] = "float32"  # QLoRA: the frozen base held quantised


@dataclass
class TrainerConfig:
    steps: int = 300
    run_name: str = "default"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    grad_accum: int = 1
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    max_nonfinite_in_row: int = 5
    progress: bool = True
    # the parts that train (`llm`, `projector`, encoder names); [] = all. Frozen parts hold no optimizer state.
    trainable: list[str] = field(default_factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters on trainer.lora.parts; trainable adds to them
    prefetch: int = 2        # batches read, planned and transferred ahead in a background thread (0 = inline)
    # Stale data parallelism (omnijax/train/staleness.py): apply the all-reduced gradient one step late.
    staleness: Literal["sync", "stale1", "stale1+dc", "stale1+wp", "stale1+dc+wp"] = "sync"
    dc_lambda: float = 0.04          # delay compensation strength (stale1+dc)
    dc_adaptive: bool = False        # lambda / sqrt(mean square of the gradient), as in DC-ASGD-a
    stale_warmup_steps: int = 10     # synchronous steps before staleness starts
    # Faults (docs/reliability.md): -1 resumes from the newest checkpoint that reads back intact
    resume_step: int = -1
    peer_timeout_s: float = 60.0     # a process silent this long stops every survivor with one line
    hang_timeout_s: float = 1800.0   # no step finished this long (after the first): stacks, one line, exit 124; 0 = off


@dataclass
class Config:
    model: LLMConfig = field(default_factory=LLMConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# --------------------------------------------------------------------------------- validation
_POSITIVE = {
    "model.vocab_size", "model.embed_dim", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.mlp_dim", "model.max_seq_len", "model.moe.num_experts", "model.moe.top_k",
    "model.moe.mlp_dim", "data.seq_len", "data.batch_size", "trainer.steps", "trainer.log_every",
    "trainer.grad_accum", "trainer.keep_checkpoints", "trainer.max_nonfinite_in_row",
}
_NON_NEGATIVE = {"model.loss_chunk", "trainer.seed", "optimizer.warmup_steps", "optimizer.weight_decay", "optimizer.grad_clip",
                 "parallel.cpu_devices", "parallel.cpu_threads", "parallel.microbatches", "trainer.checkpoint_every",
                 "trainer.eval_every", "data.eval_batches", "data.workers",
                 "trainer.dc_lambda", "trainer.stale_warmup_steps", "trainer.prefetch"}


def validate(cfg: Config) -> Config:
    """Check values that types alone cannot; raise ConfigError naming the field and the fix."""
    for path in _POSITIVE | _NON_NEGATIVE:
        value = get(cfg, path)
        if path in _POSITIVE and value <= 0:
            raise ConfigError(f"{path}={value}: must be > 0")
        if value < 0:
            raise ConfigError(f"{path}={value}: must be >= 0")
    m = cfg.model
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim}: must be even (rotary embeddings rotate pairs)")
    if m.moe.every and m.moe.top_k > m.moe.num_experts:
        raise ConfigError(f"model.moe.top_k={m.moe.top_k} must be <= model.moe.num_experts={m.moe.num_experts}")
    if cfg.trainer.resume_step < -1 or cfg.trainer.resume_step == 0:
        raise ConfigError(f"trainer.resume_step={cfg.trainer.resume_step}: a saved step (>= 1), or -1 for the newest "
                          "good checkpoint")
    if not cfg.trainer.peer_timeout_s > 0:
        raise ConfigError(f"trainer.peer_timeout_s={cfg.trainer.peer_timeout_s}: must be > 0 seconds")
    if not cfg.trainer.hang_timeout_s >= 0:
        raise ConfigError(f"trainer.hang_timeout_s={cfg.trainer.hang_timeout_s}: must be >= 0 seconds (0 turns the "
                          "hang watch off)")
    if not 0 < cfg.optimizer.lr < 10:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr}: must be in (0, 10)")
    if not 0 <= cfg.optimizer.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio={cfg.optimizer.min_lr_ratio}: must be in [0, 1]")
    if cfg.data.batch_size % cfg.trainer.grad_accum:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must be divisible by trainer.grad_accum={cfg.trainer.grad_accum}")
    if not cfg.trainer.run_name or "/" in cfg.trainer.run_name:
        raise ConfigError(f"trainer.run_name={cfg.trainer.run_name!r}: must be a non-empty name without '/'")
    return cfg


# ------------------------------------------------------------------------------ dict -> typed
def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of fields, got {value!r}")
        return from_dict(tp, value, prefix=path + ".")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}={value!r}: must be {_type_name(tp)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, arg, value)
            except ConfigError:
                pass
        raise ConfigError(f"{path}={value!r}: must be {' or '.join(_type_name(a) for a in args)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r}: must be a list")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(f"{path}[{i}]", item, v) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r}: must be a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{path}={value!r}: must be {_type_name(tp)}") from None
        if tp is int and not number.is_integer():
            raise ConfigError(f"{path}={value!r}: must be int")
        return tp(number)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path}={value!r}: must be {_type_name(tp)}")
    return value


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a (possibly partial) nested dict; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known fields: {', '.join(names)}"
        raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set_nested(tree: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{path}': '{part}' is a value, not a section")
        tree = node
    tree[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """`a.b=1 c=x` -> nested dict; values are parsed as YAML scalars (1, 1e-3, true, [1,2])."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}': expected key=value, e.g. trainer.steps=50")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_nested(tree, key.strip(), value)
    return tree


def explicit_overrides(overrides: list[str], prefix: str) -> dict:
    """The `prefix.*` keys given in `overrides`, as dotted paths below `prefix` -> value (what the user set
    explicitly, e.g. to check against a config a pretrained folder implies)."""
    tree = parse_overrides([a for a in overrides if a.partition("=")[0].strip().startswith(prefix + ".")])
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


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    base = data.pop("base", None)
    if base:
        data = merge(load_yaml(path.parent / base), data)
    return data


def build(cls: type = Config, yaml_path: str | Path | None = None, overrides: list[str] | None = None,
          defaults: dict | None = None, check: Any = validate) -> Any:
    """Dataclass defaults <- recipe defaults <- YAML file (and its includes) <- command-line overrides, then
    validated. A recipe's default (its run_name) gives way to a value the YAML sets."""
    tree = merge(defaults or {}, load_yaml(yaml_path) if yaml_path else {})
    tree = merge(tree, parse_overrides(overrides or []))
    cfg = from_dict(cls, tree)
    return check(cfg) if check else cfg
