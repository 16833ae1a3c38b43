"""Closeness of gradient trees relative to each leaf's scale: fp32 reassociation noise grows with a tensor's
magnitude, and an absolute tolerance at 1e-4 passes anything when gradients are ~1e-3."""
from __future__ import annotations

import jax
import numpy as np

# fp32 noise of a reordered reduction is ~1e-7..1e-6 of a leaf's largest entry; this allows a small multiple
GRAD_REL = 2e-5


def rel_errors(got, ref) -> dict:
    """Per leaf: max |got - ref| over max |ref| (ref all zeros: the absolute error)."""
    def one(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.abs(b).max()) if b.size else 0.0
        return float(np.abs(a - b).max()) / scale if scale > 0 else float(np.abs(a).max(initial=0.0))
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
    assert flat_got.keys() == flat_ref.keys(), sorted(set(map(str, flat_got)) ^ set(map(str, flat_ref)))
    return {jax.tree_util.keystr(p): one(flat_got[p], r) for p, r in flat_ref.items()}


def assert_grads_close(got, ref, rel: float = GRAD_REL) -> None:
    errs = rel_errors(got, ref)
    worst = max(errs, key=errs.get)
    print(f"worst relative gradient error {errs[worst]:.2e} at {worst}")
    assert errs[worst] <= rel, {k: f"{v:.1e}" for k, v in sorted(errs.items(), key=lambda kv: -kv[1])[:5]}
