"""Runnable recipes: `python -m recipes NAME [key=value ...]`.

A recipe is a module `recipes/<name>.py` with a one-line `DESCRIPTION` and `main(argv) -> int`.
A benchmark is a module `recipes/bench/<name>.py` with `DESCRIPTION` and
`run(overrides: list[str]) -> Iterable[dict]`, yielding one dict per variant measured.
"""
