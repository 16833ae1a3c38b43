"""Autoregressive generation with a KV cache: prefill once, then one token per step, many prompts per batch.

One prompt per row, written from index 0 and right-padded (per-row lengths), so a row's cache slot s holds
its position s. The prompt's embeddings are made exactly as training makes them (`MultimodalModel.embed`:
placeholders replaced by the projected encoder outputs), the LLM runs once over them (`LLM.prefill`) and
then once per new token (`LLM.decode`) inside one `lax.while_loop` that stops when every row has hit an
end-of-sequence id or `max_new_tokens` is reached. Greedy by default; `temperature` > 0 samples, with
nucleus filtering by `top_p`; the random stream of a prompt depends only on (seed, prompt index, step),
so a sampled answer does not change with the batch it lands in.

M-RoPE models (Qwen2-VL / Qwen2.5-VL): the prompt carries its `rope_positions` as the packer computes them for
training, and each generated token turns q/k at its cache slot plus the row's delta (`qwen_processor.decode_delta`,
transformers' `rope_deltas`): text after an image continues from the image's largest position, not from its slot.

Layouts: the parameters and the cache live on the training mesh of `parallel.llm` (dp / fsdp / tp; the
cache sharded over kv heads under tp and over rows under dp/fsdp); GSPMD inserts the collectives.
Pipeline and context parallelism are training layouts only (a ConfigError names them). `serve.load.load(DIR,
layout=...)` reads the parameters straight into these shardings (`param_target`), so no device and no host
holds the whole model. A prompt whose length plus `max_new_tokens` exceeds the model's context
(`model.max_seq_len`) is refused with one line before anything runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from omnijax.data import packing, qwen_processor
from omnijax.data.sample import Sample
from omnijax.errors import ConfigError
from omnijax.models.llm import LLM, init_cache
from omnijax.models.mllm import MultimodalModel
from omnijax.parallel import rules as rules_lib
from omnijax.parallel.mesh import make_mesh, parse_layout


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 32
    temperature: float = 0.0   # 0: greedy (argmax)
    top_p: float = 1.0         # nucleus: sample among the most likely tokens holding this much probability
    seed: int = 0

    def check(self) -> "SamplingConfig":
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be > 0")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        return self


@dataclass
class Generation:
    prompt_tokens: list[int]   # ids fed to the LLM (placeholders included)
    tokens: list[int]          # generated ids, up to (not including) the end-of-sequence id
    finish_reason: str         # "eos" | "length"


def choose_tokens(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array,
                  sample: bool) -> jax.Array:
    """Next ids [B] from float32 logits [B, V]: argmax, or a draw from softmax(logits / temperature)
    restricted to the smallest set of most likely tokens whose probability reaches top_p (one key per row)."""
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs            # probability of the more likely tokens
    keep = before < top_p                                  # the most likely token is always kept
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _row_keys(seed: jax.Array, row_ids: jax.Array, step: jax.Array) -> jax.Array:
    base = jax.random.key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(row_ids)


class Generator:
    """Generation from an `LLM` or a `MultimodalModel` (with its parameters) on a `layout` (a
    `parallel.llm` layout string; "" = one device).

    `eos_ids`: ids that end a row's answer; `pad_id`: the id written into the padding of prompts;
    `placeholder`: modality -> placeholder id of the tokenizer (multimodal prompts); `zero_encoders`
    on `generate` replaces every encoder output by zeros (an ablation)."""

    def __init__(self, model: LLM | MultimodalModel, *, layout: str = "", rules: str = "llm_5d",
                 eos_ids: Sequence[int] = (), pad_id: int = 0, placeholder: dict[str, int] | None = None,
                 devices: Sequence[Any] | None = None):
        self.multimodal = isinstance(model, MultimodalModel)
        self.llm_cfg = model.llm.config if self.multimodal else model.config
        self.mm_cfg = model.config if self.multimodal else None
        self.layout, self.mesh = _layout_mesh(self.llm_cfg, layout, devices)
        self.rules = rules_lib.load_rules(rules)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.pad_id, self.placeholder = int(pad_id), placeholder
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self._shardings = rules_lib.state_shardings(params, self.rules, self.mesh)
        self._replicated = NamedSharding(self.mesh, P())
        self.rest = jax.tree.map(lambda x: jax.device_put(x, self._replicated) if _concrete(x) else x, rest)
        self.params = self.place(params) if all(_concrete(x) for x in jax.tree.leaves(params)) else None
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("cache_len", "zero_encoders"))
        self._decode = jax.jit(self._decode_impl, static_argnames=("max_new", "sample"))
        self.specs = packing.encoder_specs(self.mm_cfg) if self.multimodal else {}
        self.mrope = self.multimodal and packing.uses_mrope(self.mm_cfg)
        self.last_timing: dict[str, float] = {}   # the last batch: prefill_s, decode_s, decode_steps

    # -------------------------------------------------------------------------------- shardings
    def place(self, params: Any) -> Any:
        """Parameters (an nnx.State of the model's Params) onto the mesh, sharded by the layout's rules."""
        return jax.device_put(params, self._shardings)

    def _sharding(self, names: tuple, shape: tuple) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(names, shape, self.mesh, "activations"))

    def cache_sharding(self, batch: int, length: int) -> NamedSharding:
        """Where the KV cache [B, S, KVH, Dh] lives: rows over the batch axes, kv heads over tp."""
        shape = (batch, length, self.llm_cfg.num_kv_heads, self.llm_cfg.head_dim)
        return self._sharding(("batch", None, "kv_heads", None), shape)

    # --------------------------------------------------------------------------------- programs
    def _prefill_impl(self, params, batch: dict, last: jax.Array, *, cache_len: int, zero_encoders: bool):
        model = nnx.merge(self.graphdef, params, self.rest)
        llm = model.llm if self.multimodal else model
        x = model.embed(batch, zero_encoders=zero_encoders) if self.multimodal else llm.embed(batch["tokens"])
        b = x.shape[0]
        sh = self.cache_sharding(b, cache_len)
        cache = jax.tree.map(lambda c: jax.lax.with_sharding_constraint(c, sh),
                             init_cache(self.llm_cfg, b, cache_len, x.dtype))
        logits, cache = llm.prefill(x, batch["segment_ids"], batch["positions"], last, cache,
                                    rope_positions=batch.get("rope_positions"))
        return logits, jax.tree.map(lambda c: jax.lax.with_sharding_constraint(c, sh), cache)

    def _decode_impl(self, params, cache, logits0, lengths, row_ids, live, eos, seed, temperature, top_p, deltas, *,
                     max_new: int, sample: bool):
        """(tokens [B, max_new] (pad after a row's end), steps taken); rows with live=False start done.
        `deltas` [B] (M-RoPE; else None): a new token's rope positions are its cache slot plus its row's delta."""
        llm = nnx.merge(self.graphdef, params, self.rest)
        llm = llm.llm if self.multimodal else llm
        b = logits0.shape[0]

        def pick(logits, step):
            return choose_tokens(logits, temperature, top_p, _row_keys(seed, row_ids, step), sample)

        first = jnp.where(live, pick(logits0, jnp.int32(0)), self.pad_id)
        out = jnp.full((b, max_new), self.pad_id, jnp.int32).at[:, 0].set(first)
        done = ~live | jnp.isin(first, eos)

        def cond(carry):
            t, _, _, done = carry
            return (t < max_new) & ~jnp.all(done)

        def body(carry):
            t, cache, out, done = carry
            prev = jax.lax.dynamic_index_in_dim(out, t - 1, axis=1, keepdims=False)
            slot = lengths + t - 1
            rope = None if deltas is None else jnp.repeat((slot + deltas)[:, None], 3, axis=1)
            logits, cache = llm.decode(prev, slot, cache, rope_positions=rope)
            tok = jnp.where(done, self.pad_id, pick(logits, t))
            out = jax.lax.dynamic_update_index_in_dim(out, tok, t, axis=1)
            return t + 1, cache, out, done | jnp.isin(tok, eos)

        t, cache, out, done = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, done))
        return out, t

    # --------------------------------------------------------------------------------- batches
    def _put(self, arrays: dict) -> dict:
        """Host arrays onto the mesh: [B, ...] LLM arrays split over the batch axes, encoder buffers replicated."""
        out = {}
        for k, v in arrays.items():
            v = np.asarray(v)
            row = k in ("tokens", "segment_ids", "positions", "rope_positions", "last", "lengths", "row_ids", "live",
                        "deltas")
            names = ("batch",) + (None,) * (v.ndim - 1) if row else ()
            out[k] = jax.device_put(v, self._sharding(names, v.shape) if row else self._replicated)
        return out

    def prompt_tokens(self, prompt: Sample | Sequence[int]) -> list[int]:
        """The ids the LLM is fed for a prompt (placeholders included)."""
        if isinstance(prompt, Sample):
            return [int(t) for t in self._flatten(prompt).tokens]
        return [int(t) for t in prompt]

    def _flatten(self, prompt: Sample) -> packing.Flat:
        if not self.multimodal:
            if any(s.modality != "text" for s in prompt.segments):
                raise ConfigError("this model is a text LLM: prompts with media need a multimodal model")
            return packing.Flat(np.concatenate([np.asarray(s.data, np.int32) for s in prompt.segments]),
                                np.zeros(0, bool), [])
        return packing.flatten(prompt, self.mm_cfg, self.specs, self.placeholder)

    def _batch(self, flats: list[packing.Flat], rows: int, row_len: int) -> dict:
        if self.multimodal:
            caps = {}
            for name, spec in self.specs.items():
                need = sum(x.shape[0] for f in flats for n, x, _, _ in f.enc if n == name)
                caps[name] = spec.group * _bucket(-(-need // spec.group), 8)
            layout = packing.Layout(rows, row_len, tuple(sorted(caps.items())))
            full = packing.pack([[(f, r) for r, f in enumerate(flats)]], layout, self.specs, self.pad_id,
                                rope=self.mrope)
            return {k: v for k, v in full.items() if k not in ("targets", "loss_mask")}
        tokens = np.full((rows, row_len), self.pad_id, np.int32)
        seg = np.zeros((rows, row_len), np.int32)
        pos = np.zeros((rows, row_len), np.int32)
        for r, f in enumerate(flats):
            n = f.tokens.size
            tokens[r, :n], seg[r, :n], pos[r, :n] = f.tokens, 1, np.arange(n)
        return {"tokens": tokens, "segment_ids": seg, "positions": pos}

    def generate(self, prompts: Sequence[Sample | Sequence[int]], cfg: SamplingConfig = SamplingConfig(), *,
                 batch_size: int = 8, zero_encoders: bool = False, progress: Any = None,
                 params: Any = None, eos_ids: Sequence[int] | None = None) -> list[Generation]:
        """One `Generation` per prompt, in order. A prompt is a `Sample` (text ids and media, as the data
        plane makes them) or a list of token ids (text LLMs). `batch_size` prompts decode together (rounded
        up to a multiple of the layout's batch shards); `progress(n)` is called after each batch; `params`
        and `eos_ids` replace the generator's own for this call."""
        cfg.check()
        eos = tuple(int(i) for i in (self.eos_ids if eos_ids is None else eos_ids))
        params = self.params if params is None else self.place(params)
        if params is None:
            raise ConfigError("Generator: the model was built abstractly; pass params= to generate")
        shards = self.layout.batch_shards
        rows = -(-max(1, batch_size) // shards) * shards
        flats = [self._flatten(p) if isinstance(p, Sample) else
                 packing.Flat(np.asarray(list(p), np.int32), np.zeros(0, bool), []) for p in prompts]
        context = self.llm_cfg.max_seq_len
        for k, f in enumerate(flats):
            if f.tokens.size == 0:
                raise ConfigError(f"prompt {k} is empty: give it at least one token")
            if f.tokens.size + cfg.max_new_tokens > context:
                raise ConfigError(f"prompt {k} has {f.tokens.size} tokens; with max_new_tokens={cfg.max_new_tokens} "
                                  f"that exceeds the model's context of {context} tokens (model.max_seq_len): "
                                  "shorten the prompt or lower max_new_tokens")
        out: list[Generation] = []
        for lo in range(0, len(flats), rows):
            part = flats[lo: lo + rows]
            out += self._generate_batch(params, part, rows, list(range(lo, lo + len(part))), cfg, zero_encoders, eos)
            if progress is not None:
                progress(len(part))
        return out

    def _generate_batch(self, params, flats: list[packing.Flat], rows: int, ids: list[int], cfg: SamplingConfig,
                        zero_encoders: bool, eos: tuple[int, ...]) -> list[Generation]:
        longest = max(f.tokens.size for f in flats)
        row_len = _bucket(longest, 16)
        pad_flat = packing.Flat(np.array([self.pad_id], np.int32), np.zeros(1, bool), [])
        padded = flats + [pad_flat] * (rows - len(flats))
        batch = self._batch(padded, rows, row_len)
        lengths = np.array([f.tokens.size for f in padded], np.int32)
        live = np.arange(rows) < len(flats)
        host = {"last": lengths - 1, "lengths": lengths,
                "row_ids": np.array(ids + [0] * (rows - len(flats)), np.int32), "live": live}
        if self.mrope:  # what each row's new tokens add to their slot (0 for a text prompt)
            host["deltas"] = np.array([qwen_processor.decode_delta(batch["rope_positions"][r], int(n))
                                       for r, n in enumerate(lengths)], np.int32)
        dev = self._put({**batch, **host})
        batch = {k: dev[k] for k in batch}
        t0 = time.perf_counter()
        logits0, cache = self._prefill(params, batch, dev["last"], cache_len=row_len + cfg.max_new_tokens,
                                       zero_encoders=zero_encoders)
        jax.block_until_ready(logits0)
        t1 = time.perf_counter()
        sample = cfg.temperature > 0
        eos_arr = np.full(_bucket(len(eos), 4), -1, np.int32)  # padded: a few eos sets share one program
        eos_arr[:len(eos)] = eos
        tokens, steps = self._decode(params, cache, logits0, dev["lengths"], dev["row_ids"], dev["live"],
                                 jax.device_put(eos_arr, self._replicated),
                                 jnp.int32(cfg.seed), jnp.float32(cfg.temperature if sample else 1.0),
                                 jnp.float32(cfg.top_p), dev.get("deltas"), max_new=cfg.max_new_tokens, sample=sample)
        tokens, steps = jax.device_get((tokens, steps))
        self.last_timing = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "decode_steps": int(steps) - 1}
        tokens = np.asarray(tokens)
        out = []
        for r, f in enumerate(flats):
            row = tokens[r].tolist()
            end = next((i for i, t in enumerate(row) if t in eos), None)
            out.append(Generation([int(t) for t in f.tokens], row if end is None else row[:end],
                                  "length" if end is None else "eos"))
        return out



def _layout_mesh(llm_cfg: Any, layout: str, devices: Sequence[Any] | None) -> tuple[Any, jax.sharding.Mesh]:
    devices = list(jax.devices() if devices is None else devices)
    parsed = parse_layout(layout or "dp1")
    if parsed.pp > 1 or parsed.cp > 1 or parsed.ep > 1:
        raise ConfigError(f"parallel.llm={layout}: generation runs on dp/fsdp/tp layouts; pp, cp and ep are "
                          "training layouts (use e.g. tp2 or dp2xtp2)")
    if parsed.num_devices > len(devices):
        raise ConfigError(f"parallel.llm={layout} needs {parsed.num_devices} devices, {len(devices)} are present")
    return parsed, make_mesh(parsed, devices[:parsed.num_devices], llm_cfg)


def param_target(model: LLM | MultimodalModel, layout: str = "", rules: str = "llm_5d",
                 devices: Sequence[Any] | None = None) -> Any:
    """The Param state of `model` (abstract is enough: ``nnx.eval_shape``) as ``jax.ShapeDtypeStruct`` leaves in
    the shardings ``Generator(model, layout=...)`` runs it in: what a loader reads straight into, so no
    device (and no host) ever holds the whole model."""
    llm_cfg = model.llm.config if isinstance(model, MultimodalModel) else model.config
    _, mesh = _layout_mesh(llm_cfg, layout, devices)
    params = nnx.state(model, nnx.Param)
    shardings = rules_lib.state_shardings(params, rules_lib.load_rules(rules), mesh)
    return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
                        params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _concrete(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float))


def _bucket(n: int, smallest: int) -> int:
    """The power of two >= n (at least `smallest`): prompt shapes compile a few programs, not one per length."""
    return max(smallest, 1 << max(0, int(n) - 1).bit_length())
