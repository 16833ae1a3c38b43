"""Whisper folders (`WhisperModel` / `WhisperForConditionalGeneration`): the encoder's config, its
feature extractor's settings and its tensor names (the decoder is not read)."""
from __future__ import annotations

from typing import Iterator

from omnijax.errors import UserError
from omnijax.mm_config import WhisperConfig


def config_from_hf(hf: dict, pre: dict | None = None) -> WhisperConfig:
    """WhisperConfig of a Whisper config.json and preprocessor_config.json (WhisperFeatureExtractor)."""
    pre = pre or {}
    try:
        d, heads = int(hf["d_model"]), int(hf["encoder_attention_heads"])
        layers, ffn, mels = int(hf["encoder_layers"]), int(hf["encoder_ffn_dim"]), int(hf["num_mel_bins"])
    except KeyError as exc:
        raise UserError(f"Whisper config.json: missing required field {exc.args[0]!r}") from None
    act = hf.get("activation_function", "gelu")
    if act not in ("gelu", "gelu_new", "relu"):
        raise UserError(f"Whisper config.json: activation_function {act!r} is not supported (gelu, gelu_new, relu)")
    if int(pre.get("feature_size", mels)) != mels:
        raise UserError(f"Whisper preprocessor_config.json: feature_size={pre['feature_size']} but the encoder "
                        f"takes num_mel_bins={mels}")
    rate = int(pre.get("sampling_rate", 16000))
    if rate != 16000:
        raise UserError(f"Whisper preprocessor_config.json: sampling_rate={rate}; omnijax decodes audio at 16000 Hz")
    return WhisperConfig(n_mels=mels, n_fft=int(pre.get("n_fft", 400)), hop=int(pre.get("hop_length", 160)),
                         sample_rate=rate, embed_dim=d, num_layers=layers, num_heads=heads, mlp_dim=ffn,
                         max_source_positions=int(hf.get("max_source_positions", 1500)), activation=act,
                         chunk_frames=int(pre.get("nb_max_frames", 3000)))


def config_to_hf(cfg: WhisperConfig) -> dict:
    """A config.json that describes this encoder (decoder fields are transformers' defaults scaled down)."""
    return {"architectures": ["WhisperModel"], "model_type": "whisper", "d_model": cfg.embed_dim,
            "encoder_layers": cfg.num_layers, "encoder_attention_heads": cfg.num_heads,
            "encoder_ffn_dim": cfg.mlp_dim, "num_mel_bins": cfg.n_mels,
            "max_source_positions": cfg.max_source_positions, "activation_function": cfg.activation,
            "decoder_layers": 1, "decoder_attention_heads": cfg.num_heads, "decoder_ffn_dim": cfg.mlp_dim,
            "scale_embedding": False, "dtype": "float32"}


def preprocessor_to_hf(cfg: WhisperConfig) -> dict:
    """The WhisperFeatureExtractor settings omnijax's features follow (omnijax/data/features.py)."""
    frames = cfg.chunk_frames
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": cfg.n_mels,
            "sampling_rate": cfg.sample_rate, "hop_length": cfg.hop, "n_fft": cfg.n_fft,
            "chunk_length": frames * cfg.hop // cfg.sample_rate, "n_samples": frames * cfg.hop,
            "nb_max_frames": frames, "padding_side": "right", "padding_value": 0.0,
            "return_attention_mask": False, "dither": 0.0, "processor_class": "WhisperProcessor"}


def weight_layout(model, prefix: str = "encoder.") -> Iterator[tuple]:
    """(HF name, omnijax variable, kind, HF shape or None) of every encoder weight (kinds of `omnijax.interop.layout`)."""
    d = model.out_dim
    yield prefix + "conv1.weight", model.conv1, "conv1d"
    yield prefix + "conv1.bias", model.conv1_bias, "same"
    yield prefix + "conv2.weight", model.conv2, "conv1d"
    yield prefix + "conv2.bias", model.conv2_bias, "same"
    yield prefix + "embed_positions.weight", model.pos_embed, "same"
    for i, blk in enumerate(model.blocks):
        pre = f"{prefix}layers.{i}."
        a = blk.attn
        yield pre + "self_attn.k_proj.weight", a.k, "linear_in"
        yield pre + "self_attn.v_proj.weight", a.v, "linear_in"
        yield pre + "self_attn.v_proj.bias", a.v_bias, "reshape", (d,)
        yield pre + "self_attn.q_proj.weight", a.q, "linear_in"
        yield pre + "self_attn.q_proj.bias", a.q_bias, "reshape", (d,)
        yield pre + "self_attn.out_proj.weight", a.o, "linear_out"
        yield pre + "self_attn.out_proj.bias", a.o_bias, "same"
        yield pre + "self_attn_layer_norm.weight", blk.ln1.scale, "same"
        yield pre + "self_attn_layer_norm.bias", blk.ln1.bias, "same"
        yield pre + "fc1.weight", blk.fc1.kernel, "linear_in"
        yield pre + "fc1.bias", blk.fc1.bias, "same"
        yield pre + "fc2.weight", blk.fc2.kernel, "linear_in"
        yield pre + "fc2.bias", blk.fc2.bias, "same"
        yield pre + "final_layer_norm.weight", blk.ln2.scale, "same"
        yield pre + "final_layer_norm.bias", blk.ln2.bias, "same"
    yield prefix + "layer_norm.weight", model.post_norm.scale, "same"
    yield prefix + "layer_norm.bias", model.post_norm.bias, "same"
