"""Scoring answers to the built-in world's questions: which held-out questions, exact-match accuracy, chance.

Decoding the answers is the generator's business (`omnijax.serve.evaluate`); this module only knows the
world: its held-out items per modality, what counts as a right answer, and what guessing would score.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from omnijax.data.world import World, WorldItem, chance
from omnijax.errors import ConfigError

MEDIA = ("image", "video", "audio")
EXAMPLES_PER_QUESTION = 4  # decoded answers kept per question type for eval.json


def eval_items(world: World, per_modality: int) -> dict[str, list[WorldItem]]:
    """Held-out scored questions: the first `per_modality` of each media modality in index order.

    Only modalities the world draws (weight > 0) are evaluated; captions are not scored."""
    weights = world.cfg.weights
    out: dict[str, list[WorldItem]] = {m: [] for m in MEDIA if weights.get(m, 0) > 0}
    i = 0
    while any(len(v) < per_modality for v in out.values()):
        s = world.spec(i)
        if s["qtype"] != "caption" and s["modality"] in out and len(out[s["modality"]]) < per_modality:
            out[s["modality"]].append(world.item(i))
        i += 1
        if i > 100 * per_modality + 1000:
            raise ConfigError("world.weights leave too few held-out samples to evaluate; raise them or lower eval.items")
    return out


def hits(items: Sequence[WorldItem], answers: Sequence[str | None]) -> list[bool]:
    """Exact match of each decoded answer (stripped) with the expected text; None (skipped) is a miss."""
    return [a is not None and a.strip() == it.answer for a, it in zip(answers, items)]


class Scores:
    """Accuracy per modality, and hits and a few examples per question type, accumulated over `add` calls."""

    def __init__(self, examples: dict[str, list[dict]] | None = None):
        self.accuracy: dict[str, float] = {}
        self.per_question: dict[str, list[bool]] = {}
        self.examples = {} if examples is None else examples

    def add(self, modality: str, items: Sequence[WorldItem], answers: Sequence[str | None]) -> None:
        h = hits(items, answers)
        self.accuracy[f"{modality}_accuracy"] = float(np.mean(h)) if h else 0.0
        for it, a, ok in zip(items, answers, h):
            self.per_question.setdefault(it.qtype, []).append(ok)
            kept = self.examples.setdefault(it.qtype, [])
            if len(kept) < EXAMPLES_PER_QUESTION:
                kept.append({"expected": it.answer, "decoded": a})

    def question_accuracy(self) -> dict[str, float]:
        """Accuracy per question type (sorted, 3 decimals)."""
        return {q: round(float(np.mean(v)), 3) for q, v in sorted(self.per_question.items())}


def chances(modalities: Sequence[str]) -> dict[str, float]:
    """Uniform guessing's accuracy per modality, keyed like the accuracies (`image_accuracy`, ...)."""
    return {f"{m}_accuracy": round(float(chance(m)), 4) for m in modalities}


def accuracy_table(metrics: dict[str, float], chance_of: dict[str, float], zeroed: dict[str, float],
                   modalities: Sequence[str]) -> str:
    """The per-modality accuracy / chance / zeroed-encoders table a run prints at its end."""
    lines = [f"{'modality':<8} {'accuracy':>9} {'chance':>7} {'zeroed encoders':>15}"]
    for m in modalities:
        k = f"{m}_accuracy"
        z = zeroed.get(k)
        lines.append(f"{m:<8} {metrics[k]:>9.3f} {chance_of[k]:>7.3f}" + (f" {z:>15.3f}" if z is not None else ""))
    return "\n".join(lines)
