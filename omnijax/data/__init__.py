"""omnijax.data: the data plane.

tokenizer (byte ids + specials), sample (the unified Sample/SampleMeta), world (built-in procedural
multimodal data), stdlib_text (Python stdlib text source), media/records/sources (files, ArrayRecord
records + metadata sidecars, Parquet, JSONL), tokens/cost (per-sample token counts and a·n + b·n²
costs from metadata), mixing (stateless step-scheduled source mixing), bins (items, capacities, plans),
balance (grouped reordering plans), leveling (a window's encoder rows evened out over its steps),
packing (fixed-capacity buffers), loader (everything on grain's dataset API).
features (encoder preprocessing) belongs to the encoders.
"""
