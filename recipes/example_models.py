"""example_models: tiny random Hugging Face folders (Llama LLM + tokenizer, SigLIP vision tower, Whisper model), saved
by transformers exactly as `save_pretrained` writes downloaded ones: the input of README "Fine-tune a pretrained
model" on a machine that cannot download real checkpoints.

`python -m recipes example_models output=DIR tokenizer=mydata/tokenizer` writes DIR/llm, DIR/vision, DIR/audio.
`... model=qwen2_5_vl` writes DIR as one tiny `Qwen2_5_VLForConditionalGeneration` folder instead (window-attention
vision tower, M-RoPE LLM, `preprocessor_config.json`, the tokenizer with Qwen's chat markers and template): the
input of README "Fine-tune Qwen2.5-VL" (`finetune init.model=DIR`).
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


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
# the chat template released Qwen2-VL/Qwen2.5-VL folders carry: a string content as written, a list content's
# image/video items as <|vision_start|><|image_pad|><|vision_end|> (transformers' processor then repeats the pad)
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


@dataclass
class ExampleModelsConfig:
    model: str = "parts"       # parts: llm/ + vision/ + audio/ (LLaVA-style); qwen2_5_vl: one Qwen2.5-VL folder
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

    if cfg.model == "qwen2_5_vl":
        return _qwen2_5_vl(cfg, out, tok_dir)
    if cfg.model != "parts":
        raise ConfigError(f"model={cfg.model!r}: parts (LLM + SigLIP + Whisper folders) or qwen2_5_vl")
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


def _qwen2_5_vl(cfg: ExampleModelsConfig, out: Path, tok_dir: Path) -> int:
    """One tiny random Qwen2.5-VL folder: the tokenizer of `tok_dir` with Qwen's special tokens added, a vision
    tower of 14 px patches (window attention in its first layers, full attention in its last), the LLM with
    M-RoPE, and the image processor's preprocessor_config.json (small min/max pixels: few patches per image)."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
    vocab = cfg.llm_vocab or tok.get_vocab_size(with_added_tokens=True)
    torch.manual_seed(cfg.seed)
    heads = max(1, cfg.llm_width // 16)
    eh = 2  # two vision heads: an esp pair (parallel.encoder=edpNxesp2) splits them
    text = dict(vocab_size=vocab, hidden_size=cfg.llm_width, intermediate_size=cfg.llm_width * 5 // 2,
                num_hidden_layers=cfg.llm_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": _mrope_section(cfg.llm_width // heads)})
    vision = dict(depth=cfg.encoder_layers, hidden_size=cfg.encoder_width, intermediate_size=2 * cfg.encoder_width,
                  num_heads=eh, patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                  out_hidden_size=cfg.llm_width, fullatt_block_indexes=[cfg.encoder_layers - 1], tokens_per_second=2)
    qcfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                            pad_token_id=ids["<|endoftext|>"])
    model = Qwen2_5_VLForConditionalGeneration(qcfg)
    with torch.no_grad():  # HF's default init is tiny; wider weights make every later comparison meaningful
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN_TEMPLATE,
        "model_max_length": 2048}, indent=2))
    # the processor's copy, as released folders carry it (transformers' AutoProcessor reads this one)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_TEMPLATE}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 56 * 56, "max_pixels": 112 * 112,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}, indent=2))
    print(json.dumps({"output": str(out), "model": "qwen2_5_vl", "vocab": vocab,
                      "params": sum(p.numel() for p in model.parameters())}))
    print(f"wrote {out} (Qwen2.5-VL + tokenizer and chat template); fine-tune it with "
          f"`python -m recipes finetune init.model={out} data.sources=[SHARDS]`", file=sys.stderr)
    return 0


def _mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) runs of the rotary pairs in Qwen2.5-VL's proportions (16/24/24 of 64 pairs)."""
    pairs = head_dim // 2
    t = max(1, pairs // 4)
    h = (pairs - t) // 2
    return [t, h, pairs - t - h]
