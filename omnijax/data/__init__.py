"""omnijax.data: the data plane.

tokenizer (byte ids + specials), sample (the unified Sample/SampleMeta), world (built-in procedural
multimodal data), stdlib_text (Python stdlib text source), media/records/sources (files, ArrayRecord
records + metadata sidecars, Parquet, JSONL), tokens/cost (per-sample token counts and a·n + b·n²
costs from metadata), mixing (stateless step-scheduled source mixing), balance (grouped
reordering plans), packing (fixed-capacity buffers), loader (everything on grain's dataset API).
features (encoder preprocessing) belongs to the encoders.
"""
