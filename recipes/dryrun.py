"""Validate a multimodal recipe on the CPU for the accelerator count it is laid out for."""
from __future__ import annotations

import json

DESCRIPTION = ("check a recipe's config, meshes, shardings, per-device memory (state + LLM activations at parallel.remat) "
               "and step shapes without running it: dryrun NAME [devices=N]")


def main(argv: list[str]) -> int:
    from omnijax.errors import UserError

    if not argv or "=" in argv[0]:
        raise UserError("usage: python -m recipes dryrun NAME [devices=64] [key=value ...], e.g. dryrun omni_8b")
    name, rest = argv[0], argv[1:]
    devices = 64
    overrides = []
    for item in rest:
        key, _, value = item.partition("=")
        if key == "devices":
            devices = int(value)
        else:
            overrides.append(item)
    from omnijax.train.dryrun import dry_run
    from recipes.tiny_omni import load, training_capacity

    cfg = load(overrides, name)
    training_capacity(cfg)  # capacity.* left out: sized from data.sources' metadata, as training does
    print(json.dumps(dry_run(cfg, devices), indent=2))
    return 0
