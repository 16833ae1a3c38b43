"""Generate answers from a trained model: `python -m recipes generate DIR prompts=FILE output=OUT.jsonl`.

DIR is a run folder (runs/NAME: its latest checkpoint), an export folder (`recipes export`) or a Hugging Face
Llama/Qwen2 folder. FILE holds records in the formats `recipes convert` reads (`segments`, or LLaVA
`conversations` without the answer; media paths relative to FILE); conversations go through the tokenizer's
chat template with its generation prompt. OUT gets one JSON line per prompt, in order: `prompt_tokens` (the
ids fed to the LLM, placeholders included), `tokens` (generated ids, without the end-of-sequence id),
`text`, `finish_reason` (eos | length). An answer ends where transformers' generate ends it for that folder
(its `eos_token_id`; the tokenizer's eos for a run without a Hugging Face LLM folder; `eos_ids=[...]` to
choose). OUT is written whole and then renamed into place (an existing OUT is replaced). Options:
max_new_tokens, temperature (0 = greedy), top_p, seed, batch_size, eos_ids, parallel.llm (dp/fsdp/tp
layout, e.g. tp2), parallel.cpu_devices.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DESCRIPTION = "generate answers with a KV cache from a run / export / HF folder: generate DIR prompts=FILE output=OUT.jsonl"


@dataclass
class GenerateParallel:
    llm: str = ""            # dp/fsdp/tp layout string such as "tp2"; "" = one device
    cpu_devices: int = 0     # fake N CPU devices when no accelerator is present (0 = leave alone)


@dataclass
class GenerateConfig:
    prompts: str = ""
    output: str = ""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    eos_ids: list[int] = field(default_factory=list)   # [] = the folder's eos_token_id (else the tokenizer's eos)
    parallel: GenerateParallel = field(default_factory=GenerateParallel)


USAGE = "python -m recipes generate DIR prompts=FILE output=OUT.jsonl [max_new_tokens=N temperature=T top_p=P seed=S]"


def main(argv: list[str]) -> int:
    from omnijax.config import build
    from omnijax.errors import ConfigError
    from recipes.common import setup_devices

    folders = [a for a in argv if "=" not in a]
    if len(folders) != 1:
        raise ConfigError(f"generate takes one folder (a run, export or Hugging Face folder): {USAGE}")
    setup_devices(argv)
    cfg = build(GenerateConfig, None, [a for a in argv if "=" in a], check=None)
    if not cfg.prompts or not cfg.output:
        raise ConfigError(f"prompts= and output= are required: {USAGE}")
    if cfg.batch_size <= 0:
        raise ConfigError(f"batch_size={cfg.batch_size}: must be > 0")
    out_dir = Path(cfg.output).parent
    if not out_dir.is_dir():
        raise ConfigError(f"output={cfg.output}: folder {out_dir} does not exist")
    from omnijax.serve.generate import Generator, SamplingConfig
    from omnijax.serve.load import load, source_kind
    from omnijax.serve.prompts import read_prompts

    sampling = SamplingConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed).check()
    source_kind(folders[0])  # a wrong folder or prompts file is named before the model is read
    if not Path(cfg.prompts).is_file():
        raise ConfigError(f"prompts={cfg.prompts}: file not found; write one JSON record per line "
                          "({\"segments\": [...]} or a LLaVA conversation without the answer)")
    t0 = time.perf_counter()
    served = load(folders[0], layout=cfg.parallel.llm)  # straight into the layout's shardings
    prompts = read_prompts(cfg.prompts, served.tokenizer)
    tok = served.tokenizer
    gen = Generator(served.model, layout=cfg.parallel.llm, eos_ids=cfg.eos_ids or served.eos_ids, pad_id=tok.pad,
                    placeholder=dict(tok.placeholder))
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        results = gen.generate(prompts, sampling, batch_size=cfg.batch_size, progress=bar.update)
    tmp = f"{cfg.output}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        for r in results:
            f.write(json.dumps({"prompt_tokens": r.prompt_tokens, "tokens": r.tokens, "text": tok.decode(r.tokens),
                                "finish_reason": r.finish_reason}) + "\n")
    replaced = os.path.exists(cfg.output)
    os.replace(tmp, cfg.output)
    n_tok = sum(len(r.tokens) for r in results)
    print(f"generate: {len(results)} prompts, {n_tok} tokens from {served.source} folder {folders[0]} "
          f"({time.perf_counter() - t0:.1f} s) -> {cfg.output}{' (replaced)' if replaced else ''}", file=sys.stderr)
    return 0
