"""A MoE LLM (16 experts, top-2) with vision and audio encoders on 64 GPUs (recipes/configs/omni_moe.yaml)."""
DESCRIPTION = "MoE LLM (16 experts, top-2) + vision/audio encoders on 64 GPUs (fsdp16xep4, encoders edp16xesp4); `dryrun omni_moe` checks it on CPU"


def main(argv: list[str]) -> int:
    from recipes._gpu import launch_gpu_recipe

    return launch_gpu_recipe("omni_moe", argv, devices=64)
