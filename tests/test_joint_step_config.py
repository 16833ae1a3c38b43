"""The joint multimodal step refuses what it cannot train, in one line, before anything compiles."""
import pytest

from omnijax.errors import ConfigError


def test_joint_step_refuses_grad_accum():
    """Its routing tables are per device and planned for the whole step: a microbatch split would cut them
    along devices, so grad_accum > 1 is an error, not a wrong step; plain DP on one process still takes it."""
    from omnijax.train import multimodal
    from recipes.tiny_omni import load

    with pytest.raises(ConfigError, match="trainer.grad_accum=2"):
        multimodal.placement(load(["parallel.llm=fsdp2xdp4", "trainer.grad_accum=2"]))
    assert multimodal.placement(load(["trainer.grad_accum=2"])) is None
