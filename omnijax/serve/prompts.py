"""Prompts for generation from a file of records in the formats `recipes convert` reads (omnijax.data.formats),
without their answers: one `Sample` per record, in order, media paths relative to the file."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omnijax.data import formats, media
from omnijax.data.sample import BadSample, Sample, Segment
from omnijax.errors import UserError


def read_records(path: str | Path) -> list[Any]:
    """The records of a .jsonl file (one object per line) or a .json file holding a list."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompts={path}: file not found; write one JSON record per line ({{\"segments\": [...]}} "
                        "or a LLaVA conversation without the answer)")
    text = p.read_text()
    if p.suffix == ".json":
        try:
            recs = json.loads(text)
        except ValueError as exc:
            raise UserError(f"prompts={path}: not valid JSON ({exc})") from None
        if not isinstance(recs, list):
            raise UserError(f"prompts={path}: a .json prompts file holds a list of records")
        return recs
    recs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            recs.append(json.loads(line))
        except ValueError:
            raise UserError(f"prompts={path}: line {n} is not valid JSON") from None
    if not recs:
        raise UserError(f"prompts={path}: no records")
    return recs


def read_prompts(path: str | Path, tok: Any, media_cfg: Any = None) -> list[Sample]:
    """One Sample per record of `path` (text tokenized with `tok`, media decoded); a record that cannot be
    read is a UserError naming the prompt and the cause (no prompt is dropped silently)."""
    root = Path(path).parent
    resolve = lambda s: Path(s) if os.path.isabs(s) else root / s  # noqa: E731
    load = media.rated(media.load_media, media_cfg)  # videos with their kept frames' rate (M-RoPE's time)
    out = []
    for k, rec in enumerate(read_records(path)):
        where = f"prompts={path} record {k}"
        try:
            parts = formats.prompt(rec, tok, load, resolve, where)
        except BadSample as exc:
            msg = str(exc)
            raise UserError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        segs = tuple(Segment(m, media.Rated.value_of(v), False, fps=media.Rated.fps_of(v)) for m, v, _ in parts
                     if not (m == "text" and len(media.Rated.value_of(v)) == 0))
        if not segs:
            raise UserError(f"{where}: the prompt is empty")
        out.append(Sample(segs, str(path), k))
    return out
