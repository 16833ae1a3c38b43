"""Small shared helpers."""
from __future__ import annotations

import json
import os
from pathlib import Path

from omnijax.errors import UserError


def runs_root() -> Path:
    """Where recipes write: $OMNIJAX_RUNS if set, else ./runs."""
    return Path(os.environ.get("OMNIJAX_RUNS", "runs"))


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def read_jsonl(path: Path) -> list[dict]:
    """The complete rows of a JSONL file another process may be appending to: a last line without its newline
    is still being written (or was cut short by a kill) and is left out, so a reader never parses half a row.
    A damaged row before it is a UserError that names the line."""
    if not path.exists():
        return []
    text = path.read_text()
    rows = []
    for n, line in enumerate(text[: text.rfind("\n") + 1].splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: not a JSON row ({exc.msg}); the file is damaged: "
                                f"fix or remove that line") from None
    return rows
