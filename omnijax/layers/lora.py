"""Low-rank adapters on the projections of existing modules, without editing them (op interception).

A module whose weight `W` (an `nnx.Param` read as `self.q[...]`) carries an adapter gets two sibling
parameters `q_lora_a` `[*in, r]` and `q_lora_b` `[r, *out]` and a class that swaps attribute `q` for a
view: reading `self.q[...]` then gives a `LoraArray`, which the module's own `x @ w` / `jnp.einsum(spec, x, w)`
turns into `x·W + (alpha/r)·(x·A)·B`. `W` is never merged with the adapter inside the step: the backward
computes gradients for A and B from `x·A` (no full-weight gradient), and the input gradient through W.

With a quantised base (QLoRA) the frozen `W` is stored as codes (`nf4`: two 4-bit indices into the NF4 table
per byte, or `int8`) with per-block absmax scales in `q_qscale`; the view dequantises it to the compute dtype
right before the matmul.

Parameter paths of the base weights are unchanged (`attn/q`), so Hugging Face import/export and checkpoints of
the base keep their names; the adapters are new leaves beside them.
"""
from __future__ import annotations

import contextlib
import functools
import math
import string
import threading
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

A_SUFFIX, B_SUFFIX, SCALE_SUFFIX = "_lora_a", "_lora_b", "_qscale"
RANK_AXIS = "lora_rank"          # logical axis of the rank dimension (no rule maps it: replicated)
STACKED = ("stage", None, "layers")  # leading axes a pipelined stack adds (omnijax.parallel.engine)
QUANT_BLOCK = 64                 # QLoRA: elements of the input axis sharing one absmax scale

# NormalFloat4 (Dettmers et al. 2023, the values bitsandbytes uses): quantiles of N(0, 1) scaled to [-1, 1]
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


# ------------------------------------------------------------------------------------ quantised base
def quantize(w: jax.Array, kind: str, n_stack: int = 0) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of `w` `[*stack, d_in, ...]`: absmax scales per block of QUANT_BLOCK input rows (the
    first axis after the stacked ones) and every other element; nf4 codes pack two 4-bit indices per byte
    along the last axis."""
    shape = w.shape
    d_in = shape[n_stack]
    blk = math.gcd(d_in, QUANT_BLOCK)
    blocks = w.reshape(*shape[:n_stack], d_in // blk, blk, *shape[n_stack + 1:])
    absmax = jnp.max(jnp.abs(blocks), axis=n_stack + 1)
    scale = jnp.where(absmax > 0, absmax, 1.0)
    unit = blocks / jnp.expand_dims(scale, n_stack + 1)
    if kind == "int8":
        codes = jnp.clip(jnp.round(unit * 127.0), -127, 127).astype(jnp.int8).reshape(shape)
        return codes, scale
    # nearest NF4 value: midpoints between consecutive table entries are the decision boundaries
    mids = jnp.asarray((NF4[1:] + NF4[:-1]) / 2)
    idx = jnp.searchsorted(mids, unit.reshape(shape)).astype(jnp.uint8)
    pairs = idx.reshape(*shape[:-1], shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8), scale


def dequantize(codes: jax.Array, scale: jax.Array, kind: str, dtype: Any) -> jax.Array:
    """The weight `quantize` stored, in `dtype` (inside the step, right before its matmul)."""
    if kind == "int8":
        unit = codes.astype(jnp.float32) / 127.0
    else:
        lo, hi = codes & 0xF, codes >> 4
        idx = jnp.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
        unit = jnp.asarray(NF4)[idx.astype(jnp.int32)]
    d_in, n_blocks = unit.shape[0], scale.shape[0]
    blocks = unit.reshape(n_blocks, d_in // n_blocks, *unit.shape[1:])
    return (blocks * scale[:, None].astype(jnp.float32)).reshape(unit.shape).astype(dtype)


# ---------------------------------------------------------------------------------- the lazy weight
class LoraArray:
    """W + scale·A·B, never formed: `x @ w` and (under `intercept`) `jnp.einsum(spec, x, w)` compute
    x·W + scale·(x·A)·B. `n_in` leading axes of W are its inputs (2 for `o` [heads, head_dim, embed])."""

    def __init__(self, w: jax.Array, a: jax.Array, b: jax.Array, scale: float, n_in: int):
        self.w, self.a, self.b, self.scale, self.n_in = w, a, b, scale, n_in

    shape = property(lambda self: self.w.shape)
    dtype = property(lambda self: self.w.dtype)
    ndim = property(lambda self: self.w.ndim)

    def astype(self, dtype: Any) -> "LoraArray":
        return LoraArray(self.w.astype(dtype), self.a.astype(dtype), self.b.astype(dtype), self.scale, self.n_in)

    def merged(self) -> jax.Array:
        """W + scale·A·B as one array (export, and any op the interception does not know)."""
        a = self.a.reshape(-1, self.a.shape[-1])
        b = self.b.reshape(self.b.shape[0], -1)
        return self.w + (self.scale * (a @ b)).reshape(self.w.shape).astype(self.w.dtype)

    def __jax_array__(self) -> jax.Array:
        return self.merged()

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        if self.n_in != 1 or self.w.ndim != 2:
            return x @ self.merged()
        low = (x @ self.a) * jnp.asarray(self.scale, x.dtype)
        return x @ self.w + low @ self.b


def _lora_einsum(original: Callable, spec: str, x: Any, w: LoraArray, **kw: Any) -> jax.Array:
    """`einsum(spec, x, w)` of a two-operand spec whose right operand is W: base + scale·(x·A)·B."""
    ins, out = spec.replace(" ", "").split("->")
    lhs, rhs = ins.split(",")
    rin, rout = rhs[:w.n_in], rhs[w.n_in:]
    keep = "".join(c for c in lhs if c not in rin)
    if not (set(rin) <= set(lhs) and set(rout) <= set(out) and set(keep) <= set(out) and not set(rin) & set(out)):
        return original(spec, x, w.merged(), **kw)
    r = next(c for c in string.ascii_letters if c not in spec)
    base = original(spec, x, w.w, **kw)
    low = original(f"{lhs},{rin}{r}->{keep}{r}", x, w.a, **kw)
    low = low * jnp.asarray(w.scale, low.dtype)
    return base + original(f"{keep}{r},{r}{rout}->{out}", low.astype(w.b.dtype), w.b, **kw).astype(base.dtype)


_DEPTH = threading.local()
_ORIGINAL_EINSUM = jnp.einsum


def _einsum(*operands: Any, **kw: Any) -> Any:
    if len(operands) == 3 and isinstance(operands[0], str):
        spec, x, w = operands
        if isinstance(w, LoraArray):
            return _lora_einsum(_ORIGINAL_EINSUM, spec, x, w, **kw)
        if isinstance(x, LoraArray):  # W on the left: swap the operands in the spec
            ins, out = spec.split("->")
            lhs, rhs = ins.split(",")
            return _lora_einsum(_ORIGINAL_EINSUM, f"{rhs},{lhs}->{out}", w, x, **kw)
    operands = tuple(o.merged() if isinstance(o, LoraArray) else o for o in operands)
    return _ORIGINAL_EINSUM(*operands, **kw)


@contextlib.contextmanager
def intercept():
    """`jnp.einsum` understands `LoraArray` operands while the body runs (re-entrant; the original is back
    afterwards). An adapted module's methods run inside it, so only their own einsums are touched."""
    depth = getattr(_DEPTH, "n", 0)
    if depth == 0:
        jnp.einsum = _einsum
    _DEPTH.n = depth + 1
    try:
        yield
    finally:
        _DEPTH.n -= 1
        if _DEPTH.n == 0:
            jnp.einsum = _ORIGINAL_EINSUM


_OFF = threading.local()


@contextlib.contextmanager
def disabled():
    """Adapted modules compute with their base weights alone while the body traces (DPO's reference model is
    the policy with its adapters off)."""
    before = getattr(_OFF, "on", False)
    _OFF.on = True
    try:
        yield
    finally:
        _OFF.on = before


class _View:
    """What an adapted module reads as `self.<name>`: `[...]` gives the LoraArray (base dequantised if it is
    stored quantised); anything else (shape, metadata) is the base Param's."""

    def __init__(self, module: nnx.Module, name: str, n_in: int):
        self._module, self._name, self._n_in = module, name, n_in

    def _var(self, suffix: str = "") -> Any:
        return vars(self._module)[self._name + suffix]

    def __getitem__(self, idx: Any) -> LoraArray:
        base, a, b = self._var(), self._var(A_SUFFIX)[...], self._var(B_SUFFIX)[...]
        meta = base.get_metadata()
        w = base[...]
        if meta.get("lora_quant"):
            w = dequantize(w, self._var(SCALE_SUFFIX)[...], meta["lora_quant"], a.dtype)
        if getattr(_OFF, "on", False):
            return w[idx]
        out = LoraArray(w, a, b, meta["lora_scale"], self._n_in)
        if idx is Ellipsis:
            return out
        return out.merged()[idx]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._var(), attr)


def _method(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kw: Any) -> Any:
        with intercept():
            return fn(*args, **kw)
    return wrapped


_CLASSES: dict[tuple[type, tuple], type] = {}


def adapted_class(cls: type, targets: dict[str, int]) -> type:
    """`cls` with the attributes in `targets` (name -> input axes) read through adapter views and its methods
    run under `intercept()`. One class per (cls, targets), so identical layers share one graph (pipeline
    stacking needs equal graphdefs)."""
    key = (cls, tuple(sorted(targets.items())))
    if key not in _CLASSES:
        fields: dict[str, Any] = {"_lora_base_class": cls}
        for name, n_in in targets.items():
            fields[name] = property(lambda self, n=name, k=n_in: _View(self, n, k),
                                    lambda self, v, n=name: vars(self).__setitem__(n, v))
        for c in reversed(cls.__mro__):  # omnijax's own methods (a subclass's override wins); plain functions only
            if not c.__module__.startswith("omnijax"):
                continue
            for attr, fn in vars(c).items():
                if isinstance(fn, types.FunctionType) and (attr == "__call__" or not attr.startswith("_")):
                    fields[attr] = _method(fn)
        _CLASSES[key] = type(f"Lora{cls.__name__}", (cls,), fields)
    return _CLASSES[key]


def add_adapter(module: nnx.Module, name: str, n_in: int, rank: int, alpha: float, key: jax.Array,
                layer: int = 0, quant: str = "") -> None:
    """Give `module.<name>` (an nnx.Param `[*stack, *in, *out]`) an adapter: A ~ N(0, 1/fan_in), B = 0 (the
    adapted model starts equal to the base), scale alpha/rank; `quant` (nf4 | int8) stores the base quantised.

    A is drawn from `fold_in(key, layer)`; in a pipelined stack `[stage, repeat, layer]` each slice from its own
    layer's index, so a layout that stacks the blocks starts from the same adapters as one that does not."""
    base = vars(module)[name]
    meta = dict(base.get_metadata())
    names = tuple(meta.get("out_sharding") or (None,) * base.ndim)
    n_stack = len(STACKED) if names[:len(STACKED)] == STACKED else 0
    shape = tuple(base.shape)
    stack, core = shape[:n_stack], shape[n_stack:]
    fan_in = math.prod(core[:n_in])
    a_names = names[:n_stack] + names[n_stack:n_stack + n_in] + (RANK_AXIS,)
    b_names = names[:n_stack] + (RANK_AXIS,) + names[n_stack + n_in:]
    draw = lambda i: jax.random.normal(jax.random.fold_in(key, i), (*core[:n_in], rank), jnp.float32)  # noqa: E731
    if n_stack:
        stages, repeats, per = stack
        s, r, j = np.meshgrid(np.arange(stages), np.arange(repeats), np.arange(per), indexing="ij")
        index = jnp.asarray(((r * stages + s) * per + j).reshape(-1))
        a = jax.vmap(draw)(index).reshape(*stack, *core[:n_in], rank)
    else:
        a = draw(layer)
    a = a / math.sqrt(fan_in)
    b = jnp.zeros((*stack, rank, *core[n_in:]), jnp.float32)
    setattr(module, name + A_SUFFIX, nnx.Param(a, out_sharding=a_names))
    setattr(module, name + B_SUFFIX, nnx.Param(b, out_sharding=b_names))
    meta["lora_scale"] = float(alpha) / rank
    if quant:
        if quant == "nf4" and core[-1] % 2:
            raise ValueError(f"nf4 packs pairs along the last axis; {name} has {core[-1]}")
        codes, scale = quantize(base[...], quant, n_stack)
        blk_names = names[:n_stack] + (None,) + names[n_stack + 1:]
        setattr(module, name + SCALE_SUFFIX, nnx.Param(scale, out_sharding=blk_names))
        meta["lora_quant"] = quant
        base = base.replace(codes)
    vars(module)[name] = base.replace(base[...], **{k: v for k, v in meta.items() if k.startswith("lora_")})
