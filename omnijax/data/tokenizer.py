"""Byte-level tokenizer shared by every omnijax recipe.

Ids 0..255 are raw UTF-8 bytes, so any text round-trips without a vocabulary file or a download.
A few ids above 255 are specials; the modality placeholders mark LLM positions whose embedding is
replaced by an encoder output token (see the batch layout in omnijax/data/packing.py).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

BOS = 256
EOS = 257
PAD = 258
IMAGE = 259
VIDEO = 260
AUDIO = 261

#: Vocabulary of the multimodal recipes (leaves room for more specials).
VOCAB_SIZE = 512
#: Smallest vocabulary that holds bytes and all specials defined above.
MIN_VOCAB_SIZE = 262

SPECIALS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<image>": IMAGE, "<video>": VIDEO, "<audio>": AUDIO}
SPECIAL_NAMES = {v: k for k, v in SPECIALS.items()}
#: Placeholder id of each non-text modality.
PLACEHOLDER = {"image": IMAGE, "video": VIDEO, "audio": AUDIO}


def encode(text: str, bos: bool = False, eos: bool = False) -> np.ndarray:
    """UTF-8 bytes of `text` as int32 ids, optionally wrapped in BOS/EOS."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    if bos or eos:
        parts = ([np.array([BOS], np.int32)] if bos else []) + [ids] + ([np.array([EOS], np.int32)] if eos else [])
        ids = np.concatenate(parts)
    return ids


def decode(ids: Iterable[int] | np.ndarray, specials: bool = False) -> str:
    """Inverse of `encode`; specials are dropped (or shown as `<name>` with specials=True).

    Invalid UTF-8 (a model may emit any byte sequence) is replaced, never raised.
    """
    out = bytearray()
    text: list[str] = []
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1).tolist():
        if 0 <= i < 256:
            out.append(i)
        elif specials:
            text.append(out.decode("utf-8", errors="replace"))
            out = bytearray()
            text.append(SPECIAL_NAMES.get(i, f"<{i}>"))
    text.append(out.decode("utf-8", errors="replace"))
    return "".join(text)
