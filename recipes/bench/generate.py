"""Generation speed: omnijax's KV-cache generator vs transformers (PyTorch, CPU) on the same tiny random Llama
and the same prompts, and the per-token decode cost against the prompt length (with a cache it grows linearly,
the attention reading the cache; a decoder without one pays a prefill of the prefix per token)."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

DESCRIPTION = ("generate: tokens/s of omnijax (KV cache, batched) vs transformers on CPU, same tiny Llama and "
               "prompts; per-token decode cost by prompt length")


@dataclass
class GenerateBench:
    batch: int = 8
    prompt_len: int = 64
    new_tokens: int = 64
    lengths: list[int] = field(default_factory=lambda: [32, 256, 1024])   # per-token cost: prompt lengths
    cost_new_tokens: int = 32
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    repeats: int = 3
    seed: int = 0
    torch_device: str = "cpu"          # where transformers runs (cpu, the comparison; cuda on a GPU machine)
    # torch.set_num_threads (0: torch's default). 1 by default: on a busy shared CPU torch's thread pool spins
    # (measured here under load 30 on 2 cores: 6.5-8 ms/token with 1 thread, 80-100 ms/token with 2)
    torch_threads: int = 1


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(overrides: list[str]) -> Iterator[dict]:
    from omnijax.config import build
    from omnijax.errors import ConfigError

    cfg = build(GenerateBench, None, overrides, check=None)
    if min([cfg.batch, cfg.prompt_len, cfg.new_tokens, cfg.cost_new_tokens, cfg.repeats, *cfg.lengths]) <= 0 or \
            cfg.cost_new_tokens < 2 or cfg.heads % cfg.kv_heads:
        raise ConfigError("bench generate: sizes must be > 0, cost_new_tokens >= 2, heads a multiple of kv_heads")
    import jax
    import numpy as np
    import torch
    import transformers

    from omnijax.interop import pretrained
    from omnijax.serve.generate import Generator, SamplingConfig

    torch.manual_seed(cfg.seed)
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    longest = max(cfg.lengths + [cfg.prompt_len]) + max(cfg.new_tokens, cfg.cost_new_tokens)
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 3,
                                      num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                      num_key_value_heads=cfg.kv_heads, max_position_embeddings=longest,
                                      tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        model = pretrained.load_llm(tmp)
    ref = ref.to(cfg.torch_device)
    gen = Generator(model)
    rng = np.random.default_rng(cfg.seed)
    common = {"device": jax.devices()[0].device_kind, "torch_device": cfg.torch_device,
              "torch_threads": torch.get_num_threads(),
              "model": f"llama {cfg.layers}x{cfg.hidden} vocab {cfg.vocab}", "cpu_count": os.cpu_count()}

    def ours(prompts, n):
        return gen.generate(prompts, SamplingConfig(max_new_tokens=n), batch_size=len(prompts))

    def theirs(prompts, n):
        with torch.no_grad():
            out = ref.generate(torch.tensor(np.array(prompts), device=cfg.torch_device), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        if cfg.torch_device.startswith("cuda"):
            torch.cuda.synchronize()
        return out[:, len(prompts[0]):].tolist()

    prompts = rng.integers(0, cfg.vocab, (cfg.batch, cfg.prompt_len)).tolist()
    mine = [g.tokens for g in ours(prompts, cfg.new_tokens)]      # also compiles
    same = mine == theirs(prompts, cfg.new_tokens)
    total = cfg.batch * cfg.new_tokens
    t_ours = _median_s(lambda: ours(prompts, cfg.new_tokens), cfg.repeats)
    t_theirs = _median_s(lambda: theirs(prompts, cfg.new_tokens), cfg.repeats)
    shape = {"batch": cfg.batch, "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens}
    yield {"variant": "transformers", **shape, "tokens_per_s": round(total / t_theirs, 1),
           "seconds": round(t_theirs, 4), **common}
    yield {"variant": "omnijax", **shape, "tokens_per_s": round(total / t_ours, 1), "seconds": round(t_ours, 4),
           "vs": "transformers", "speedup": round(t_theirs / t_ours, 2), "greedy_tokens_equal": same, **common}
    # decode cost per token by prompt length, prefill excluded: omnijax's decode loop (timed inside the
    # generator) and transformers' forward with its past_key_values, one token at a time, one prompt
    n = cfg.cost_new_tokens

    def ours_decode(p):
        ours(p, n)
        t = gen.last_timing
        return t["decode_s"] / max(1, t["decode_steps"]), t["prefill_s"]

    def theirs_decode(p):
        with torch.no_grad():
            ids = torch.tensor(np.array(p), device=cfg.torch_device)
            t0 = time.perf_counter()
            out = ref(ids, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            past = out.past_key_values
            for _ in range(n - 1):
                out = ref(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tok.tolist()
            return (time.perf_counter() - t1) / (n - 1), t1 - t0

    for length in cfg.lengths:
        p = rng.integers(0, cfg.vocab, (1, length)).tolist()
        for name, fn in (("omnijax", ours_decode), ("transformers", theirs_decode)):
            fn(p)  # warm (compiles omnijax's programs for this length)
            runs = sorted(fn(p) for _ in range(cfg.repeats))
            per_token, prefill = runs[len(runs) // 2]
            yield {"variant": f"per_token_cost_{name}", "prompt_len": length, "new_tokens": n, "batch": 1,
                   "ms_per_token": round(1e3 * per_token, 3), "prefill_ms": round(1e3 * prefill, 2), **common}
