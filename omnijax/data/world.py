"""The built-in multimodal world: procedural, learnable samples with heavy-tailed sizes, no downloads.

Every sample is a pure function of (seed, split, index): a *spec* (all random choices: modality,
question, colours, sizes, durations) is drawn first and the payload is rendered from it, so the
metadata of any sample (`World.meta`) costs microseconds and never renders pixels or waveforms.

Sample layout: [BOS] <modality segment> "Q: <question>\\nA: " then the answer text + EOS as the only
loss-carrying segment. Question types and their answer sets (chance = 1/|answers|):
- image: shapes (square/circle/triangle) of one colour, 1-4 of them, one per quadrant, on a noisy
  background at a random resolution and aspect ratio.  count, colour, shape, position (one shape).
- video: one shape moving in a straight line across a variable number of frames.  direction, colour.
- audio: tone sequences at 16 kHz: digits (one pure tone per digit) or words (a fixed three-tone
  melody per word), variable count.  first digit, first word.
- text: a heavy-tailed list of words.  first word.
A `caption_prob` share of samples asks for a description instead (loss target, not scored).
With `pairs` on, every sample is a preference pair (DPO): the prompt with the correct answer (chosen) and
with a wrong one (rejected: another answer of the question's set, or a caption with one attribute changed);
`item` and the held-out questions stay plain.

Sizes (image side, video frames and side, audio items, text words) follow truncated Pareto laws
`Tail(lo, hi, alpha)`: most samples are small, a few are up to `hi` (smaller alpha = heavier tail).
The held-out split ("eval") uses a disjoint random stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from omnijax.data import tokenizer
from omnijax.data.sample import CHOSEN, REJECTED, SAMPLE_RATE, Sample, SampleMeta, Segment, SegmentMeta
from omnijax.errors import ConfigError, UserError

COLOURS = {"red": (0.9, 0.12, 0.1), "green": (0.1, 0.8, 0.15), "blue": (0.15, 0.3, 0.95), "yellow": (0.95, 0.88, 0.1)}
SHAPES = ("square", "circle", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
DIRECTIONS = ("left", "right", "up", "down")
DIGITS = tuple(str(d) for d in range(10))
# Each word is a fixed melody of three digit tones; first tones differ, so one tone names the word.
WORDS = {"cat": (1, 4, 7), "dog": (8, 2, 5), "sun": (3, 9, 0), "map": (6, 0, 3), "owl": (2, 7, 9), "fig": (9, 5, 1)}
TEXT_WORDS = ("red", "green", "blue", "yellow", "cat", "dog", "sun", "box")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")
MODALITY_NAMES = ("image", "video", "audio", "text")

# question type -> (modality, question text, answer set)
QUESTIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "image_count": ("image", "How many shapes?", tuple(str(c) for c in range(1, 5))),
    "image_colour": ("image", "What colour are the shapes?", tuple(COLOURS)),
    "image_shape": ("image", "What shape are they?", SHAPES),
    "image_position": ("image", "Where is the shape?", QUADRANTS),
    "video_direction": ("video", "Which way does it move?", DIRECTIONS),
    "video_colour": ("video", "What colour is the moving shape?", tuple(COLOURS)),
    "audio_first_digit": ("audio", "What is the first digit?", DIGITS),
    "audio_first_word": ("audio", "What is the first word?", tuple(WORDS)),
    "text_first_word": ("text", "What is the first word?", TEXT_WORDS),
}
CAPTION_PROMPT = "Describe it."
_SPLITS = {"train": 0, "eval": 1}


@dataclass
class Tail:
    """Truncated Pareto law on integers in [lo, hi]: P(X > x) ~ (lo/x)^alpha. Smaller alpha = heavier tail."""
    lo: int = 1
    hi: int = 1
    alpha: float = 1.5

    def draw(self, rng: np.random.Generator) -> int:
        u = rng.random()
        scale = 1.0 - (self.lo / self.hi) ** self.alpha
        return int(min(self.hi, math.floor(self.lo * (1.0 - u * scale) ** (-1.0 / self.alpha))))

    def check(self, name: str) -> None:
        if not 0 < self.lo <= self.hi:
            raise ConfigError(f"world.{name}: need 0 < lo <= hi, got lo={self.lo}, hi={self.hi}")
        if self.alpha <= 0:
            raise ConfigError(f"world.{name}.alpha={self.alpha}: must be > 0")


@dataclass
class WorldConfig:
    seed: int = 0
    # share of each modality (normalised); text = text-only samples
    weights: dict[str, float] = field(default_factory=lambda: {"image": 0.4, "video": 0.2, "audio": 0.3, "text": 0.1})
    caption_prob: float = 0.15
    image_side: Tail = field(default_factory=lambda: Tail(16, 128, 1.3))
    max_aspect: float = 2.0          # long side / short side at most this
    size_multiple: int = 8           # image and frame sides are multiples of this
    video_frames: Tail = field(default_factory=lambda: Tail(2, 32, 1.2))
    video_side: Tail = field(default_factory=lambda: Tail(16, 48, 1.5))
    audio_items: Tail = field(default_factory=lambda: Tail(1, 16, 1.2))
    text_words: Tail = field(default_factory=lambda: Tail(2, 256, 1.0))
    tone_s: float = 0.12             # seconds per digit tone
    gap_s: float = 0.04              # silence between tones
    noise: float = 0.03              # pixel / waveform noise level
    pairs: bool = False              # every sample a preference pair: the correct answer chosen, a wrong one rejected

    def check(self) -> "WorldConfig":
        for k in self.weights:
            if k not in MODALITY_NAMES:
                raise ConfigError(f"world.weights.{k}: unknown modality; expected {', '.join(MODALITY_NAMES)}")
        if any(v < 0 for v in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ConfigError(f"world.weights={self.weights}: must be >= 0 with a positive sum")
        if not 0 <= self.caption_prob <= 1:
            raise ConfigError(f"world.caption_prob={self.caption_prob}: must be in [0, 1]")
        for name in ("image_side", "video_frames", "video_side", "audio_items", "text_words"):
            getattr(self, name).check(name)
        if self.max_aspect < 1:
            raise ConfigError(f"world.max_aspect={self.max_aspect}: must be >= 1")
        if self.size_multiple <= 0 or self.image_side.lo < self.size_multiple or self.video_side.lo < self.size_multiple:
            raise ConfigError(f"world.size_multiple={self.size_multiple}: must be > 0 and <= the smallest side")
        if self.tone_s <= 0 or self.gap_s < 0:
            raise ConfigError("world.tone_s must be > 0 and world.gap_s >= 0")
        return self


@dataclass(frozen=True)
class WorldItem:
    """A sample plus what evaluation needs: its question type and the expected answer text."""
    sample: Sample
    qtype: str            # a key of QUESTIONS, or "caption"
    modality: str
    answer: str

    def prompt(self) -> Sample:
        """The sample without its answer segment: what greedy decoding starts from."""
        return Sample(self.sample.segments[:-1], self.sample.source, self.sample.index)


def _plural(word: str, n: int) -> str:
    return word if n == 1 else word + "s"


_SPEC_CACHE = 8192  # specs kept per world (a few MB): more than a window's look-ahead pool


class World:
    """Random-access generator: `item(i)`, `sample(i)` and cheap `meta(i)` for i >= 0."""

    def __init__(self, cfg: WorldConfig | None = None, split: str = "train", name: str = "world"):
        if split not in _SPLITS:
            raise UserError(f"world split={split!r}: must be 'train' or 'eval'")
        self.cfg = (cfg or WorldConfig()).check()
        self.split = split
        self.name = name
        w = np.array([self.cfg.weights.get(m, 0.0) for m in MODALITY_NAMES], np.float64)
        self._cum = np.cumsum(w / w.sum())
        self._specs: dict[int, dict[str, Any]] = {}  # recent specs: a loader reads meta(i), then item(i)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_specs": {}}

    # ------------------------------------------------------------------------------- specs
    def _rng(self, index: int, stream: int) -> np.random.Generator:
        if index < 0:
            raise UserError(f"world index {index}: must be >= 0")
        return np.random.default_rng([self.cfg.seed, _SPLITS[self.split], int(index), stream])

    def _side_pair(self, rng: np.random.Generator, tail: Tail) -> tuple[int, int]:
        """(H, W): the short side from `tail`, the long side up to max_aspect times it, random orientation."""
        c, m = self.cfg, self.cfg.size_multiple
        short = tail.draw(rng)
        long = short * math.exp(rng.uniform(0, 1) * math.log(c.max_aspect))
        h, w = (short, long) if rng.random() < 0.5 else (long, short)
        return max(m, int(h) // m * m), max(m, int(w) // m * m)

    def spec(self, index: int) -> dict[str, Any]:
        """All random choices of sample `index` (no rendering); the same dict for a recent index."""
        s = self._specs.get(index)
        if s is None:
            s = self._draw_spec(index)
            if len(self._specs) >= _SPEC_CACHE:
                self._specs = {}  # a new dict, not clear(): other threads may be reading the old one
            self._specs[index] = s
        return s

    def _draw_spec(self, index: int) -> dict[str, Any]:
        c, rng = self.cfg, self._rng(index, 0)
        modality = MODALITY_NAMES[int(np.searchsorted(self._cum, rng.random(), side="right").clip(0, 3))]
        s: dict[str, Any] = {"modality": modality, "caption": modality != "text" and rng.random() < c.caption_prob}
        if modality == "image":
            s["size"] = self._side_pair(rng, c.image_side)
            s["count"] = int(rng.integers(1, 5))
            s["colour"] = str(rng.choice(list(COLOURS)))
            s["shape"] = str(rng.choice(SHAPES))
            s["quadrants"] = [int(q) for q in rng.permutation(4)[: s["count"]]]
            qtypes = ["image_count", "image_colour", "image_shape"] + (["image_position"] if s["count"] == 1 else [])
        elif modality == "video":
            s["frames"] = c.video_frames.draw(rng)
            s["size"] = self._side_pair(rng, c.video_side)
            s["colour"] = str(rng.choice(list(COLOURS)))
            s["shape"] = str(rng.choice(SHAPES))
            s["direction"] = str(rng.choice(DIRECTIONS))
            qtypes = ["video_direction", "video_colour"]
        elif modality == "audio":
            s["kind"] = "digits" if rng.random() < 0.5 else "words"
            n = c.audio_items.draw(rng)
            if s["kind"] == "digits":
                s["items"] = [str(d) for d in rng.integers(0, 10, n)]
                qtypes = ["audio_first_digit"]
            else:
                s["items"] = [str(w) for w in rng.choice(list(WORDS), n)]
                qtypes = ["audio_first_word"]
            s["lead_s"] = float(rng.uniform(0.0, 0.05))
        else:
            s["items"] = [str(w) for w in rng.choice(TEXT_WORDS, c.text_words.draw(rng))]
            qtypes = ["text_first_word"]
        s["qtype"] = "caption" if s["caption"] else str(rng.choice(qtypes))
        s["answer"] = self._answer(s)
        if self.cfg.pairs:
            s["wrong"] = self._wrong_answer(s, self._rng(index, 2))
        return s

    @classmethod
    def _wrong_answer(cls, s: dict[str, Any], rng: np.random.Generator) -> str:
        """A wrong answer to the sample's question: another of its answer set; a caption with one attribute
        changed (an image's colour, a video's direction, a sound's first item)."""
        def other(options, right):
            return str(rng.choice([o for o in options if o != right]))
        if s["qtype"] != "caption":
            return other(QUESTIONS[s["qtype"]][2], s["answer"])
        if s["modality"] in ("image", "video"):
            key, options = ("colour", tuple(COLOURS)) if s["modality"] == "image" else ("direction", DIRECTIONS)
            return cls._answer({**s, key: other(options, s[key])})
        options = DIGITS if s["kind"] == "digits" else tuple(WORDS)
        return cls._answer({**s, "items": [other(options, s["items"][0])] + s["items"][1:]})

    @staticmethod
    def _answer(s: dict[str, Any]) -> str:
        q = s["qtype"]
        if q == "caption":
            if s["modality"] == "image":
                return f"{NUMBER_WORDS[s['count']]} {s['colour']} {_plural(s['shape'], s['count'])}"
            if s["modality"] == "video":
                return f"a {s['colour']} {s['shape']} moving {s['direction']}"
            return " ".join(s["items"])
        if q == "image_count":
            return str(s["count"])
        if q in ("image_colour", "video_colour"):
            return s["colour"]
        if q == "image_shape":
            return s["shape"]
        if q == "image_position":
            return QUADRANTS[s["quadrants"][0]]
        if q == "video_direction":
            return s["direction"]
        return s["items"][0]

    def _prompt_text(self, s: dict[str, Any]) -> str:
        body = " ".join(s["items"]) + "\n" if s["modality"] == "text" else ""
        question = CAPTION_PROMPT if s["qtype"] == "caption" else QUESTIONS[s["qtype"]][1]
        return f"{body}Q: {question}\nA: "

    def _audio_len(self, s: dict[str, Any]) -> int:
        c = self.cfg
        per = c.tone_s + c.gap_s if s["kind"] == "digits" else 3 * (c.tone_s / 2 + c.gap_s / 4) + c.gap_s
        return int(round((s["lead_s"] + per * len(s["items"]) + c.gap_s) * SAMPLE_RATE))

    def _media_shape(self, s: dict[str, Any]) -> tuple[int, ...] | None:
        if s["modality"] == "image":
            return (*s["size"], 3)
        if s["modality"] == "video":
            return (s["frames"], *s["size"], 3)
        if s["modality"] == "audio":
            return (self._audio_len(s),)
        return None

    # ------------------------------------------------------------------------------ public
    def meta(self, index: int) -> SampleMeta:
        """Shapes of sample `index` without rendering its payload."""
        s = self.spec(index)
        segs = [SegmentMeta("text", (1,))]
        shape = self._media_shape(s)
        if shape is not None:
            segs.append(SegmentMeta(s["modality"], shape))
        segs.append(SegmentMeta("text", (len(self._prompt_text(s).encode()),)))
        segs.append(SegmentMeta("text", (len(s["answer"].encode()) + 1,), True))
        if self.cfg.pairs:  # the same document with the wrong answer after it
            segs = [replace(x, pair=CHOSEN) for x in segs] + [replace(x, pair=REJECTED) for x in segs[:-1]] + [
                SegmentMeta("text", (len(s["wrong"].encode()) + 1,), True, REJECTED)]
        return SampleMeta(tuple(segs), self.name, int(index))

    def text_segments(self, index: int) -> dict[int, np.ndarray]:
        """Token ids of sample `index`'s text segments by position, without rendering its media."""
        s = self.spec(index)
        k = 1 if self._media_shape(s) is None else 2
        out = {0: np.array([tokenizer.BOS], np.int32), k: tokenizer.encode(self._prompt_text(s)),
               k + 1: tokenizer.encode(s["answer"], eos=True)}
        if self.cfg.pairs:
            out.update({k + 2 + j: v for j, v in out.items() if j != k + 1})
            out[2 * k + 3] = tokenizer.encode(s["wrong"], eos=True)
        return out

    def item(self, index: int) -> WorldItem:
        s = self.spec(index)
        rng = self._rng(index, 1)
        segs = [Segment("text", np.array([tokenizer.BOS], np.int32))]
        if s["modality"] == "image":
            segs.append(Segment("image", self._render_image(s, rng)))
        elif s["modality"] == "video":
            segs.append(Segment("video", self._render_video(s, rng)))
        elif s["modality"] == "audio":
            segs.append(Segment("audio", self._render_audio(s, rng)))
        segs.append(Segment("text", tokenizer.encode(self._prompt_text(s))))
        segs.append(Segment("text", tokenizer.encode(s["answer"], eos=True), loss=True))
        sample = Sample(tuple(segs), self.name, int(index))
        return WorldItem(sample, s["qtype"], s["modality"], s["answer"])

    def sample(self, index: int) -> Sample:
        """Sample `index` as training reads it: plain, or with `pairs` its preference pair."""
        plain = self.item(index).sample
        if not self.cfg.pairs:
            return plain
        segs = plain.segments
        wrong = Segment("text", tokenizer.encode(self.spec(index)["wrong"], eos=True), loss=True, pair=REJECTED)
        return Sample(tuple(replace(x, pair=CHOSEN) for x in segs) + tuple(replace(x, pair=REJECTED) for x in segs[:-1])
                      + (wrong,), plain.source, plain.index)

    def __getitem__(self, index: int) -> Sample:
        return self.sample(index)

    def eval_items(self, n: int, start: int = 0) -> list[WorldItem]:
        """The first n scored (non-caption) items from `start` on."""
        out, i = [], start
        while len(out) < n:
            if self.spec(i)["qtype"] != "caption":
                out.append(self.item(i))
            i += 1
        return out

    # ---------------------------------------------------------------------------- renders
    def _background(self, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        base = rng.uniform(0.05, 0.3)
        return (base + self.cfg.noise * rng.standard_normal(shape)).astype(np.float32)

    @staticmethod
    def _mask(h: int, w: int, kind: str, cy: float, cx: float, r: float) -> np.ndarray:
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        dy, dx = yy + 0.5 - cy, xx + 0.5 - cx
        if kind == "square":
            return (np.abs(dy) <= r * 0.85) & (np.abs(dx) <= r * 0.85)
        if kind == "circle":
            return dy * dy + dx * dx <= r * r
        return (dy >= -r) & (dy <= r) & (np.abs(dx) <= (dy + r) / 2)  # triangle pointing up

    @staticmethod
    def _rgb(colour: str, rng: np.random.Generator) -> np.ndarray:
        return np.clip(np.array(COLOURS[colour]) + rng.uniform(-0.06, 0.06, 3), 0, 1).astype(np.float32)

    def _render_image(self, s: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
        h, w = s["size"]
        img = self._background((h, w, 3), rng)
        qh, qw = h / 2, w / 2
        for q in s["quadrants"]:
            r = 0.42 * min(qh, qw) * rng.uniform(0.75, 1.0)
            oy, ox = (q // 2) * qh, (q % 2) * qw
            cy = oy + rng.uniform(min(r, qh / 2), max(qh - r, qh / 2))
            cx = ox + rng.uniform(min(r, qw / 2), max(qw - r, qw / 2))
            img[self._mask(h, w, s["shape"], cy, cx, r)] = self._rgb(s["colour"], rng)
        return np.clip(img, 0, 1)

    def _render_video(self, s: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
        t, (h, w) = s["frames"], s["size"]
        r = 0.22 * min(h, w)
        frames = np.empty((t, h, w, 3), np.float32)
        bg = self._background((h, w, 3), rng)
        rgb = self._rgb(s["colour"], rng)
        across = rng.uniform(r, (h if s["direction"] in ("left", "right") else w) - r)
        for k in range(t):
            f = k / max(t - 1, 1)
            if s["direction"] in ("left", "right"):
                cx = r + (w - 2 * r) * (f if s["direction"] == "right" else 1 - f)
                cy = across
            else:
                cy = r + (h - 2 * r) * (f if s["direction"] == "down" else 1 - f)
                cx = across
            frame = bg + self.cfg.noise * 0.5 * rng.standard_normal((h, w, 3)).astype(np.float32)
            frame[self._mask(h, w, s["shape"], cy, cx, r)] = rgb
            frames[k] = frame
        return np.clip(frames, 0, 1)

    @staticmethod
    def tone_hz(digit: int) -> float:
        """Frequency of a digit tone: 400 Hz * 1.3^d (400..4240 Hz, well apart on the mel scale)."""
        return 400.0 * 1.3 ** digit

    def _render_audio(self, s: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
        c = self.cfg
        n = self._audio_len(s)
        wave = (c.noise * 0.3 * rng.standard_normal(n)).astype(np.float32)
        if s["kind"] == "digits":
            tones = [(int(d), c.tone_s, c.gap_s) for d in s["items"]]
        else:
            tones = []
            for word in s["items"]:
                melody = WORDS[word]
                tones += [(d, c.tone_s / 2, c.gap_s / 4) for d in melody[:-1]]
                tones.append((melody[-1], c.tone_s / 2, c.gap_s / 4 + c.gap_s))
        pos = int(s["lead_s"] * SAMPLE_RATE)
        amp = rng.uniform(0.3, 0.7)
        for digit, dur, gap in tones:
            m = int(dur * SAMPLE_RATE)
            t = np.arange(m) / SAMPLE_RATE
            env = np.sin(np.pi * np.arange(m) / m) ** 0.5  # soft onset/offset, no clicks
            seg = amp * env * np.sin(2 * np.pi * self.tone_hz(digit) * t + rng.uniform(0, 2 * np.pi))
            end = min(n, pos + m)
            wave[pos:end] += seg[: end - pos].astype(np.float32)
            pos += m + int(gap * SAMPLE_RATE)
        return wave


def chance(modality: str | None = None) -> dict[str, float] | float:
    """Accuracy of uniform guessing: per question type, or averaged over a modality's question types.

    Within a modality the world picks scored question types uniformly (image_position only when there
    is one shape, i.e. 1/4 of images: its share is weighted accordingly).
    """
    per = {q: 1.0 / len(a) for q, (_, _, a) in QUESTIONS.items()}
    if modality is None:
        return per
    if modality == "image":
        # count==1 (p=1/4): 4 types; otherwise 3 types
        shares = {"image_count": 0.25 / 4 + 0.75 / 3, "image_colour": 0.25 / 4 + 0.75 / 3,
                  "image_shape": 0.25 / 4 + 0.75 / 3, "image_position": 0.25 / 4}
        return sum(per[q] * p for q, p in shares.items())
    qs = [q for q, (m, _, _) in QUESTIONS.items() if m == modality]
    if not qs:
        raise UserError(f"no questions for modality {modality!r}")
    return sum(per[q] for q in qs) / len(qs)


def token_report(world: World, n: int = 2000, mm_cfg: Any = None, start: int = 0) -> dict[str, Any]:
    """Distribution of encoder input rows and LLM tokens per sample over n samples (metadata only).

    Returns {"all": stats, "<modality>": stats}, stats = {"count", "encoder_rows": {...}, "llm_tokens": {...}}
    with mean, p50, p90, p99 and max; LLM tokens include the encoder output tokens placed in the sequence.
    """
    from omnijax.data.tokens import sample_tokens  # the one place that counts tokens per modality

    rows: dict[str, list[tuple[int, int]]] = {}
    for i in range(start, start + n):
        meta = world.meta(i)
        enc, llm = sample_tokens(meta, mm_cfg)
        mod = next((s.modality for s in meta.segments if s.modality != "text"), "text")
        for key in ("all", mod):
            rows.setdefault(key, []).append((sum(enc.values()), llm))

    def stats(v: np.ndarray) -> dict[str, float]:
        q = {f"p{p}": round(float(np.percentile(v, p)), 1) for p in (50, 90, 99)}
        return {"mean": round(float(v.mean()), 1), **q, "max": int(v.max())}

    out = {}
    for key, vals in rows.items():
        a = np.array(vals)
        out[key] = {"count": len(vals), "encoder_rows": stats(a[:, 0]), "llm_tokens": stats(a[:, 1])}
    return out
