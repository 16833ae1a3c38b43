"""Launching the multimodal recipes laid out for many accelerators (omni_8b, omni_moe): beside `common`, which
`tiny_omni` imports, so that no two recipe modules import each other."""
from __future__ import annotations


def launch_gpu_recipe(name: str, argv: list[str], devices: int) -> int:
    """Run a multimodal recipe sized for `devices` accelerators: its XLA GPU flag preset is set before
    jax starts, and a machine without enough accelerators gets a clear error (with the dry run to use)."""
    from omnijax.errors import UserError
    from omnijax.parallel import xla_flags
    from recipes import tiny_omni

    cfg = tiny_omni.load(argv, name)
    xla_flags.apply_env(xla_flags.for_recipe(name, cfg.parallel.llm))
    import jax

    from omnijax.train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()
    have = jax.device_count()
    if jax.default_backend() == "cpu" or have != devices:
        raise UserError(f"{name} is laid out for {devices} accelerators (parallel.llm={cfg.parallel.llm}), this job "
                        f"sees {have} {jax.default_backend()} device(s); validate it here with "
                        f"`python -m recipes dryrun {name}`, or change parallel.llm/parallel.encoder")
    return tiny_omni.main(argv, name)
