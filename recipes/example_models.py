"""example_models: tiny random Hugging Face folders (Llama LLM + tokenizer, SigLIP vision tower, Whisper model), saved
by transformers exactly as `save_pretrained` writes downloaded ones: the input of README "Fine-tune a pretrained
model" on a machine that cannot download real checkpoints.

`python -m recipes example_models output=DIR tokenizer=mydata/tokenizer` writes DIR/llm, DIR/vision, DIR/audio.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from omnijax.config import build
from omnijax.errors import ConfigError, UserError

DESCRIPTION = "tiny random HF Llama (+ tokenizer), SigLIP and Whisper folders saved by transformers (finetune's input)"


@dataclass
class ExampleModelsConfig:
    output: str = ""           # folder for llm/, vision/, audio/ (must not exist)
    tokenizer: str = ""        # a tokenizer folder (tokenizer.json): copied into llm/, its size is the LLM's vocab
    llm_vocab: int = 0         # 0: the tokenizer's size
    llm_width: int = 64
    llm_layers: int = 2
    encoder_width: int = 48
    encoder_layers: int = 2
    image_size: int = 32       # SigLIP input side (patch 8)
    seed: int = 3


def main(argv: list[str]) -> int:
    cfg = build(ExampleModelsConfig, None, argv, check=None)
    if not cfg.output or not cfg.tokenizer:
        raise ConfigError("usage: python -m recipes example_models output=DIR tokenizer=TOKENIZER_DIR")
    out, tok_dir = Path(cfg.output), Path(cfg.tokenizer)
    if out.exists():
        raise ConfigError(f"output={out} exists; choose a new folder or remove it")
    if not (tok_dir / "tokenizer.json").is_file():
        raise ConfigError(f"tokenizer={tok_dir}: no tokenizer.json (e.g. `python -m recipes example_data` writes one)")
    try:
        import torch
        from tokenizers import Tokenizer
        from transformers import (LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel,
                                  WhisperConfig, WhisperFeatureExtractor, WhisperModel)
    except ImportError as exc:
        raise UserError(f"example_models needs torch and transformers ({exc}); pip install torch transformers") from None

    vocab = cfg.llm_vocab or Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    torch.manual_seed(cfg.seed)
    heads = max(1, cfg.llm_width // 16)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=cfg.llm_width, intermediate_size=cfg.llm_width * 5 // 2,
                                       num_hidden_layers=cfg.llm_layers, num_attention_heads=heads,
                                       num_key_value_heads=max(1, heads // 2), max_position_embeddings=512,
                                       rms_norm_eps=1e-5, tie_word_embeddings=False))
    with torch.no_grad():  # HF's default init is tiny; wider weights make every later comparison meaningful
        for p in llm.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    llm.save_pretrained(out / "llm")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / "llm" / name)
    eh = max(1, cfg.encoder_width // 16)
    vis = SiglipVisionConfig(image_size=cfg.image_size, patch_size=8, hidden_size=cfg.encoder_width,
                             intermediate_size=2 * cfg.encoder_width, num_hidden_layers=cfg.encoder_layers,
                             num_attention_heads=eh)
    SiglipVisionModel(vis).save_pretrained(out / "vision")
    (out / "vision" / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SiglipImageProcessor", "do_resize": True,
        "size": {"height": cfg.image_size, "width": cfg.image_size}, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, indent=2))
    aud = WhisperConfig(num_mel_bins=80, d_model=cfg.encoder_width, encoder_layers=cfg.encoder_layers,
                        encoder_attention_heads=eh, encoder_ffn_dim=2 * cfg.encoder_width, decoder_layers=1,
                        decoder_attention_heads=eh, decoder_ffn_dim=2 * cfg.encoder_width, max_source_positions=1500,
                        vocab_size=128, pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=2)
    WhisperModel(aud).save_pretrained(out / "audio")
    WhisperFeatureExtractor(feature_size=aud.num_mel_bins).save_pretrained(out / "audio")
    print(json.dumps({"output": str(out), "llm": str(out / "llm"), "vision": str(out / "vision"),
                      "audio": str(out / "audio"), "vocab": vocab,
                      "llm_params": sum(p.numel() for p in llm.parameters())}))
    print(f"wrote {out}/llm (Llama + tokenizer), {out}/vision (SigLIP), {out}/audio (Whisper)", file=sys.stderr)
    return 0
