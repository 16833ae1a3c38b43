"""Small shared helpers."""
from __future__ import annotations

import json
import os
from pathlib import Path


def runs_root() -> Path:
    """Where recipes write: $OMNIJAX_RUNS if set, else ./runs."""
    return Path(os.environ.get("OMNIJAX_RUNS", "runs"))


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def read_jsonl(path: Path) -> list[dict]:
    """The complete rows of a JSONL file another process may be appending to: a last line without its newline
    is still being written (or was cut short by a kill) and is left out, so a reader never parses half a row."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(r) for r in text[: text.rfind("\n") + 1].splitlines() if r.strip()]


def keep_rows_through(path: Path, step: int) -> None:
    """A job resumed from the checkpoint at `step` rewrites its metrics.jsonl without the rows logged after it
    (they are logged again) and without a row cut short by the kill."""
    if path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(path) if r["step"] <= step))
