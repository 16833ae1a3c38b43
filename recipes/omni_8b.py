"""An 8B LLM with ~0.5B of vision and audio encoders on 64 GPUs (recipes/configs/omni_8b.yaml)."""
DESCRIPTION = "8B LLM + vision/audio encoders on 64 GPUs (pp2xfsdp8xtp4, encoders edp16xesp4); `dryrun omni_8b` checks it on CPU"


def main(argv: list[str]) -> int:
    from recipes._gpu import launch_gpu_recipe

    return launch_gpu_recipe("omni_8b", argv, devices=64)
