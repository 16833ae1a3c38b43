"""A trained policy on disk (numpy .npz): its parameters, warm-start parts and validation verdict."""
from __future__ import annotations

import numpy as np

from omnijax.cluster.residual.scheduler import ResidualScheduler
from omnijax.errors import UserError


def save_policy(path: str, sched: "ResidualScheduler") -> None:
    np.savez(path, theta=sched.theta, hidden=sched.mlp.hidden, anchor=sched.anchor,
             class_lengths=sched.class_lengths, aware=sched.aware,
             validation=getattr(sched, "validation_vs_fitted", np.nan), accepted=getattr(sched, "accepted", False),
             kept=getattr(sched, "kept", ""))


def load_policy(path: str) -> "ResidualScheduler":
    """A policy `save_policy` wrote; a UserError if the file is missing or of another shape."""
    try:
        data = np.load(path)
        sched = ResidualScheduler(theta=data["theta"], hidden=int(data["hidden"]),     # older files: none of
                                  anchor=data["anchor"] if "anchor" in data else (),   # anchor, class lengths, aware
                                  class_lengths=bool(data["class_lengths"]) if "class_lengths" in data else False,
                                  aware=bool(data["aware"]) if "aware" in data else False)
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"learned.load={path!r}: not a saved learned policy ({exc})") from None
    sched.validation_vs_fitted = float(data["validation"])
    sched.accepted = bool(data["accepted"])
    if "kept" in data and str(data["kept"]):
        sched.kept = str(data["kept"])
    return sched
