"""Packing samples into fixed-capacity buffers (the batch layout the multimodal model consumes).

Per bin (one dp rank x microbatch): LLM rows [rows, row_len] and, per encoder E, input rows
[N_E, D_E]. Capacities come from small bucket sets (`buckets`), so a run compiles at most
|row buckets| x prod |encoder buckets| step shapes; `ShapeCounter` reports how many it used.

A sample is flattened into one LLM token run: text tokens as they are, each image/video/audio
segment as `n_llm` placeholder ids (tokenizer.PLACEHOLDER) whose embeddings the model replaces by
the encoder outputs; `E_dest` tells where each encoder output token goes (flat index into rows x
row_len, -1 = padding). Targets are next tokens within the sample; `loss_mask` is 1 where the
target is a token of a loss segment. Over-long text-only samples are split into row-sized pieces.

A preference pair (DPO; `SegmentMeta.pair`) is one sample of two documents, prompt + chosen answer and
prompt + rejected answer, packed whole into one row (never split): each document its own segment id,
positions and targets, and `pref_index` [rows, row_len] names the pair slot p of the row a token belongs to
(2p+1 the chosen document, 2p+2 the rejected one, 0 none), which `models/preference.py` reads.

M-RoPE models (`model.llm.rope.mrope_section`, Qwen2-VL/Qwen2.5-VL) get `rope_positions` [rows, row_len, 3]
beside `positions`: each sample's (t, h, w) rotary positions, computed from its segments' metadata when it is
flattened (`qwen_processor.sample_rope_positions`), segment-local like `positions`, and copied into its row
as they are: nothing downstream recomputes them from the row index.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from omnijax.data import tokenizer
from omnijax.data.payload import LazyRows, Payload, Runs
from omnijax.data.sample import REJECTED, BadSample, Sample, SampleMeta

ENCODER_ORDER = ("audio", "vision")
# the per-token arrays of packed LLM rows: what moves with a row (row balance, placement, cp's order)
# every per-token row array a batch may carry: rows move, concatenate and are placed with all of them
# (preference pairs' `pref_index` and a precomputed reference's `ref_logps` included)
ROW_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "rope_positions", "pref_index", "ref_logps")


@dataclass(frozen=True)
class EncoderSpec:
    name: str
    dim: int        # D_E: width of one input row
    group: int      # r_E: input rows per output token


def encoder_specs(mm_cfg: Any) -> dict[str, EncoderSpec]:
    """Input width and grouping factor of every encoder in the model config."""
    from omnijax.mm_config import AudioConfig, VisionConfig, encoder_configs
    out = {}
    for name, e in encoder_configs(mm_cfg).items():
        if isinstance(e, VisionConfig):
            out[name] = EncoderSpec(name, e.temporal_patch * e.patch * e.patch * 3, e.merge * e.merge)
        elif isinstance(e, AudioConfig):
            out[name] = EncoderSpec(name, e.n_mels, e.reduction)
        else:  # a registered encoder kind must expose these two numbers
            out[name] = EncoderSpec(name, int(getattr(e, "input_dim")), int(getattr(e, "group", 1)))
    return dict(sorted(out.items()))


def buckets(largest: int, multiple: int = 1, smallest: int | None = None, growth: float = 1.5) -> tuple[int, ...]:
    """Capacities from `smallest` to `largest` (included), each ~`growth` x the previous, multiples of `multiple`.

    growth 1.5 bounds the padding of one buffer to about a third while keeping the set small
    (about log(largest/smallest)/log(1.5) sizes).
    """
    if growth <= 1:
        raise ValueError(f"bucket growth={growth}: must be > 1")
    largest = math.ceil(largest / multiple) * multiple
    c = max(multiple, math.ceil((smallest or multiple) / multiple) * multiple)
    out = []
    while c < largest:
        out.append(c)
        c = max(c + multiple, math.ceil(c * growth / multiple) * multiple)
    return tuple(out + [largest])


def pick(bucket_set: tuple[int, ...], need: int) -> int:
    """Smallest bucket >= need (the largest one if none is; callers check capacity before)."""
    for b in bucket_set:
        if b >= need:
            return b
    return bucket_set[-1]


@dataclass(frozen=True)
class Layout:
    rows: int
    row_len: int
    enc: tuple[tuple[str, int], ...]   # (encoder name, N_E input rows), sorted by name

    @property
    def key(self) -> tuple:
        return (self.rows, self.row_len, self.enc)


@dataclass
class ShapeCounter:
    """Distinct step shapes seen (bounded by the bucket sets) and padding accounting."""
    shapes: set = field(default_factory=set)
    real_tokens: int = 0
    total_tokens: int = 0
    real_enc: int = 0
    total_enc: int = 0

    def add(self, layout: Layout, batch: dict[str, Any]) -> None:
        """Counts of a packed batch: the whole step's where it carries the step's geometry (`row_docs`)."""
        self.shapes.add(layout.key)
        if "row_docs" in batch:
            self.real_tokens += int(batch["row_docs"][:, 1].sum())
            self.total_tokens += len(batch["row_docs"]) * layout.row_len
        else:
            self.real_tokens += int((batch["segment_ids"] > 0).sum())
            self.total_tokens += int(batch["segment_ids"].size)
        for name, _ in layout.enc:
            ids = batch[f"{name}_segment_ids"]
            self.real_enc += ids.real if isinstance(ids, Runs) else int((ids > 0).sum())
            self.total_enc += len(ids)

    @property
    def padded_fraction(self) -> float:
        total = self.total_tokens + self.total_enc
        return 1.0 - (self.real_tokens + self.real_enc) / total if total else 0.0


# ------------------------------------------------------------------------------ flattening
def uses_mrope(mm_cfg: Any) -> bool:
    """The LLM turns q/k by 3-D (t, h, w) positions (Qwen2-VL's M-RoPE): batches carry `rope_positions`."""
    rope = getattr(getattr(mm_cfg, "llm", None), "rope", None)
    return bool(getattr(rope, "mrope_section", None))


@dataclass
class Flat:
    tokens: np.ndarray | None           # int32 [n]; None: a row another host holds (only its geometry here)
    loss: np.ndarray | None             # bool [n]: token is a loss target
    enc: list[tuple[str, Any, Any, int]]  # (encoder, inputs or Payload, positions or a () -> positions, llm offset)
    length: int = -1                    # n when `tokens` is None
    rope: np.ndarray | None = None      # int32 [n, 3] M-RoPE positions (M-RoPE models' rows built here)
    mrope: bool = False                 # the model is an M-RoPE one (set for rows laid out elsewhere too)
    docs: tuple[int, ...] = ()          # a preference pair's two documents' lengths (chosen, rejected); () one

    @property
    def size(self) -> int:
        """LLM tokens of the run."""
        return self.length if self.tokens is None else int(self.tokens.size)


def _assemble(segments, where: str, mm_cfg: Any, specs: dict[str, EncoderSpec], placeholder: dict[str, int] | None,
              text_of: Callable | None, media_of: Callable) -> Flat:
    """The token run of a sample's segments: `text_of(k, seg)` gives a text segment's ids, `media_of(k, seg,
    spec, cfg)` a media segment's (inputs, positions, rows) — arrays, or a `Payload` decoded later.
    `text_of` None: the run's geometry only (lengths from the metadata, no token arrays)."""
    placeholder = placeholder or tokenizer.PLACEHOLDER
    from omnijax.data.tokens import modality_configs
    typed = modality_configs(mm_cfg)
    toks, loss, enc = [], [], []
    n = 0
    cut = None  # a preference pair: where its rejected document starts
    for k, seg in enumerate(segments):
        if cut is None and getattr(seg, "pair", 0) == REJECTED:
            cut = n
        if seg.modality == "text" and text_of is None:
            n += seg.length
            continue
        if seg.modality == "text":
            ids, on = text_of(k, seg)
            toks.append(ids)
            loss.append(np.full(ids.size, on))
            n += ids.size
            continue
        name = mm_cfg.modalities.get(seg.modality)
        if name not in specs:
            raise BadSample(f"{where}: no encoder for modality {seg.modality!r}")
        spec = specs[name]
        inputs, positions, rows = media_of(k, seg, spec, typed[seg.modality])
        if rows % spec.group:
            raise BadSample(f"{where}: {rows} {name} rows are not a multiple of its grouping {spec.group}")
        t = rows // spec.group
        if text_of is not None:
            toks.append(np.full(t, placeholder[seg.modality], np.int32))
            loss.append(np.zeros(t, bool))
        enc.append((name, inputs, positions, n))  # its output tokens take LLM positions n .. n+t-1
        n += t
    mrope = uses_mrope(mm_cfg)
    docs = () if cut is None else (cut, n - cut)
    if text_of is None:
        return Flat(None, None, enc, n, mrope=mrope, docs=docs)
    rope = None
    if mrope:  # each document's positions from its own segments
        parts = [segments] if cut is None else [[s for s in segments if s.pair != REJECTED],
                                                [s for s in segments if s.pair == REJECTED]]
        rope = np.concatenate([_rope_positions(p, typed, where) for p in parts])
    if rope is not None and len(rope) != n:
        raise BadSample(f"{where}: {len(rope)} M-RoPE positions for {n} LLM tokens")
    return Flat(np.concatenate(toks) if toks else np.zeros(0, np.int32),
                np.concatenate(loss) if loss else np.zeros(0, bool), enc, rope=rope, mrope=mrope, docs=docs)


def _rope_positions(segments, typed: dict, where: str) -> np.ndarray:
    """[n, 3] M-RoPE positions of a sample's token run from its segments' shapes (and a video's kept rate)."""
    from omnijax.data import qwen_processor
    from omnijax.mm_config import QwenVisionConfig

    metas = [seg.meta() if hasattr(seg, "meta") else seg for seg in segments]
    vision = [typed.get(m.modality) for m in metas if m.modality in ("image", "video")]
    cfg = next((c for c in vision if c is not None), None)
    if vision and not isinstance(cfg, QwenVisionConfig):
        raise BadSample(f"{where}: an M-RoPE LLM (model.llm.rope.mrope_section) places image/video tokens by "
                        f"a qwen_vit encoder's grid; this model's vision encoder is {type(cfg).__name__}")
    return qwen_processor.sample_rope_positions(metas, cfg)


def flatten(sample: Sample, mm_cfg: Any, specs: dict[str, EncoderSpec],
            placeholder: dict[str, int] | None = None) -> Flat:
    """One LLM token run for the sample plus the encoder inputs of its media segments.

    `placeholder` maps a modality to the tokenizer's placeholder id (default: the byte-level ones)."""
    from omnijax.data.features import segment_inputs

    def media(k, seg, spec, cfg):
        inputs, positions = segment_inputs(seg.modality, seg.data, cfg)
        return inputs, positions, inputs.shape[0]

    return _assemble(sample.segments, f"{sample.source}[{sample.index}]", mm_cfg, specs, placeholder,
                     lambda k, seg: (np.asarray(seg.data, np.int32), bool(seg.loss)), media)


def flatten_meta(meta: SampleMeta, text: dict[int, np.ndarray] | None, fetch: Callable[[int], np.ndarray],
                 mm_cfg: Any, specs: dict[str, EncoderSpec], placeholder: dict[str, int] | None = None,
                 on_error: Callable[[str], None] | None = None, layout_only: bool = False) -> Flat:
    """`flatten` from metadata: the same token run and buffer layout, with each media segment a `Payload`
    that `fetch(k)` decodes only if some slice of the packed buffer asks for it (its positions, too,
    are computed only then).

    `text` holds the token ids of the text segments by position; None lays out the sample's rows from
    its lengths alone (zeros, no loss). `layout_only`: a row another host trains on, whose geometry
    alone matters here: no token arrays are kept (`Flat.tokens` is None)."""
    from omnijax.data.features import encoder_tokens, segment_inputs, segment_positions
    where = f"{meta.source}[{meta.index}]"

    def text_of(k, seg):
        ids = np.zeros(seg.length, np.int32) if text is None else np.asarray(text[k], np.int32)
        if ids.shape != (seg.length,):
            raise BadSample(f"{where}: text segment {k} has {ids.size} tokens, its metadata says {seg.length}")
        return ids, bool(seg.loss) and text is not None

    def media(k, seg, spec, cfg):
        rows, _ = encoder_tokens(seg.modality, seg.shape, cfg)
        decode = lambda: segment_inputs(seg.modality, fetch(k), cfg)[0]  # noqa: E731
        positions = lambda: segment_positions(seg.modality, seg.shape, cfg)  # noqa: E731
        payload = Payload(rows, spec.dim, decode, f"{where} segment {k} ({seg.modality})", on_error, positions)
        return payload, positions, rows

    return _assemble(meta.segments, where, mm_cfg, specs, placeholder, None if layout_only else text_of, media)


def text_piece(flat: Flat, piece: int, row_len: int) -> Flat:
    """Piece `piece` (row_len tokens) of a text-only sample that is longer than one row."""
    if flat.enc or flat.docs:
        raise BadSample("only text-only samples can be split across rows (a preference pair never is)")
    lo = piece * row_len
    if flat.tokens is None:
        return Flat(None, None, [], max(0, min(row_len, flat.size - lo)), mrope=flat.mrope)
    rope = None if flat.rope is None else flat.rope[lo: lo + row_len] - lo  # a piece is a document of its own
    return Flat(flat.tokens[lo: lo + row_len], flat.loss[lo: lo + row_len], [], rope=rope, mrope=flat.mrope)


# --------------------------------------------------------------------------------- packing
def pack_bin(entries: list[tuple[Flat, int]], layout: Layout, specs: dict[str, EncoderSpec],
             pad: int = tokenizer.PAD) -> dict[str, np.ndarray]:
    """Buffers of one bin from (flattened sample, row) entries; raises BadSample if over capacity."""
    return pack([entries], layout, specs, pad)


def pack(bins, layout: Layout, specs: dict[str, EncoderSpec], pad: int = tokenizer.PAD, *,
         local: list[int] | None = None, lazy: bool | None = None, n_bins: int | None = None,
         rope: bool | None = None, sparse: bool = False) -> dict[str, Any]:
    """Buffers of several bins (e.g. a host's ranks) written in place, bin b at rows [b*rows, (b+1)*rows)
    and encoder rows [b*N_E, (b+1)*N_E); dest indices are flat into the concatenated rows and encoder
    segment ids are numbered across bins. Equal to `concat` of `pack_bin` per bin, without the copies.

    Step geometry (`lazy`, default: some sample carries a `Payload`; always with `local`): encoder inputs
    are `LazyRows`, positions `PositionRows`, segment ids and destinations `Runs` (a few integers per
    segment), and `row_docs` [bins*rows, 3] gives every row's documents, real tokens and sum of squared
    document lengths; `rows` the global index of each LLM row built. `local`: the bins whose LLM rows
    are built (a host's own; the others' entries may be `Flat`s without tokens, laid out from metadata
    only), in that order; their rows alone make the token arrays, so they grow with the host's bins,
    not the step's. `bins` may be any iterable (read once) when `n_bins` is given. `sparse` (with
    `n_bins`): `bins` yields (bin index, entries) for the bins laid out, in increasing order; every other
    bin is empty (a host that lays out only its own rows: the step's geometry holds its segments only).

    `rope_positions` [rows, L, 3] (M-RoPE): with `rope` True, or when None as soon as an entry is an
    M-RoPE model's (`Flat.mrope`); each sample's own positions in its tokens' places, a text entry without
    them (a padding prompt) at 0..n-1 on all three, padding 0."""
    R, L = layout.rows, layout.row_len
    if sparse and n_bins is None:
        raise ValueError("pack(sparse=True) needs n_bins (the step's bins)")
    if lazy is None or n_bins is None:
        bins = list(bins)
    nb = len(bins) if n_bins is None else int(n_bins)
    if lazy is None:
        lazy = any(isinstance(e[1], Payload) for entries in (bins if not sparse else (x for _, x in bins))
                   for flat, _ in entries for e in flat.enc)
    lazy = bool(lazy) or local is not None
    built = list(range(nb)) if local is None else [int(b) for b in local]
    slot = {b: k for k, b in enumerate(built)}
    if len(slot) != len(built) or any(not 0 <= b < nb for b in built):
        raise ValueError(f"pack: local bins {local} must be distinct bins of {nb}")
    nl = len(built)
    tokens = np.full((nl * R, L), pad, np.int32)
    targets = np.full((nl * R, L), pad, np.int32)
    loss_mask = np.zeros((nl * R, L), np.float32)
    seg_ids = np.zeros((nl * R, L), np.int32)
    positions = np.zeros((nl * R, L), np.int32)
    row_docs = np.zeros((nb * R, 3), np.int64) if lazy else None  # documents, tokens, sum of squared lengths
    rope_pos = np.zeros((nl * R, L, 3), np.int32) if rope else None
    pref = None  # `pref_index` [rows, L], once an entry is a preference pair
    caps = dict(layout.enc)
    enc_out, runs = {}, {}
    for name, cap in caps.items():
        spec = specs[name]
        if lazy:
            enc_out[name] = (LazyRows(nb * cap, spec.dim), None, None, None)
            runs[name] = ([], [], [], [], [])  # segment starts, rows, ids; output-token start, first destination
        else:
            enc_out[name] = (np.zeros((nb * cap, spec.dim), np.float32), np.zeros(nb * cap, np.int32),
                             np.zeros((nb * cap, 3), np.int32), np.full(nb * cap // spec.group, -1, np.int32))
    enc_seg = {name: 0 for name in caps}
    for b, entries in (bins if sparse else enumerate(bins)):
        k = slot.get(b)
        fill = np.zeros(R, np.int64)
        nseg = np.zeros(R, np.int32)
        npair = np.zeros(R, np.int32)
        used = {name: 0 for name in caps}
        for flat, row in entries:
            n = flat.size
            if rope_pos is None and rope is None and flat.mrope:
                rope_pos = np.zeros((nl * R, L, 3), np.int32)  # an M-RoPE model's step (every entry is one)
            if row >= R or fill[row] + n > L:
                raise BadSample(f"sample of {n} tokens does not fit row {row} of a {R}x{L} buffer")
            a, r = int(fill[row]), b * R + row
            docs = flat.docs or (n,)
            if flat.docs and pref is None:
                pref = np.zeros((nl * R, L), np.int32)
            if k is not None:
                if flat.tokens is None:
                    raise ValueError(f"pack: bin {b} is built here but its entries were laid out without tokens")
                rr = k * R + row
                tokens[rr, a: a + n] = flat.tokens
                lo = 0
                for j, m in enumerate(docs):  # each document its own segment id, positions and next-token targets
                    targets[rr, a + lo: a + lo + m - 1] = flat.tokens[lo + 1: lo + m]
                    loss_mask[rr, a + lo: a + lo + m - 1] = flat.loss[lo + 1: lo + m]
                    seg_ids[rr, a + lo: a + lo + m] = nseg[row] + 1 + j
                    positions[rr, a + lo: a + lo + m] = np.arange(m)
                    if flat.docs:  # pair slot p of this row: 2p+1 its chosen document, 2p+2 its rejected one
                        pref[rr, a + lo: a + lo + m] = 2 * npair[row] + 1 + j
                    lo += m
                if rope_pos is not None:
                    rope_pos[rr, a: a + n] = (np.concatenate([np.arange(m) for m in docs])[:, None]
                                              if flat.rope is None else flat.rope)
            nseg[row] += len(docs)
            npair[row] += bool(flat.docs)
            if row_docs is not None:
                row_docs[r] += (len(docs), n, sum(m * m for m in docs))
            fill[row] += n
            for name, x, pos, off in flat.enc:
                if name not in caps:
                    raise BadSample(f"layout has no buffer for encoder {name!r}")
                cap, g = caps[name], specs[name].group
                m = x.rows if isinstance(x, Payload) else x.shape[0]
                if used[name] + m > cap:
                    raise BadSample(f"{name} inputs exceed the bin's capacity of {cap} rows")
                lo = b * cap + used[name]
                inputs, eseg, epos, dest = enc_out[name]
                enc_seg[name] += 1
                first = r * L + a + int(off)
                if lazy:
                    if not isinstance(x, Payload):
                        x = Payload(m, x.shape[1], lambda x=x: x, positions=lambda pos=pos: pos)
                    if m:
                        inputs.put(lo, x)
                        starts, lengths, ids, tok0, dest0 = runs[name]
                        starts.append(lo), lengths.append(m), ids.append(enc_seg[name])
                        tok0.append(lo // g), dest0.append(first)
                else:
                    inputs[lo: lo + m] = x
                    eseg[lo: lo + m] = enc_seg[name]
                    epos[lo: lo + m] = pos() if callable(pos) else pos
                    dest[lo // g: (lo + m) // g] = first + np.arange(m // g)
                used[name] += m
    out = {"tokens": tokens, "targets": targets, "loss_mask": loss_mask, "segment_ids": seg_ids, "positions": positions}
    if rope_pos is not None:
        out["rope_positions"] = rope_pos
    if pref is not None:
        out["pref_index"] = pref
    for name, (inputs, eseg, epos, dest) in enc_out.items():
        if lazy:
            starts, lengths, ids, tok0, dest0 = runs[name]
            g, n = specs[name].group, inputs.shape[0]
            eseg = Runs(n, starts, lengths, ids)
            epos = inputs.positions()
            dest = Runs(n // g, tok0, np.asarray(lengths, np.int64) // g, dest0, step=1, fill=-1)
        out[f"{name}_inputs"], out[f"{name}_segment_ids"] = inputs, eseg
        out[f"{name}_positions"], out[f"{name}_dest"] = epos, dest
    if lazy:
        out["row_docs"] = row_docs
        out["rows"] = (np.asarray(built, np.int64)[:, None] * R + np.arange(R)[None, :]).reshape(-1)
    return out


def concat(packs: list[dict[str, np.ndarray]], layout: Layout) -> dict[str, np.ndarray]:
    """Concatenate bins (e.g. a host's ranks) along rows; dest and encoder segment ids are offset."""
    out = {k: np.concatenate([p[k] for p in packs]) for k in ROW_KEYS if k in packs[0]}
    for name, _ in layout.enc:
        dests, segs = [], []
        seg_base = 0
        for b, p in enumerate(packs):
            d = p[f"{name}_dest"]
            dests.append(np.where(d >= 0, d + b * layout.rows * layout.row_len, -1).astype(np.int32))
            s = p[f"{name}_segment_ids"]
            segs.append(np.where(s > 0, s + seg_base, 0).astype(np.int32))
            seg_base += int(s.max(initial=0))
        out[f"{name}_inputs"] = np.concatenate([p[f"{name}_inputs"] for p in packs])
        out[f"{name}_positions"] = np.concatenate([p[f"{name}_positions"] for p in packs])
        out[f"{name}_segment_ids"] = np.concatenate(segs)
        out[f"{name}_dest"] = np.concatenate(dests)
    return out


# ------------------------------------------------------------------------- one batch, in order
class SamplePacker:
    """Samples, in the order given, first-fit into one batch of fixed capacities: B rows of L LLM tokens
    and one buffer per encoder (`capacity`: input rows per encoder for the whole batch).

    For what must keep its order (greedy-decoding prompts, tests that build a known batch); training
    batches come from the data plane (`data.loader`), which reorders by cost. The same `flatten` and
    `pack` make both. A sample that can never fit or fails validation is skipped and counted in
    `skipped`, never a crash."""

    def __init__(self, mm_cfg: Any, batch_size: int, seq_len: int, capacity: dict[str, int],
                 placeholder: dict[str, int] | None = None, pad: int = tokenizer.PAD):
        from omnijax.mm_config import encoder_configs
        self.cfg = mm_cfg
        self.specs = encoder_specs(mm_cfg)
        self.encs = encoder_configs(mm_cfg)
        self.modalities = dict(mm_cfg.modalities)
        self.B, self.L = int(batch_size), int(seq_len)
        self.capacity = {name: int(capacity[name]) for name in self.specs}
        self.reduction = {name: s.group for name, s in self.specs.items()}
        self.placeholder, self.pad = placeholder, pad
        self.layout = Layout(self.B, self.L, tuple(sorted(self.capacity.items())))
        self.skipped: dict[str, int] = {}

    def _skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def sizes(self, sample: Sample) -> tuple[int, dict[str, int]] | None:
        """(LLM tokens, encoder rows per encoder) from metadata, or None (counted) if it can never fit."""
        from omnijax.mm_config import encoder_tokens
        try:
            llm, rows = 0, {}
            for seg in sample.meta().segments:
                n_in, n_llm = encoder_tokens(seg.modality, seg.shape, self.cfg)
                llm += n_llm
                if seg.modality != "text":
                    name = self.modalities[seg.modality]
                    rows[name] = rows.get(name, 0) + n_in
        except BadSample:
            self._skip("bad_sample")
            return None
        for name, n in rows.items():
            if n > self.capacity[name]:
                self._skip(f"too_large_for_{name}_capacity")
                return None
        if llm > self.L:
            self._skip("too_long_for_seq_len")
            return None
        return llm, rows

    def empty(self) -> dict[str, np.ndarray]:
        return pack([[]], self.layout, self.specs, self.pad)

    def pack(self, samples) -> tuple[dict[str, np.ndarray], list[int]]:
        """Pack in order until the next sample does not fit; returns (batch, indices consumed). Samples
        skipped as unfit count as consumed, so the caller moves on."""
        row_fill = [0] * self.B
        enc_fill = {name: 0 for name in self.specs}
        entries: list[tuple[Flat, int]] = []
        consumed: list[int] = []
        for k, sample in enumerate(samples):
            sizes = self.sizes(sample)
            if sizes is None:
                consumed.append(k)
                continue
            llm, rows = sizes
            row = next((r for r in range(self.B) if row_fill[r] + llm <= self.L), None)
            if row is None or any(enc_fill[n] + rows[n] > self.capacity[n] for n in rows):
                break
            try:
                flat = flatten(sample.validate(), self.cfg, self.specs, self.placeholder)
            except BadSample:
                self._skip("bad_sample")
                consumed.append(k)
                continue
            entries.append((flat, row))
            row_fill[row] += flat.tokens.size
            for n, m in rows.items():
                enc_fill[n] += m
            consumed.append(k)
        return pack([entries], self.layout, self.specs, self.pad), consumed
