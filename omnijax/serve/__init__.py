"""Serving trained models: generation with a KV cache (prefill, decode), prompts from records."""
