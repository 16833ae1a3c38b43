"""Write a small multimodal dataset as a user would bring it: JPEG/PNG images, mp4 videos, WAV/FLAC audio,
a JSONL of interleaved segments, a LLaVA-style conversation JSON, and a tiny Hugging Face tokenizer.

The content is the built-in world's (shapes, moving blocks, tone sequences with their questions), so a model
trained on it has something to learn; two entries are deliberately corrupt (a truncated JPEG and an empty WAV)
to show that `recipes convert` skips and counts them. The README's "Train on your own data" runs on this.
`{train,eval}_pairs.jsonl` hold the same questions as preference pairs for `recipes dpo` (the correct answer
chosen, a wrong one rejected; the first `llava` of them as LLaVA conversations with two marked assistant turns).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DESCRIPTION = "write a small JPEG/mp4/WAV + JSONL/LLaVA dataset and a tiny HF tokenizer (the README's own-data example)"


@dataclass
class ExampleDataConfig:
    output: str = "example_data"   # folder to write
    train: int = 400               # training records (the two corrupt ones come on top)
    eval: int = 100                # held-out records
    llava: int = 100               # of the training records, also written as LLaVA conversations
    video_fps: float = 2.0         # the fps videos are written at (convert's media.video_fps keeps every frame)
    seed: int = 0
    tokenizer_vocab: int = 400     # the tiny BPE's vocabulary (incl. specials; <= the model's vocab_size)


def _even(frames: np.ndarray) -> np.ndarray:
    """H.264 with 4:2:0 chroma needs even sides: drop a last odd row/column."""
    t, h, w, c = frames.shape
    return frames[:, : h - h % 2, : w - w % 2]


def _write_item(item, root: Path, k: int, fps: float) -> tuple[dict, list[str]]:
    """One world item -> (JSONL record with media files written under root/media, its texts)."""
    from omnijax.data import media, tokenizer

    segs, texts = [], []
    ext = {"image": ".jpg" if k % 2 else ".png", "video": ".mp4", "audio": ".wav" if k % 2 else ".flac"}
    for seg in item.sample.segments:
        if seg.modality == "text":
            ids = [int(i) for i in np.asarray(seg.data) if i < 256]
            if not ids:
                continue  # the world's BOS
            text = tokenizer.decode(ids)
            texts.append(text)
            segs.append({"text": text, "loss": True} if seg.loss else {"text": text})
            continue
        rel = f"media/{k:06d}_{seg.modality}{ext[seg.modality]}"
        path = root / rel
        if seg.modality == "image":
            media.write_image(path, seg.data)
        elif seg.modality == "video":
            media.write_video(path, _even(np.asarray(seg.data)), fps)
        else:
            media.write_audio(path, seg.data, 16000)
        segs.append({seg.modality: rel})
    return {"segments": segs}, texts


def _llava(record: dict) -> dict | None:
    """The same record as a LLaVA-style conversation (media first in the human turn)."""
    media_keys = [m for s in record["segments"] for m in ("image", "video", "audio") if m in s]
    texts = [s for s in record["segments"] if "text" in s]
    if len(media_keys) != 1 or len(texts) != 2:
        return None
    m = media_keys[0]
    path = next(s[m] for s in record["segments"] if m in s)
    return {m: path, "conversations": [{"from": "human", "value": f"<{m}>\n{texts[0]['text']}"},
                                       {"from": "gpt", "value": texts[1]["text"]}]}


def _pair(record: dict, wrong: str, llava: bool) -> dict | None:
    """The record as a preference pair: its prompt, its answer chosen, `wrong` rejected (a LLaVA conversation
    with two marked assistant turns when `llava`)."""
    answers = [s["text"] for s in record["segments"] if s.get("loss")]
    if len(answers) != 1:
        return None
    prompt = [s for s in record["segments"] if not s.get("loss")]
    if not llava:
        return {"segments": prompt, "chosen": answers[0], "rejected": wrong}
    conv = _llava(record)
    if conv is None:
        return None
    turns = conv["conversations"][:1] + [{"from": "gpt", "value": answers[0], "preference": "chosen"},
                                         {"from": "gpt", "value": wrong, "preference": "rejected"}]
    return {**conv, "conversations": turns}


def _tokenizer(folder: Path, texts: list[str], vocab: int) -> None:
    """A tiny byte-level BPE trained on the dataset's own text, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2))


def main(argv: list[str]) -> int:
    from tqdm.auto import tqdm

    from omnijax.config import build
    from omnijax.data.world import World, WorldConfig
    from omnijax.errors import ConfigError

    cfg = build(ExampleDataConfig, None, argv, check=None)
    if cfg.train <= 0 or cfg.eval < 0 or not 0 <= cfg.llava <= cfg.train or cfg.video_fps <= 0:
        raise ConfigError(f"train={cfg.train} must be > 0, eval={cfg.eval} >= 0, llava in [0, train], video_fps > 0")
    root = Path(cfg.output)
    (root / "media").mkdir(parents=True, exist_ok=True)
    # video_frames/sides as the tiny recipe expects; every modality present
    world_cfg = WorldConfig(seed=cfg.seed, pairs=True)  # pairs: each spec also draws a wrong answer (items stay plain)
    texts: list[str] = []
    files = {}
    for split, n, offset in (("train", cfg.train, 0), ("eval", cfg.eval, 1_000_000)):
        world = World(world_cfg, "train" if split == "train" else "eval")
        records, pairs = [], []
        for i in tqdm(range(n), desc=f"example_data {split}", unit="rec", file=sys.stderr, mininterval=1.0):
            record, t = _write_item(world.item(i), root, offset + i, cfg.video_fps)
            records.append(record)
            texts += t
            pair = _pair(record, world.spec(i)["wrong"], llava=split == "train" and i < cfg.llava)
            if pair is not None:
                pairs.append(pair)
        (root / f"{split}_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
        files[f"{split}_pairs"] = str(root / f"{split}_pairs.jsonl")
        if split == "train":
            # two broken inputs a real dataset would have: a truncated JPEG and a zero-length WAV
            good = next(r for r in records if any("image" in s for s in r["segments"]))
            img = root / next(s["image"] for s in good["segments"] if "image" in s)
            (root / "media/corrupt.jpg").write_bytes(img.read_bytes()[:40] if img.suffix == ".jpg" else b"\xff\xd8\xff\xe0")
            import soundfile as sf

            sf.write(root / "media/empty.wav", np.zeros(0, np.float32), 16000)
            records.insert(len(records) // 3, {"segments": [{"image": "media/corrupt.jpg"}, {"text": "What is this?"},
                                                            {"text": "a broken file", "loss": True}]})
            records.insert(2 * len(records) // 3, {"segments": [{"audio": "media/empty.wav"}, {"text": "How many tones?"},
                                                                {"text": "none", "loss": True}]})
            convs = [c for c in (_llava(r) for r in records[: cfg.llava]) if c is not None]
            (root / "train_llava.json").write_text(json.dumps(convs, indent=1))
            files["llava"] = str(root / "train_llava.json")
        path = root / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        files[split] = str(path)
    _tokenizer(root / "tokenizer", texts, cfg.tokenizer_vocab)
    files["tokenizer"] = str(root / "tokenizer")
    print(json.dumps({"output": str(root), **files, "train_records": cfg.train + 2, "eval_records": cfg.eval,
                      "corrupt": 2}))
    return 0
