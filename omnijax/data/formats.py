"""Record formats of the user's JSON/JSONL data -> the unified sample's segments.

Three kinds of record (one JSON object each):
- `{"text": "..."}`: a document, loss on every token: [bos] + text + eos.
- `{"segments": [{"text": "...", "loss": true}, {"image": "a.png"}, {"video": ...}, {"audio": ...}]}`:
  our interleaved format, taken as written (no bos/eos added).
- LLaVA-style conversations: `{"image": "a.jpg", "conversations": [{"from": "human", "value":
  "<image>\\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]}`; `"video"`/`"audio"` likewise, each a
  path or a list of paths. `role`/`content` keys (and `"messages"` for the list) are read too. Each
  `<image>`/`<video>`/`<audio>` tag in the text is where the next file of that kind goes; when a record
  has media but no tag of its kind, the media go first in the first user turn (LLaVA's convention).

Preference pairs (DPO) are any of these prompts with a chosen and a rejected answer:
- `{"segments": [...prompt...], "chosen": "...", "rejected": "..."}` (or `{"text": prompt, ...}`): each answer is
  tokenized with an eos after it and carries the loss; the prompt is as its kind lays it out.
- a conversation (the prompt) with top-level `"chosen"` and `"rejected"`, each a string or an assistant turn
  (`{"from": "gpt", "value": "..."}`), or a conversation whose last two turns are assistant turns marked
  `"preference": "chosen"` and `"preference": "rejected"` (LLaVA-style, two assistant turns).
A pair becomes ONE sample of two documents, the prompt + chosen answer (segments with `pair=CHOSEN`) then the
prompt + rejected answer (`pair=REJECTED`): the prompt's media appear, and are encoded, in both. Only the final
answer carries loss in a pair (an earlier assistant turn of the prompt does not).

Media are laid out as the model's processor lays them out: alone (LLaVA-style composed models), or, for a
tokenizer with media markers (a Qwen2-VL/Qwen2.5-VL folder's: `Tokenizer.media_markers`), each image/video
between `<|vision_start|>` and `<|vision_end|>`, its tokens that model's `<|image_pad|>`/`<|video_pad|>` ids, and
untagged media put directly before the first user turn's text (as Qwen's template writes image items before a
text item) instead of on a line of their own, so the ids equal transformers' processor + `apply_chat_template`.

Conversations go through the tokenizer's chat template when it has one, else the default
`[bos] "User: {q}\\n" "Assistant: {a}" <eos>` (a `system` turn is "System: {s}\\n"). Loss is on the
assistant's text and its end of turn only: with a template, on what the template emits for an
assistant message from its content up to and including the first special token after it (`<|im_end|>`,
`<|eot_id|>`, `</s>`...), found by rendering the conversation's prefixes.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from omnijax.data.records import BadRecord
from omnijax.data.sample import CHOSEN, MODALITIES, REJECTED
from omnijax.data.tokenizer import MEDIA_TAGS, Tokenizer

#: "from"/"role" values and what they are.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
         "model": "assistant", "system": "system"}
_TAG_RE = re.compile("|".join(re.escape(t) for t in MEDIA_TAGS.values()))
_TAG_KIND = {t: m for m, t in MEDIA_TAGS.items()}
_MEDIA = tuple(m for m in MODALITIES if m != "text")

#: A chunk of a conversation's text: (text or token id, loss, markup). markup text comes from the
#: template (its special-token text becomes specials); non-markup text is the user's (never specials).
Chunk = tuple[Any, bool, bool]
#: What a record becomes: (modality, payload, loss), payload = int32 ids for text, media_fn(...) otherwise;
#: a preference pair's parts carry a fourth field, the document they belong to (CHOSEN / REJECTED).
Part = tuple
PREFERENCE_KEYS = ("chosen", "rejected")


def part_fields(part: Part) -> tuple[str, Any, bool, int]:
    """(modality, payload, loss, pair) of a part (pair 0 outside preference pairs)."""
    return (part[0], part[1], part[2], part[3] if len(part) > 3 else 0)


def kind_of(obj: Any) -> str:
    """'text' | 'segments' | 'conversation', or BadRecord's message (as ValueError) when none fits."""
    if isinstance(obj, dict):
        if "conversations" in obj or "messages" in obj:
            return "conversation"
        if "segments" in obj:
            return "segments"
        if "text" in obj:
            return "text"
    raise ValueError("expected an object with 'text', 'segments' or 'conversations'")


def build(obj: Any, tok: Tokenizer, media_fn: Callable[[Path, str], Any], resolve: Callable[[str], Path],
          where: str) -> list[Part]:
    """The record's segments. media_fn loads (or just measures) a file; resolve turns a record's path
    into a file path. BadRecord names `where` for anything wrong with the record itself."""
    try:
        kind = kind_of(obj)
    except ValueError as exc:
        raise BadRecord(f"{where}: {exc}") from None
    if is_pair(obj):
        return pair(obj, kind, tok, media_fn, resolve, where)
    if kind == "text":
        if not isinstance(obj["text"], str):
            raise BadRecord(f"{where}: 'text' must be a string")
        parts: list[Part] = []
        if tok.bos is not None:
            parts.append(("text", np.array([tok.bos], np.int32), False))
        parts.append(("text", tok.encode(obj["text"], eos=True), True))
        return parts
    if kind == "segments":
        return _segments(obj["segments"], tok, media_fn, resolve, where)
    return conversation(obj, tok, media_fn, resolve, where)


def _segments(segs: Any, tok: Tokenizer, media_fn, resolve, where: str) -> list[Part]:
    if not isinstance(segs, list):
        raise BadRecord(f"{where}: 'segments' must be a list")
    parts = []
    for seg in segs:
        kinds = [m for m in MODALITIES if m in seg] if isinstance(seg, dict) else []
        if len(kinds) != 1:
            raise BadRecord(f"{where}: each segment needs exactly one of {', '.join(MODALITIES)}")
        m = kinds[0]
        if m == "text":
            parts.append(("text", tok.encode(str(seg["text"])), bool(seg.get("loss", False))))
        else:
            parts += media_parts(tok, m, media_fn(resolve(str(seg[m])), m))
    return parts


def media_parts(tok: Tokenizer, kind: str, payload: Any) -> list[Part]:
    """A media segment as the model lays it out: alone, or between the tokenizer's start/end ids for its kind
    (`tok.media_markers`: Qwen2-VL's `<|vision_start|>` .. `<|vision_end|>`, as its processor writes them)."""
    start_end = tok.media_markers.get(kind)
    if start_end is None:
        return [(kind, payload, False)]
    return [("text", np.array(start_end[:1], np.int32), False), (kind, payload, False),
            ("text", np.array(start_end[1:], np.int32), False)]


# ------------------------------------------------------------------------- preference pairs
def is_pair(obj: Any) -> bool:
    """Whether a record is a preference pair (top-level chosen/rejected, or marked assistant turns)."""
    if not isinstance(obj, dict):
        return False
    if any(k in obj for k in PREFERENCE_KEYS):
        return True
    turns = obj.get("conversations", obj.get("messages"))
    return isinstance(turns, list) and any(isinstance(t, dict) and "preference" in t for t in turns)


def _answer_text(value: Any, where: str, key: str) -> str:
    """A pair's answer: a string, or an assistant turn object holding one."""
    if isinstance(value, dict):
        role = value.get("from", value.get("role"))
        if ROLES.get(role) != "assistant":
            raise BadRecord(f"{where}: '{key}' must be a string or an assistant turn, got role {role!r}")
        value = value.get("value", value.get("content"))
    if not isinstance(value, str):
        raise BadRecord(f"{where}: '{key}' must be a string (the {key} answer)")
    if not value.strip():
        raise BadRecord(f"{where}: the {key} answer is empty")
    return value


def _pair_answers(obj: dict, kind: str, where: str) -> tuple[dict, str, str]:
    """(the prompt record, chosen text, rejected text) of a pair record in either form."""
    if any(k in obj for k in PREFERENCE_KEYS):
        missing = [k for k in PREFERENCE_KEYS if k not in obj]
        if missing:
            raise BadRecord(f"{where}: a preference pair needs both 'chosen' and 'rejected' (missing "
                            f"'{missing[0]}')")
        prompt = {k: v for k, v in obj.items() if k not in PREFERENCE_KEYS}
        return prompt, _answer_text(obj["chosen"], where, "chosen"), _answer_text(obj["rejected"], where, "rejected")
    key = "conversations" if "conversations" in obj else "messages"
    turns = list(obj[key])
    marked = [k for k, t in enumerate(turns) if isinstance(t, dict) and "preference" in t]
    labels = [turns[k]["preference"] for k in marked]
    if marked != [len(turns) - 2, len(turns) - 1] or sorted(labels) != ["chosen", "rejected"]:
        raise BadRecord(f"{where}: a preference pair in a conversation is its last two turns, assistant turns marked "
                        f"\"preference\": \"chosen\" and \"preference\": \"rejected\" (found marks {labels} on turns "
                        f"{marked} of {len(turns)})")
    answers = {t["preference"]: _answer_text(t, where, t["preference"]) for t in turns[-2:]}
    return {**obj, key: turns[:-2]}, answers["chosen"], answers["rejected"]


def pair(obj: dict, kind: str, tok: Tokenizer, media_fn, resolve, where: str) -> list[Part]:
    """A preference pair -> the chosen document's parts then the rejected one's (fourth field: which)."""
    prompt, chosen, rejected = _pair_answers(obj, kind, where)
    out: list[Part] = []
    for role, answer in ((CHOSEN, chosen), (REJECTED, rejected)):
        if kind == "conversation":
            record = {**prompt}
            key = "conversations" if "conversations" in record else "messages"
            record[key] = list(prompt[key]) + [{"from": "gpt", "value": answer}]
            parts = conversation(record, tok, media_fn, resolve, where, last_answer_only=True)
        else:
            parts = [(m, v, False) for m, v, _ in (_segments(prompt["segments"], tok, media_fn, resolve, where)
                                                   if kind == "segments" else _text_prompt(prompt, tok, where))]
            parts.append(("text", tok.encode(answer, eos=True), True))
        out += [(m, v, loss, role) for m, v, loss in parts]
    return out


def _text_prompt(obj: dict, tok: Tokenizer, where: str) -> list[Part]:
    if not isinstance(obj["text"], str):
        raise BadRecord(f"{where}: 'text' must be a string")
    return [("text", tok.encode(obj["text"], bos=tok.bos is not None), False)]


# ---------------------------------------------------------------------------- conversations
def _messages(obj: dict, where: str, need_answer: bool = True) -> list[dict]:
    turns = obj.get("conversations", obj.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"{where}: 'conversations' must be a non-empty list of turns")
    out = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRecord(f"{where}: turn {k} is not an object")
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        if role not in ROLES:
            raise BadRecord(f"{where}: turn {k} has role {role!r}; expected one of {', '.join(sorted(ROLES))}")
        if not isinstance(content, str):
            raise BadRecord(f"{where}: turn {k} needs a string 'value' (or 'content')")
        out.append({"role": ROLES[role], "content": content})
    if need_answer and not any(m["role"] == "assistant" for m in out):
        raise BadRecord(f"{where}: no assistant ('gpt') turn, nothing to train on")
    return out


def _media_lists(obj: dict, where: str) -> dict[str, list[str]]:
    media = {}
    for m in _MEDIA:
        v = obj.get(m)
        if v is None:
            media[m] = []
        elif isinstance(v, str):
            media[m] = [v]
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):
            media[m] = list(v)
        else:
            raise BadRecord(f"{where}: '{m}' must be a path or a list of paths")
    return media


def conversation(obj: dict, tok: Tokenizer, media_fn, resolve, where: str,
                 last_answer_only: bool = False) -> list[Part]:
    """A LLaVA-style record -> text/media parts with loss on the assistant's turns only (`last_answer_only`:
    on its final turn only, a pair's answer)."""
    messages = _messages(obj, where)
    media = _place_media(obj, messages, where, tok)
    last = len(messages) - 1 if last_answer_only else None
    chunks = (template_chunks(messages, tok, where, last) if tok.chat_template else
              default_chunks(messages, tok, last))
    return _assemble(chunks, media, tok, media_fn, resolve)


def _place_media(obj: dict, messages: list[dict], where: str, tok: Tokenizer) -> dict[str, list[str]]:
    """The record's media lists, with a tag put first in the first user turn for media that have none (each
    followed by a newline, LLaVA's way; directly before the text where the tokenizer wraps media in markers,
    as Qwen2-VL's template writes an image item before a text item)."""
    media = _media_lists(obj, where)
    for m, files in media.items():
        tag = MEDIA_TAGS[m]
        n = sum(msg["content"].count(tag) for msg in messages)
        if n == 0 and files:  # LLaVA: media without a tag go first in the first user turn
            first = next((msg for msg in messages if msg["role"] == "user"), messages[0])
            sep = "" if m in tok.media_markers else "\n"
            first["content"] = (tag + sep) * len(files) + first["content"]
        elif n != len(files):
            raise BadRecord(f"{where}: {n} {tag} tag(s) in the text but {len(files)} {m} file(s)")
    return media


def default_chunks(messages: list[dict], tok: Tokenizer, only: int | None = None) -> list[Chunk]:
    """The documented default: [bos] "User: q\\n" "Assistant: a" <eos> (loss on " a" and <eos>; `only`: on
    that message's alone)."""
    chunks: list[Chunk] = [(tok.bos, False, True)] if tok.bos is not None else []
    for k, msg in enumerate(messages):
        if msg["role"] == "assistant":
            on = only is None or k == only
            chunks += [("Assistant:", False, True), (" ", on, True), (msg["content"], on, False),
                       (tok.eos, on, True)]
        else:
            chunks += [("User: " if msg["role"] == "user" else "System: ", False, True),
                       (msg["content"], False, False), ("\n", False, True)]
    return chunks


def check_template(tok: Tokenizer) -> None:
    """ConfigError now (not a skipped record per conversation later) when the tokenizer's chat template
    does not compile, UserError when jinja2 is missing."""
    if tok.chat_template:
        _compiled(tok.chat_template, tok.name)


@functools.lru_cache(maxsize=8)
def _compiled(template: str, name: str = ""):
    """A chat template compiled in a sandbox, with the globals Hugging Face templates expect."""
    import datetime

    from omnijax.errors import ConfigError, UserError
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError(f"tokenizer {name} has a chat template: applying it needs jinja2 (pip install jinja2)") from None

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ConfigError(f"tokenizer {name}: its chat_template does not compile ({exc})") from None


def render(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The tokenizer's chat template applied to `messages` (text; specials still as their text)."""
    return _compiled(tok.chat_template, tok.name).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **tok.special_strings)


def template_chunks(messages: list[dict], tok: Tokenizer, where: str, only: int | None = None) -> list[Chunk]:
    """Chunks of the templated conversation; which characters are the assistant's comes from rendering
    with each message's content replaced by a unique marker (private-use characters). `only`: loss on that
    message alone."""
    marks = [f"\ue000{k}\ue001" for k in range(len(messages))]
    marked = [{"role": m["role"], "content": s} for m, s in zip(messages, marks)]
    check_template(tok)  # a broken template or a missing jinja2 is the configuration's fault, not the record's
    try:
        full = render(tok, marked)
        pos = []
        for k, s in enumerate(marks):
            i = full.find(s)
            if i < 0 or full.find(s, i + 1) >= 0 or (pos and i < pos[-1]):
                raise BadRecord(f"{where}: the chat template does not render turn {k} exactly once and in order")
            pos.append(i)
        loss = np.zeros(len(full) + 1, bool)
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant" or (only is not None and k != only):
                continue
            a, b = pos[k], pos[k] + len(marks[k])
            loss[a:b] = True
            nxt = pos[k + 1] if k + 1 < len(messages) else len(full)
            prefix = render(tok, marked[: k + 1])
            stable = full.startswith(prefix) and len(prefix) >= b
            trailer = full[b: min(len(prefix), nxt)] if stable else full[b:nxt]
            spans = tok._specials_in(trailer)
            end = b + spans[0][1] if spans else (b + len(trailer) if stable else b)
            loss[b:end] = True
    except BadRecord:
        raise
    except Exception as exc:  # jinja's TemplateError / raise_exception, or a template bug
        raise BadRecord(f"{where}: the chat template failed on this conversation ({exc})") from None
    chunks: list[Chunk] = []
    cursor = 0
    for k, msg in enumerate(messages):
        chunks += _scaffold(full, cursor, pos[k], loss)
        chunks.append((msg["content"], msg["role"] == "assistant" and (only is None or k == only), False))
        cursor = pos[k] + len(marks[k])
    chunks += _scaffold(full, cursor, len(full), loss)
    return chunks


def _scaffold(full: str, a: int, b: int, loss: np.ndarray) -> list[Chunk]:
    """Template text full[a:b] as markup chunks, cut where the loss flag changes."""
    out, i = [], a
    while i < b:
        j = i + 1
        while j < b and loss[j] == loss[i]:
            j += 1
        out.append((full[i:j], bool(loss[i]), True))
        i = j
    return out


def _assemble(chunks: list[Chunk], media: dict[str, list[str]], tok: Tokenizer, media_fn, resolve) -> list[Part]:
    """Split the user's text at media tags, tokenize each run between media, keep loss per token."""
    parts: list[Part] = []
    run: list[Chunk] = []
    taken = {m: 0 for m in media}

    def flush():
        if not run:
            return
        ids, loss = tok.encode_marked(run)
        run.clear()
        i = 0
        while i < len(ids):
            j = i + 1
            while j < len(ids) and loss[j] == loss[i]:
                j += 1
            parts.append(("text", ids[i:j], bool(loss[i])))
            i = j

    for value, loss, markup in chunks:
        if markup or not isinstance(value, str):
            run.append((value, loss, markup))
            continue
        pos = 0
        for m in _TAG_RE.finditer(value):
            kind = _TAG_KIND[m.group()]
            markers = tok.media_markers.get(kind)  # Qwen2-VL: <|vision_start|> placeholders <|vision_end|>
            run.append((value[pos:m.start()], loss, False))
            if markers:
                run.append((markers[0], False, True))
            flush()
            path = media[kind][taken[kind]]
            taken[kind] += 1
            parts.append((kind, media_fn(resolve(path), kind), False))
            if markers:
                run.append((markers[1], False, True))
            pos = m.end()
        run.append((value[pos:], loss, False))
    flush()
    return parts


# ---------------------------------------------------------------------------------- prompts
def prompt(obj: Any, tok: Tokenizer, media_fn: Callable[[Path, str], Any], resolve: Callable[[str], Path],
           where: str) -> list[Part]:
    """A generation prompt from a record of the formats above, laid out as training lays it out up to the
    answer: `segments` as written, `text` as [bos] + text, a conversation through the chat template with
    its generation prompt appended (the default template: up to "Assistant:"). A conversation's trailing
    assistant turn(s), the reference answer, are left out."""
    try:
        kind = kind_of(obj)
    except ValueError as exc:
        raise BadRecord(f"{where}: {exc}") from None
    if kind == "segments":
        return _segments(obj["segments"], tok, media_fn, resolve, where)
    if kind == "text":
        if not isinstance(obj["text"], str):
            raise BadRecord(f"{where}: 'text' must be a string")
        return [("text", tok.encode(obj["text"], bos=tok.bos is not None), False)]
    messages = _messages(obj, where, need_answer=False)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise BadRecord(f"{where}: the conversation has no user turn to answer")
    media = _place_media(obj, messages, where, tok)
    if not tok.chat_template:
        chunks = default_chunks(messages, tok) + [("Assistant:", False, True)]
        return _assemble(chunks, media, tok, media_fn, resolve)
    marks = [f"\ue000{k}\ue001" for k in range(len(messages))]
    check_template(tok)
    try:
        full = render(tok, [{"role": m["role"], "content": s} for m, s in zip(messages, marks)],
                      add_generation_prompt=True)
    except Exception as exc:  # jinja's TemplateError / raise_exception, or a template bug
        raise BadRecord(f"{where}: the chat template failed on this conversation ({exc})") from None
    chunks: list[Chunk] = []
    cursor = 0
    for k, msg in enumerate(messages):
        i = full.find(marks[k], cursor)
        if i < 0:
            raise BadRecord(f"{where}: the chat template does not render turn {k} in order")
        chunks += [(full[cursor:i], False, True), (msg["content"], False, False)]
        cursor = i + len(marks[k])
    chunks.append((full[cursor:], False, True))
    return _assemble([c for c in chunks if c[0] != ""], media, tok, media_fn, resolve)
