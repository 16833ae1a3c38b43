"""Small shared helpers."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
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


class AtomicFolder:
    """A folder written under a temporary name next to `out` and renamed to `out` when complete (process 0 writes;
    with several processes all of them meet at the end). An existing `out` is one line, before anything is written."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        if self.out.exists():
            raise UserError(f"{self.out} exists; choose a new output folder or remove it (nothing was written)")
        import jax

        self.write = jax.process_index() == 0
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        if self.write:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp if self.tmp is not None else self.out

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp is not None:
            if exc_type is None:
                os.rename(self.tmp, self.out)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        import jax

        if jax.process_count() > 1 and exc_type is None:
            from jax.experimental import multihost_utils

            # named by the folder's own name: process 0 writes a nested folder under its temporary parent, the
            # others name it under the final one, and every process must pass the same name
            multihost_utils.sync_global_devices(f"export {self.out.name}")
