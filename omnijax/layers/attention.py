"""Grouped-query attention over packed buffers, with pluggable implementations.

`dot_product_attention` is a pure function: which key a query may see is decided only by segment ids
(same non-zero document) and positions (causality), never by buffer index. Context-parallel attention
can therefore call it on any permuted/sharded layout and merge partial results with the returned
log-sum-exp.

Implementations (`impl`, carried by configs as `model.attention` / `model.encoders.<name>.attention`):
- ``reference``: dense float32 scores [B, KVH, G, Lq, Lk]; the test oracle (`reference_attention`).
- ``blockwise``: pure-JAX flash attention (`omnijax.layers.flash`): linear memory, fully masked blocks
  skipped, a custom backward that honours the lse cotangent.
- ``cudnn``: the cuDNN fused kernel on NVIDIA GPUs where the packed layout fits it (contiguous segments,
  consecutive positions, bf16/fp16, no lse wanted); anything else, checked at trace time and at run time
  (`lax.cond`), goes to ``blockwise``. On other backends it is a ConfigError.
- ``auto``: ``reference`` for tiny problems (Lq*Lk <= 128*128), else ``cudnn`` where it applies on a GPU,
  else ``blockwise``.

"On a GPU" means the devices the step is compiled for (`compiling_for`, which the train step sets from its
layout's mesh), not `jax.default_backend()`: a step compiled on a CPU host for H100s (`recipes dryrun
target=h100`) picks cuDNN as it would on the H100. `recording_kernels` lists each call's choice at trace time.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Iterator, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.config import LLMConfig
from omnijax.errors import ConfigError
from omnijax.layers import rope
from omnijax.layers.flash import blockwise_attention

AttentionImpl = Literal["auto", "reference", "blockwise", "cudnn"]
IMPLS: tuple[str, ...] = ("auto", "reference", "blockwise", "cudnn")
TINY_SCORES = 128 * 128  # auto: at or below Lq*Lk this many, the dense reference is faster than blocks


def attention_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, q_positions: jax.Array,
                   kv_positions: jax.Array, causal: bool = True) -> jax.Array:
    """[B, Lq, Lk] bool: same non-zero segment and (not causal or kv_pos <= q_pos)."""
    mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
    if causal:
        mask &= kv_positions[:, None, :] <= q_positions[:, :, None]
    return mask


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                        kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                        causal: bool = True, scale: float | None = None, return_lse: bool = False):
    """Dense masked softmax attention, the oracle the other implementations are tested against;
    q [B, Lq, H, Dh], k/v [B, Lk, KVH, Dh], H a multiple of KVH.

    Query head h uses kv head h // (H // KVH). Scores, softmax and the normaliser are float32; the
    output has q's dtype. Rows with no visible key return 0 (and lse = -inf), never NaN.
    With return_lse=True also returns lse [B, Lq, H] (float32), log of the softmax denominator, so
    partial results over disjoint key sets merge as sum_i exp(lse_i - lse) * out_i.
    """
    b, lq, h, dh = q.shape
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    g = h // kvh
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    qg = q.reshape(b, lq, kvh, g, dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(scores - m)  # exp(-inf) = 0 for masked keys, with zero gradient
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    safe = jnp.where(denom > 0, denom, 1.0)  # [B, KVH, G, Lq, 1]
    out = out / jnp.moveaxis(safe, 3, 1)  # [B, Lq, KVH, G, 1]
    out = out.reshape(b, lq, h, dh).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(denom > 0, jnp.log(safe) + m, -jnp.inf)[..., 0]  # [B, KVH, G, Lq]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, lq, h)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                          kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                          causal: bool = True, scale: float | None = None, return_lse: bool = False,
                          impl: AttentionImpl = "auto", block_q: int = 128, block_k: int = 128):
    """Masked softmax attention; q [B, Lq, H, Dh], k/v [B, Lk, KVH, Dh], H a multiple of KVH.

    Query head h uses kv head h // (H // KVH). Scores, softmax and the normaliser are float32; the
    output has q's dtype. Rows with no visible key return 0 (and lse = -inf), never NaN.
    With return_lse=True also returns lse [B, Lq, H] (float32), log of the softmax denominator, so
    partial results over disjoint key sets merge as sum_i exp(lse_i - lse) * out_i (and gradients flow
    through the lse). `impl` picks the implementation (module docstring); all agree to float tolerance.
    """
    if impl not in IMPLS:
        raise ConfigError(f"attention impl={impl!r}: must be one of {', '.join(IMPLS)}")
    if impl == "cudnn" and not cudnn_available():
        raise ConfigError(f"attention impl='cudnn' (model.attention or model.encoders.<name>.attention) needs an "
                          f"NVIDIA GPU with cuDNN (compiling for: {_target()[0]}); use attention=auto or "
                          "attention=blockwise")
    kw = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
              kv_positions=kv_positions, causal=causal, scale=scale)
    if impl == "auto":
        if q.shape[1] * k.shape[1] <= TINY_SCORES:
            impl = "reference"
        elif cudnn_available() and _cudnn_shapes_fit(q, k, v, return_lse):
            impl = "cudnn"
        else:
            impl = "blockwise"
    refused = None
    if impl == "cudnn" and not _cudnn_shapes_fit(q, k, v, return_lse):
        impl = "blockwise"
    elif impl == "cudnn" and _partly_manual():
        impl, refused = "blockwise", "inside a partly manual shard_map (a pipeline stage)"
    call = _record(impl, q, k)
    if refused:
        call["cudnn_refused"] = refused
    if impl == "reference":
        return reference_attention(q, k, v, return_lse=return_lse, **kw)
    blockwise = functools.partial(blockwise_attention, block_q=block_q, block_k=block_k, **kw)
    if impl == "cudnn":
        return _cudnn_or_blockwise(q, k, v, blockwise, call=call, **kw)
    out, lse = blockwise(q, k, v)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------ the target
# (platform, compute capability, NVIDIA?) of the devices being compiled for; None: the default backend's
_TARGET: contextvars.ContextVar[tuple[str, tuple[int, ...], bool] | None] = contextvars.ContextVar(
    "omnijax_attention_target", default=None)
_KERNELS: contextvars.ContextVar[list | None] = contextvars.ContextVar("omnijax_attention_kernels", default=None)


def _describe(device) -> tuple[str, tuple[int, ...], bool]:
    cc = str(getattr(device, "compute_capability", "") or "0.0")
    nvidia = device.platform == "gpu" and "nvidia" in str(getattr(device, "device_kind", "")).lower()
    return device.platform, tuple(int(x) for x in cc.split(".") if x.isdigit()) or (0,), nvidia


@contextlib.contextmanager
def compiling_for(devices) -> Iterator[None]:
    """Choose kernels for `devices` (e.g. a mesh's, possibly abstract H100s of a deviceless compile) while
    tracing the enclosed code; None or empty leaves the default backend's choice."""
    devices = list(devices or [])
    target = _describe(devices[0]) if devices else None
    token = _TARGET.set(target)
    try:
        with _jax_checks_for(target):
            yield
    finally:
        _TARGET.reset(token)


@contextlib.contextmanager
def _jax_checks_for(target: tuple[str, tuple[int, ...], bool] | None) -> Iterator[None]:
    """jax's cuDNN attention asks the *local* backend for the compute capability at trace time
    (`fused_attention_stablehlo.check_compute_capability`), so a step traced on a CPU host for H100s would
    be refused cuDNN (and silently take blockwise). While tracing for a GPU target that is not the local
    backend, those two checks answer for the target instead."""
    if target is None or not target[2] or _default_target()[0] == "gpu":
        yield
        return
    from omnijax.jax_private import fused_attention_stablehlo as fused  # private: the checks have no public hook

    cc = target[1]
    parse = lambda c: tuple(int(x) for x in c.split("."))  # noqa: E731
    saved = fused.check_compute_capability, fused.is_cuda_compute_capability_equal
    fused.check_compute_capability = lambda c: cc >= parse(c)
    fused.is_cuda_compute_capability_equal = lambda c: cc == parse(c)
    try:
        yield
    finally:
        fused.check_compute_capability, fused.is_cuda_compute_capability_equal = saved


@functools.cache
def _default_target() -> tuple[str, tuple[int, ...], bool]:
    import jax.extend

    try:
        version = str(jax.extend.backend.get_backend().platform_version).lower()
    except RuntimeError:  # no usable backend: no cuDNN
        return "none", (0,), False
    platform, cc, _ = _describe(jax.devices()[0])
    return platform, cc, platform == "gpu" and "cuda" in version


def _target() -> tuple[str, tuple[int, ...], bool]:
    return _TARGET.get() or _default_target()


@contextlib.contextmanager
def recording_kernels() -> Iterator[list[dict]]:
    """Collect, while tracing, which implementation each attention call became (with its q/k shapes)."""
    calls: list[dict] = []
    token = _KERNELS.set(calls)
    try:
        yield calls
    finally:
        _KERNELS.reset(token)


def _record(impl: str, q: jax.Array, k: jax.Array) -> dict:
    call = {"impl": impl, "q": tuple(q.shape), "k": tuple(k.shape), "dtype": str(q.dtype)}
    calls = _KERNELS.get()
    if calls is not None:
        calls.append(call)
    return call


# ------------------------------------------------------------------------------------------ cuDNN
def cudnn_available() -> bool:
    """Whether the devices compiled for are NVIDIA GPUs (CUDA), where cuDNN's fused attention exists."""
    platform, _, nvidia = _target()
    return platform == "gpu" and nvidia


def _compute_capability() -> tuple[int, ...]:
    return _target()[1]


def _partly_manual() -> bool:
    """Tracing inside a shard_map that is manual over some mesh axes and automatic over others of size > 1
    (the SPMD pipeline: manual over pp). jax's cuDNN attention is custom-partitioned, and its partitioner
    fails there (it reads `.spec` of the GSPMDSharding such a region hands it: omni_8b's pp2xfsdp8xtp4 step
    does not compile for H100s with it), so a call made there directly stays blockwise. The pipeline's stages
    reach cuDNN by wrapping the call in a shard_map manual over every remaining axis
    (`omnijax/parallel/stage_attention.py`); fully manual regions (the encoders' shard_map, the explicit FSDP
    step) and plain GSPMD code keep cuDNN."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return False
    return any(size > 1 for name, size in mesh.shape.items() if name not in mesh.manual_axes)


def _cudnn_shapes_fit(q: jax.Array, k: jax.Array, v: jax.Array, return_lse: bool) -> bool:
    """Static part of "does cuDNN apply": self-attention shapes, bf16/fp16, head dim, and no lse wanted.

    jax 0.10.2's cuDNN path drops the lse's gradient, so any caller that merges by lse (ring CP) stays
    on blockwise."""
    dh = q.shape[-1]
    max_dh = 256 if _compute_capability() >= (9, 0) else 128
    return (not return_lse and q.shape[1] == k.shape[1] and q.dtype == k.dtype == v.dtype
            and q.dtype in (jnp.bfloat16, jnp.float16) and dh % 8 == 0 and dh <= max_dh)


def cudnn_layout(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, q_positions: jax.Array,
                 kv_positions: jax.Array, *, causal: bool, max_segments: int):
    """(fits, seqlens [B, M], offsets [B, M+1]) describing a packed buffer the way cuDNN wants it.

    `fits` (a traced bool) says whether cuDNN computes exactly the reference's mask: queries and keys
    share ids (and positions, if causal); each non-zero segment id is one contiguous run with ids
    increasing along the row; inside a run positions go up by 1 (cuDNN's causality is by index); at most
    `max_segments` runs per row. Unused entries are -1, as jax's packed cuDNN API expects."""
    seg, pos = jnp.asarray(q_segment_ids).astype(jnp.int32), jnp.asarray(q_positions).astype(jnp.int32)
    b, n = seg.shape
    live = seg != 0
    changed = seg[:, 1:] != seg[:, :-1]
    start = jnp.concatenate([jnp.ones((b, 1), bool), changed], axis=1) & live
    end = jnp.concatenate([changed, jnp.ones((b, 1), bool)], axis=1) & live
    prev_max = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jax.lax.cummax(seg, axis=1)[:, :-1]], axis=1)
    fits = jnp.all(~start | (seg > prev_max))                      # ids never come back
    fits &= jnp.all(jnp.sum(start, axis=1) <= max_segments)
    fits &= jnp.all(seg == jnp.asarray(kv_segment_ids).astype(jnp.int32))
    if causal:
        prev_pos = jnp.concatenate([pos[:, :1] - 1, pos[:, :-1]], axis=1)
        fits &= jnp.all(start | ~live | (pos == prev_pos + 1))
        fits &= jnp.all(pos == jnp.asarray(kv_positions).astype(jnp.int32))
    starts = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments + 1, fill_value=-1)[0])(start).astype(jnp.int32)
    ends = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments, fill_value=-1)[0])(end).astype(jnp.int32)
    seqlens = jnp.where(starts[:, :max_segments] >= 0, ends - starts[:, :max_segments] + 1, -1)
    return fits, seqlens, starts


def _cudnn_or_blockwise(q, k, v, blockwise: Callable, *, q_segment_ids, kv_segment_ids, q_positions,
                        kv_positions, causal, scale, call: dict | None = None):
    """cuDNN where the buffer's layout fits it (decided at run time by `lax.cond`), blockwise otherwise.

    Hopper and later: jax's packed cuDNN API (per-segment lengths and offsets). Earlier GPUs: only one
    segment per row starting at index 0 (jax.nn.dot_product_attention's per-row lengths). Known limits
    of jax 0.10.2 handled here: packed cuDNN with grouped-query attention strides K/V by the query head
    count (so K/V heads are repeated there), and rows outside every segment are never written, forward
    or backward (zeroed on both sides). Self-attention only (kv ids/positions equal the queries')."""
    from omnijax.jax_private import fused_attention_stablehlo as fused  # private: the packed API is not public

    b, n, h, dh = q.shape
    g = h // k.shape[2]
    scale = 1.0 / math.sqrt(dh) if scale is None else float(scale)
    packed = _compute_capability() >= (9, 0)
    # jax treats offsets with one segment column as unpacked (unscaled), so the packed bound is >= 2
    max_segments = max(2, min(n, max(64, n // 16))) if packed else 1
    fits, seqlens, offsets = cudnn_layout(q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                          causal=causal, max_segments=max_segments)
    live = jnp.asarray(q_segment_ids) != 0
    if not packed:  # exactly one run per row, starting at index 0 (no empty rows: cuDNN's 0-length rows)
        fits &= jnp.all(offsets[:, 0] == 0)

    def run_cudnn(q, k, v):
        # cuDNN writes neither outputs nor input gradients of rows outside every segment: `where` on the
        # way in and out makes those rows exact zeros in both directions (select drops whatever is there)
        keep = lambda x: jnp.where(live[:, :, None, None], x, jnp.zeros((), x.dtype))  # noqa: E731
        q, k, v = keep(q), keep(k), keep(v)
        if packed:
            kr, vr = (jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)) if g > 1 else (k, v)
            mask = fused.MaskType.PADDING_CAUSAL if causal else fused.MaskType.PADDING
            out = fused.dot_product_attention(q, kr, vr, None, None, seqlens, seqlens, offsets, offsets,
                                              scale=scale, mask_type=mask, qkv_layout="BTNH")
        else:
            lengths = jnp.maximum(seqlens[:, 0], 0)
            out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, query_seq_lengths=lengths,
                                               key_value_seq_lengths=lengths, implementation="cudnn")
        return keep(out)

    try:
        return jax.lax.cond(fits, run_cudnn, lambda q, k, v: blockwise(q, k, v)[0], q, k, v)
    except (NotImplementedError, RuntimeError) as exc:  # this cuDNN/GPU cannot take the shape: blockwise
        if call is not None:
            call.update(impl="blockwise", cudnn_refused=str(exc).splitlines()[0][:200])
        return blockwise(q, k, v)[0]


_ATTENTION: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("omnijax_attention", default=None)


@contextlib.contextmanager
def use_attention(fn: Callable) -> Iterator[None]:
    """Trace the enclosed forward with `fn` in place of `dot_product_attention` (same signature).

    Parallel code swaps in distributed attention (e.g. sequence parallelism inside an encoder) this
    way, so model code stays free of mesh logic."""
    token = _ATTENTION.set(fn)
    try:
        yield
    finally:
        _ATTENTION.reset(token)


def attention_fn() -> Callable:
    """The attention in force: `dot_product_attention` unless `use_attention` says otherwise."""
    return _ATTENTION.get() or dot_product_attention


def _kernel(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)


class Attention(nnx.Module):
    """q/k/v/o projections with per-head shapes (so heads shard on their own logical axis) + RoPE."""

    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs):
        d, h, kvh, dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = nnx.Param(_kernel(rngs, (d, h, dh), d), out_sharding=("embed", "heads", "head_dim"))
        self.k = nnx.Param(_kernel(rngs, (d, kvh, dh), d), out_sharding=("embed", "kv_heads", "head_dim"))
        self.v = nnx.Param(_kernel(rngs, (d, kvh, dh), d), out_sharding=("embed", "kv_heads", "head_dim"))
        self.o = nnx.Param(_kernel(rngs, (h, dh, d), h * dh), out_sharding=("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, dh), jnp.float32), out_sharding=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((kvh, dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((kvh, dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        inv_freq, rope_scale = rope.inv_frequencies(dh, cfg.rope)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a compile-time constant
        self.rope_scale = rope_scale
        self.impl = cfg.attention  # static: which attention implementation (module docstring)

    def project_qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, D] -> rotated q [B, L, H, Dh], rotated k and v [B, L, KVH, Dh]."""
        dt = x.dtype
        q = jnp.einsum("bld,dhk->blhk", x, self.q[...].astype(dt))
        k = jnp.einsum("bld,dhk->blhk", x, self.k[...].astype(dt))
        v = jnp.einsum("bld,dhk->blhk", x, self.v[...].astype(dt))
        if self.q_bias is not None:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        q = rope.apply_rope(q, positions, self.inv_freq, self.rope_scale)
        k = rope.apply_rope(k, positions, self.inv_freq, self.rope_scale)
        return q, k, v

    def output(self, attn: jax.Array) -> jax.Array:
        return jnp.einsum("blhk,hkd->bld", attn, self.o[...].astype(attn.dtype))

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v = self.project_qkv(x, positions)
        attn = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                     q_positions=positions, kv_positions=positions, causal=True, impl=self.impl)
        return self.output(attn)

    # ------------------------------------------------------------------ KV-cache path (generation)
    # Beside the training forward above, which stays as it is: generation computes k/v once per token and
    # keeps them in a cache [B, S, KVH, Dh] whose slot s holds position s of the row (one prompt per row,
    # written from slot 0), so a new token projects only itself; its attention still reads the cache, so the
    # per-token cost grows linearly with the cache's length (docs/benchmarks.md, `bench generate`), not with
    # a prefill of the whole prefix per token.
    def prefill(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, cache_k: jax.Array,
                cache_v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The prompt's attention (as ``__call__``) and its k/v written into cache slots [0, L)."""
        q, k, v = self.project_qkv(x, positions)
        attn = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                     q_positions=positions, kv_positions=positions, causal=True, impl=self.impl)
        cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, 0, 0, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, 0, 0, 0))
        return self.output(attn), cache_k, cache_v

    def decode(self, x: jax.Array, positions: jax.Array, cache_k: jax.Array,
               cache_v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One new token per row: x [B, 1, D] at positions [B]; its k/v go to slot ``positions`` and it
        attends to slots 0..positions of its row (the causal mask of the full forward, read from the cache)."""
        q, k, v = self.project_qkv(x, positions[:, None])
        attn, cache_k, cache_v = cached_decode(q, k, v, positions, cache_k, cache_v)
        return self.output(attn), cache_k, cache_v


def cached_decode(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, cache_k: jax.Array,
                  cache_v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row, already projected and rotated (q/k/v [B, 1, ...]): its k/v written to cache slot
    `positions` [B], and it attends to slots 0..positions of its row. Shared by every rotary flavour."""
    b, s = cache_k.shape[:2]
    rows = jnp.arange(b)
    cache_k = cache_k.at[rows, positions].set(k[:, 0].astype(cache_k.dtype))
    cache_v = cache_v.at[rows, positions].set(v[:, 0].astype(cache_v.dtype))
    slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    attn = reference_attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
                               q_segment_ids=jnp.ones((b, 1), jnp.int32), kv_segment_ids=jnp.ones((b, s), jnp.int32),
                               q_positions=positions[:, None].astype(jnp.int32), kv_positions=slots, causal=True)
    return attn, cache_k, cache_v
