"""The unified multimodal sample: one interleaved sequence of text, image, video and audio segments.

Every source yields `Sample`s; balancing, the cost model and the packer only look at `SampleMeta`
(modalities and shapes), which sources can produce without decoding payloads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from omnijax.data import tokenizer
from omnijax.errors import BadSample, UserError  # noqa: F401  (BadSample: data.sample's name for it)

Modality = Literal["text", "image", "video", "audio"]
MODALITIES: tuple[str, ...] = get_args(Modality)
SAMPLE_RATE = 16000
_RANK = {"text": 1, "image": 3, "video": 4, "audio": 1}




#: `pair` of a segment in a preference pair (DPO): the document of the chosen answer, of the rejected one.
CHOSEN, REJECTED = 1, 2


@dataclass(frozen=True)
class SegmentMeta:
    modality: Modality
    shape: tuple[int, ...]
    loss: bool = False
    pair: int = 0         # 0: an ordinary sample; CHOSEN / REJECTED: which document of a preference pair
    fps: float = 0.0  # video: the rate its kept frames have (M-RoPE's time steps); 0 = not recorded

    @property
    def length(self) -> int:
        """Leading extent: text tokens, image rows, video frames, audio samples."""
        return int(self.shape[0]) if self.shape else 0


@dataclass(frozen=True)
class SampleMeta:
    segments: tuple[SegmentMeta, ...]
    source: str = ""
    index: int = -1

    @property
    def text_tokens(self) -> int:
        return sum(s.shape[0] for s in self.segments if s.modality == "text")

    @property
    def loss_tokens(self) -> int:
        return sum(s.shape[0] for s in self.segments if s.modality == "text" and s.loss)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(s.modality for s in self.segments)

    @property
    def is_pair(self) -> bool:
        """A preference pair: the prompt + chosen answer document, then the prompt + rejected one."""
        return any(s.pair for s in self.segments)


def validate_meta(meta: SampleMeta) -> SampleMeta:
    """Raise BadSample if a segment's shape cannot be encoded; return meta unchanged otherwise."""
    where = f"sample {meta.source or '?'}[{meta.index}]"
    if not meta.segments:
        raise BadSample(f"{where}: has no segments")
    for k, seg in enumerate(meta.segments):
        what = f"{where} segment {k} ({seg.modality})"
        if seg.modality not in MODALITIES:
            raise BadSample(f"{what}: unknown modality; expected one of {', '.join(MODALITIES)}")
        shape = tuple(seg.shape)
        if len(shape) != _RANK[seg.modality]:
            raise BadSample(f"{what}: shape {shape} has rank {len(shape)}, expected {_RANK[seg.modality]}")
        if seg.modality in ("image", "video") and shape[-1] != 3:
            raise BadSample(f"{what}: shape {shape} must end in 3 colour channels")
        if any(d <= 0 for d in shape):
            kind = {"text": "empty text", "image": "empty image", "video": "video with zero frames or empty frames",
                    "audio": "zero-length audio"}[seg.modality]
            raise BadSample(f"{what}: {kind} (shape {shape})")
        if seg.loss and seg.modality != "text":
            raise BadSample(f"{what}: loss=True is only allowed on text segments")
    if meta.is_pair:
        _validate_pair(meta, where)
    return meta


def _validate_pair(meta: SampleMeta, where: str) -> None:
    """A pair is its chosen document's segments then its rejected document's, each with answer tokens."""
    roles = [s.pair for s in meta.segments]
    if roles[0] != CHOSEN or roles[-1] != REJECTED or any(r not in (CHOSEN, REJECTED) for r in roles) or \
            roles != sorted(roles):
        raise BadSample(f"{where}: a preference pair is the chosen answer's document then the rejected one's "
                        f"(segment roles {roles})")
    for role, name in ((CHOSEN, "chosen"), (REJECTED, "rejected")):
        if not any(s.loss for s in meta.segments if s.pair == role):
            raise BadSample(f"{where}: the {name} answer is empty (no answer tokens)")


@dataclass(frozen=True, eq=False)
class Segment:
    modality: Modality
    # text: int32 token ids [n]; image: float32 [H, W, 3] in [0, 1]; video: float32 [T, H, W, 3];
    # audio: float32 mono waveform [n_samples] at SAMPLE_RATE
    data: np.ndarray
    loss: bool = False  # text only: these tokens are training targets (answers/captions)
    pair: int = 0       # CHOSEN / REJECTED: the document of a preference pair this segment belongs to
    fps: float = 0.0    # video only: the rate of its frames (0 = not recorded)

    def meta(self) -> SegmentMeta:
        return SegmentMeta(self.modality, tuple(int(d) for d in np.shape(self.data)), bool(self.loss),
                           fps=float(self.fps), pair=int(self.pair))


@dataclass(frozen=True, eq=False)
class Sample:
    segments: tuple[Segment, ...]
    source: str = ""
    index: int = -1

    def meta(self) -> SampleMeta:
        """Modalities and shapes only: what balancing and the cost model need."""
        return SampleMeta(tuple(s.meta() for s in self.segments), self.source, self.index)

    def validate(self, vocab_size: int | None = None) -> "Sample":
        """Raise BadSample on undecodable segments (shapes, dtypes, non-finite values); return self.

        Token ids must be below `vocab_size` (default: the byte-level tokenizer's VOCAB_SIZE)."""
        vocab = tokenizer.VOCAB_SIZE if vocab_size is None else int(vocab_size)
        validate_meta(self.meta())
        for k, seg in enumerate(self.segments):
            what = f"sample {self.source or '?'}[{self.index}] segment {k} ({seg.modality})"
            data = seg.data
            if not isinstance(data, np.ndarray):
                raise BadSample(f"{what}: data must be a numpy array, got {type(data).__name__}")
            if seg.modality == "text":
                if not np.issubdtype(data.dtype, np.integer):
                    raise BadSample(f"{what}: token ids must be integers, got {data.dtype}")
                if data.min() < 0 or data.max() >= vocab:
                    raise BadSample(f"{what}: token ids outside [0, {vocab})")
            else:
                if not np.issubdtype(data.dtype, np.floating):
                    raise BadSample(f"{what}: expected float32 values, got {data.dtype}")
                if not np.all(np.isfinite(data)):
                    raise BadSample(f"{what}: contains NaN or inf")
        return self

    def with_origin(self, source: str, index: int) -> "Sample":
        return Sample(self.segments, source, index)


def text(s: str, loss: bool = False) -> Segment:
    """A text segment from a string (byte tokens)."""
    return Segment("text", tokenizer.encode(s), loss)
