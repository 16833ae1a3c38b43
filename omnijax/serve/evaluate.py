"""Greedy-decoded accuracy on the built-in world's held-out questions, as a trainer's `eval_fn`.

Decoding runs through the library generator (`serve/generate.py`) on the single-device model: a
parallel layout's parameters are gathered back to it first. Scoring is the world's
(`data/world_eval.py`). This sits in `serve` because it generates; the trainer only calls it.
"""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from omnijax.data import tokenizer
from omnijax.data.packing import SamplePacker
from omnijax.data.sample import Sample
from omnijax.data.world import WorldItem
from omnijax.data.world_eval import Scores
from omnijax.serve.generate import Generator, SamplingConfig


def eval_packer(mm_cfg: Any, batch_size: int, seq_len: int, train_batch_size: int,
                train_capacity: dict[str, int]) -> SamplePacker:
    """The packer that bounds decoding prompts: `batch_size` rows, the training encoder capacity scaled
    by how many training batches one decoding batch spans (so a prompt that trains also decodes)."""
    scale = -(-batch_size // train_batch_size)
    return SamplePacker(mm_cfg, batch_size, seq_len, {k: v * scale for k, v in train_capacity.items()})


class GreedyDecoder:
    """Greedy answers through the library generator: encoders and the LLM run once over each batch of
    prompts (prefill), then one token per step against the KV cache. A prompt that does not fit the
    packer (an encoder capacity, or seq_len with room for the answer) is skipped (None)."""

    def __init__(self, model: Any, packer: SamplePacker, max_new: int):
        self.packer, self.max_new = packer, max_new
        self.sampling = SamplingConfig(max_new_tokens=max_new)
        self.generator = Generator(model, eos_ids=(tokenizer.EOS,), pad_id=tokenizer.PAD)

    def answers(self, params: Any, prompts: list[Sample], zero_encoders: bool = False) -> list[str | None]:
        """Decoded answer text per prompt (None: the prompt does not fit and was skipped).

        zero_encoders=True replaces every encoder output by zeros (the ablation of eval.json)."""
        keep = []
        for k, prompt in enumerate(prompts):
            sizes = self.packer.sizes(prompt)
            if sizes is None:
                continue
            if sizes[0] + self.max_new > self.packer.L:
                self.packer._skip("eval_prompt_too_long")
                continue
            keep.append(k)
        out: list[str | None] = [None] * len(prompts)
        results = self.generator.generate([prompts[k] for k in keep], self.sampling, batch_size=self.packer.B,
                                          zero_encoders=zero_encoders, params=params)
        for k, r in zip(keep, results):
            out[k] = tokenizer.decode([i for i in r.tokens if i < 256])
        return out


def accuracy_by_modality(decoder: GreedyDecoder, params: Any, items: dict[str, list[WorldItem]],
                         zero_encoders: bool = False, examples: dict | None = None) -> tuple[dict, dict]:
    """Exact-match accuracy of the decoded answers per modality, and per question type (`examples`, if
    given, collects a few decoded answers per question type)."""
    scores = Scores(examples)
    for modality, its in items.items():
        scores.add(modality, its, decoder.answers(params, [it.prompt() for it in its], zero_encoders))
    return scores.accuracy, scores.question_accuracy()


class WorldAccuracy:
    """`eval_fn` for the trainer: params -> {modality}_accuracy on `items`, decoded greedily.

    `model` is the single-device model (abstract is fine); with a joint-step `placement`, the trained
    params (pipelined stacks included) are mapped back onto it before decoding. With `ablation_items`,
    the first that many items per modality are decoded again with every encoder output zeroed.
    `report()` holds what eval.json adds beside the metrics."""

    def __init__(self, model: Any, packer: SamplePacker, items: dict[str, list[WorldItem]], max_new: int,
                 ablation_items: int = 0, placement: Any = None):
        self.model, self.packer, self.items, self.max_new = model, packer, items, max_new
        self.ablation_items, self.placement = ablation_items, placement
        _, self._params, _ = nnx.split(model, nnx.Param, ...)
        self._decoder: GreedyDecoder | None = None  # built at the first evaluation, on the running devices
        self.examples: dict[str, list[dict]] = {}
        self.per_question: dict[str, float] = {}
        self.zeroed: dict[str, float] = {}

    def single_device(self, params: Any) -> Any:
        """The trained params in the single-device model's layout (unchanged without a placement)."""
        if self.placement is None:
            return params
        from omnijax.parallel.engine import unstack_params

        pure = nnx.to_pure_dict(params)
        if self.placement.engine.schedule is not None:
            pure["llm"] = unstack_params(params["llm"], self.placement.engine.schedule)
        nnx.replace_by_pure_dict(self._params, jax.device_get(pure))
        return self._params

    def __call__(self, params: Any) -> dict[str, float]:
        params = self.single_device(params)  # every process takes part in gathering the params
        if jax.process_index() != 0:  # decoding runs on device 0, which only process 0 holds
            return {}
        if self._decoder is None:
            self._decoder = GreedyDecoder(self.model, self.packer, self.max_new)
        acc, self.per_question = accuracy_by_modality(self._decoder, params, self.items, examples=self.examples)
        if self.ablation_items:  # the same questions with every encoder output zeroed
            few = {m: its[:self.ablation_items] for m, its in self.items.items()}
            self.zeroed, _ = accuracy_by_modality(self._decoder, params, few, zero_encoders=True)
        return acc

    def report(self) -> dict[str, Any]:
        """eval.json's per-question accuracy, zeroed-encoder accuracy, ablation size and example answers."""
        return {"per_question": self.per_question, "zeroed_encoders": self.zeroed,
                "ablation_items": self.ablation_items, "examples": self.examples}
