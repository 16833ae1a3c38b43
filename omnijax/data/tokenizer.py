"""Tokenizers: the byte-level one of the built-in world, and the user's Hugging Face tokenizer.json.

Byte level (the module functions and constants below): ids 0..255 are raw UTF-8 bytes, so any text
round-trips without a vocabulary file or a download. A few ids above 255 are specials; the modality
placeholders mark LLM positions whose embedding is replaced by an encoder output token (see the batch
layout in omnijax/data/packing.py).

`load_tokenizer(path)` returns a `Tokenizer` object with one interface for both kinds (encode/decode,
bos/eos/pad, placeholder ids, vocab_size, a fingerprint that ties converted shards to their vocabulary,
the chat template): "" is the byte-level one, a folder is a Hugging Face tokenizer (see HFTokenizer).
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


# ============================================================================ tokenizer objects
# The module-level byte functions above stay the built-in world's API. Everything that reads the
# user's data goes through a `Tokenizer` object instead, so that a Hugging Face vocabulary and the
# byte vocabulary are interchangeable: `load_tokenizer("")` is the byte one.

import hashlib  # noqa: E402  (kept below the byte API, which must stay import-light)
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

MEDIA_TAGS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


class Tokenizer:
    """What the data plane needs from a tokenizer.

    encode(text) never yields a special token (placeholders, bos/eos, chat markers): a user's text that
    happens to contain "<image>" or "<|im_end|>" stays text. `encode_marked` is the one path where
    specials written by a chat template (markup) become their ids.
    """
    name: str
    bos: int | None
    eos: int
    pad: int
    placeholder: dict[str, int]
    vocab_size: int
    text_vocab_size: int   # ids other than the media placeholders omnijax added (what an LLM's table must hold)
    fingerprint: str
    chat_template: str | None = None
    special_strings: dict[str, str]   # "bos_token"/"eos_token"/"pad_token"/"unk_token" -> text, for templates
    # modality -> (start id, end id) around its placeholder run (Qwen2-VL's <|vision_start|> .. <|vision_end|>)
    media_markers: dict[str, tuple[int, int]] = {}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> np.ndarray:
        ids, _, _ = self._encode_offsets(text, markup=False)
        return self._wrap(ids, bos, eos)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        raise NotImplementedError

    def _wrap(self, ids: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
        head = [self.bos] if bos and self.bos is not None else []
        tail = [self.eos] if eos else []
        return np.concatenate([np.array(head, np.int32), ids.astype(np.int32), np.array(tail, np.int32)])

    def _encode_offsets(self, text: str, markup: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, char start, char end) of each token; markup=True lets special-token text become specials."""
        raise NotImplementedError

    def _specials_in(self, text: str) -> list[tuple[int, int]]:
        """Character spans of special-token text inside `text` (where markup encoding would emit specials)."""
        return []

    def encode_marked(self, chunks: list[tuple[str | int, bool, bool]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and loss flags of a run of chunks (text or id, loss, markup).

        Consecutive text chunks are tokenized as ONE string (merges across chunk borders stay what the
        tokenizer would do on the whole text), then each token takes the loss flag "any of its characters
        is a loss character". Special-token text inside a non-markup chunk is tokenized as plain text.
        """
        ids, loss = [], []
        text, tloss, tmark = [], [], []

        def flush():
            if not text:
                return
            s = "".join(text)
            lmask = np.concatenate([np.full(len(t), l, bool) for t, l in zip(text, tloss)])
            mmask = np.concatenate([np.full(len(t), m, bool) for t, m in zip(text, tmark)])
            lsum = np.concatenate([[0], np.cumsum(lmask)])  # loss characters before each position
            # cut out special-token text that came from non-markup chunks: encoded as plain text
            cuts = [(a, b) for a, b in self._specials_in(s) if not mmask[a:b].all()]
            pos, pieces = 0, []
            for a, b in cuts:
                pieces += [(pos, a, True), (a, b, False)]
                pos = b
            pieces.append((pos, len(s), True))
            for a, b, mk in pieces:
                if a == b:
                    continue
                pid, st, en = self._encode_offsets(s[a:b], markup=mk)
                st = np.minimum(a + st, len(s) - 1)
                en = np.minimum(a + np.maximum(en, st - a + 1), len(s))
                ids.extend(pid.tolist())
                loss.extend((lsum[en] - lsum[st] > 0).tolist())
            text.clear(), tloss.clear(), tmark.clear()

        for value, l, m in chunks:
            if isinstance(value, str):
                if value:
                    text.append(value), tloss.append(bool(l)), tmark.append(bool(m))
            else:
                flush()
                ids.append(int(value))
                loss.append(bool(l))
        flush()
        return np.array(ids, np.int32), np.array(loss, bool)


class ByteTokenizer(Tokenizer):
    """The byte-level vocabulary of this module (ids 0..255 = UTF-8 bytes, specials above)."""
    name = "byte-level"
    bos, eos, pad = BOS, EOS, PAD
    placeholder = dict(PLACEHOLDER)
    vocab_size = VOCAB_SIZE
    text_vocab_size = VOCAB_SIZE
    chat_template = None
    special_strings = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    fingerprint = hashlib.sha256(json.dumps({"kind": "omnijax-bytes-v1", "specials": SPECIALS,
                                             "vocab": VOCAB_SIZE}, sort_keys=True).encode()).hexdigest()[:16]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return decode(ids)

    def _encode_offsets(self, text: str, markup: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = encode(text)
        if text.isascii():
            start = np.arange(len(text))
        else:
            lens = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
            start = np.repeat(np.arange(len(text)), lens)
        return ids, start, start + 1


BYTE_TOKENIZER = ByteTokenizer()

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>", "<|eot_id|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


def _token_text(value) -> str | None:
    """A special token entry of tokenizer_config.json: "text" or {"content": "text", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (fast tokenizer) from a local folder, through `tokenizers`.

    bos/eos/pad come from tokenizer_config.json, then special_tokens_map.json, then well-known names;
    `<image>`, `<video>`, `<audio>` are added as special tokens when the vocabulary lacks them.
    """

    def __init__(self, path: str):
        from omnijax.errors import UserError
        try:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as _Tok
        except ImportError:  # pragma: no cover - a declared dependency
            raise UserError("tokenizer.path needs the `tokenizers` package: pip install tokenizers") from None
        folder = Path(path)
        if not folder.is_dir():
            raise UserError(f"tokenizer.path={path}: folder not found (expected a folder with tokenizer.json)")
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise UserError(f"tokenizer.path={path}: no tokenizer.json in it (only Hugging Face fast tokenizers "
                            f"are supported; convert a slow one with transformers' AutoTokenizer.save_pretrained)")
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise UserError(f"{file}: not a readable tokenizer.json ({str(exc).splitlines()[0][:200]})") from None
        config = self._json(folder / "tokenizer_config.json")
        smap = self._json(folder / "special_tokens_map.json")
        self.name = str(folder)
        own = self._tok.get_vocab(with_added_tokens=True)
        # ids of the tokenizer itself, before the media tags omnijax adds (those never reach an embedding table)
        self.text_vocab_size = max(own.values()) + 1 if own else 0
        absent = [AddedToken(t, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False)
                  for t in MEDIA_TAGS.values()]
        self._tok.add_special_tokens(absent)  # reuses the id of a tag the vocabulary already has
        self.placeholder = {m: int(self._tok.token_to_id(t)) for m, t in MEDIA_TAGS.items()}
        self.media_markers = {}
        vl = _qwen_vl_ids(folder, own)
        if vl is not None:  # a Qwen2-VL/Qwen2.5-VL folder: its own pad tokens, wrapped in vision start/end
            self.placeholder.update(image=vl["image_token_id"], video=vl["video_token_id"])
            pair = (vl["vision_start_token_id"], vl["vision_end_token_id"])
            self.media_markers = {"image": pair, "video": pair}

        def pick(key: str, names: tuple[str, ...]) -> tuple[str | None, int | None]:
            for text in (_token_text(config.get(key)), _token_text(smap.get(key)), *names):
                if text is not None and self._tok.token_to_id(text) is not None:
                    return text, int(self._tok.token_to_id(text))
            return None, None

        # an explicit "bos_token": null (Qwen-style) means no bos, not "guess one"
        no_bos = any(key_src.get("bos_token", "") is None for key_src in (config, smap))
        bos_t, self.bos = (None, None) if no_bos else pick("bos_token", _BOS_NAMES)
        eos_t, eos = pick("eos_token", _EOS_NAMES)
        if eos is None:
            raise UserError(f"tokenizer.path={path}: no end-of-sequence token (no eos_token in tokenizer_config.json "
                            f"or special_tokens_map.json, none of {', '.join(_EOS_NAMES)} in the vocabulary); "
                            f"add \"eos_token\" to {folder / 'tokenizer_config.json'}")
        self.eos = eos
        pad_t, pad = pick("pad_token", _PAD_NAMES)
        self.pad = pad if pad is not None else eos
        unk_t = _token_text(config.get("unk_token")) or _token_text(smap.get("unk_token"))
        self.special_strings = {"bos_token": bos_t or "", "eos_token": eos_t or "", "pad_token": pad_t or eos_t or "",
                                "unk_token": unk_t or ""}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.chat_template = template if isinstance(template, str) and template.strip() else None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        added = self._tok.get_added_tokens_decoder()
        self._special_re = None
        specials = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
        if specials:
            self._special_re = re.compile("|".join(re.escape(s) for s in specials))
        self._plain = _Tok.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True  # user text: "<image>" typed by a user stays characters
        spec = json.loads(self._tok.to_str())
        spec = {k: spec.get(k) for k in ("added_tokens", "normalizer", "pre_tokenizer", "model")}
        spec["ids"] = {"bos": self.bos, "eos": self.eos, "pad": self.pad}
        if self.media_markers:  # the media layout is part of what shards were tokenized with
            spec["media"] = {"placeholder": self.placeholder, "markers": self.media_markers}
        self.fingerprint = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    @staticmethod
    def _json(path: Path) -> dict:
        from omnijax.errors import UserError
        if not path.is_file():
            return {}
        try:
            obj = json.loads(path.read_text())
        except ValueError as exc:
            raise UserError(f"{path}: not valid JSON ({exc})") from None
        return obj if isinstance(obj, dict) else {}

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
                                 .reshape(-1).tolist()], skip_special_tokens=True)

    def _encode_offsets(self, text: str, markup: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        enc = (self._tok if markup else self._plain).encode(text, add_special_tokens=False)
        off = np.array(enc.offsets, np.int64).reshape(-1, 2)
        return np.array(enc.ids, np.int32), off[:, 0], off[:, 1]

    def _specials_in(self, text: str) -> list[tuple[int, int]]:
        if self._special_re is None:
            return []
        return [m.span() for m in self._special_re.finditer(text)]


_QWEN_VL_TYPES = ("qwen2_5_vl", "qwen2_vl")
_QWEN_VL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                   "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def _qwen_vl_ids(folder: Path, vocab: dict[str, int]) -> dict[str, int] | None:
    """The media token ids of a Qwen2-VL/Qwen2.5-VL folder (its config.json's, else the vocabulary's tokens of
    those names), None for any other folder. UserError when one is missing or outside the vocabulary."""
    from omnijax.errors import UserError
    top = HFTokenizer._json(folder / "config.json")
    if top.get("model_type") not in _QWEN_VL_TYPES:
        return None
    ids = {}
    for key, name in _QWEN_VL_TOKENS.items():
        value = top.get(key, vocab.get(name))
        if not isinstance(value, int) or value not in vocab.values():
            raise UserError(f"{folder}: a {top['model_type']} folder whose {key} ({value!r}) is not a token of its "
                            f"tokenizer.json (expected {name})")
        ids[key] = value
    return ids


def load_tokenizer(path: str = "") -> Tokenizer:
    """"" -> the byte-level tokenizer; otherwise the Hugging Face tokenizer.json in folder `path`."""
    return BYTE_TOKENIZER if not path else HFTokenizer(os.path.expanduser(path))


def check_vocab(tok: Tokenizer, model_vocab_size: int) -> None:
    """ConfigError when the tokenizer's ids (added tokens included) do not fit the model's embedding table."""
    from omnijax.errors import ConfigError
    if tok.vocab_size > model_vocab_size:
        raise ConfigError(f"model.llm.vocab_size={model_vocab_size} is smaller than the vocabulary of tokenizer "
                          f"{tok.name} ({tok.vocab_size} ids incl. added tokens); set model.llm.vocab_size>="
                          f"{tok.vocab_size}")


def check_llm_vocab(tok: Tokenizer, model_vocab_size: int, where: str) -> None:
    """A pretrained LLM keeps its vocabulary: every text id of `tok` must fit it (media placeholders need not,
    they never reach the embedding table). One clear line otherwise."""
    from omnijax.errors import ConfigError
    if tok.text_vocab_size > model_vocab_size:
        raise ConfigError(f"tokenizer {tok.name} has {tok.text_vocab_size} ids but the LLM ({where}) has "
                          f"vocab_size={model_vocab_size}: use the LLM's own tokenizer (tokenizer.path = its folder) "
                          "and convert the data with it")
