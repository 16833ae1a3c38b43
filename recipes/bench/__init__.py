"""Benchmarks: `python -m recipes bench NAME [key=value ...]` (see recipes/__main__.py)."""
