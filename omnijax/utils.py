"""Small shared helpers."""
from __future__ import annotations

import os
from pathlib import Path


def runs_root() -> Path:
    """Where recipes write: $OMNIJAX_RUNS if set, else ./runs."""
    return Path(os.environ.get("OMNIJAX_RUNS", "runs"))


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
