"""GPU recipes that cannot run here are validated on the CPU: config, meshes, shardings, per-device
memory of the training state and the abstract shapes of one step."""
import pytest

from omnijax.config import build
from omnijax.errors import ConfigError
from omnijax.train.dryrun import dry_run
from recipes.common import CONFIGS
from omnijax.train.multimodal import MultimodalConfig as OmniConfig, check


def _cfg(name, *overrides):
    return build(OmniConfig, CONFIGS / f"{name}.yaml", list(overrides), check=check)


def test_omni_8b_on_64_gpus():
    report = dry_run(_cfg("omni_8b"), 64)
    p = report["params"]
    assert 7.5e9 < p["llm"] < 8.5e9, p          # Llama-3-8B shape
    assert 0.35e9 < p["encoders"] < 0.6e9, p    # ~0.4B vision + ~0.09B audio
    assert report["state_gib_per_device"] < 8   # 16 B/param over pp2 x fsdp8 x tp4
    assert report["esp_axes"] == ["tp"] and report["llm_layout"] == "pp2xfsdp8xtp4"


def test_omni_moe_on_64_gpus():
    report = dry_run(_cfg("omni_moe"), 64)
    assert 7e9 < report["params"]["llm"] < 8e9 and report["llm_layout"] == "fsdp16xep4"
    # the encoders' SP groups are the ep groups inside a host (esp4 divides the audio encoder's 12 heads)
    assert report["encoder_layout"] == "edp16xesp4" and report["esp_axes"] == ["ep"]
    assert report["state_gib_per_device"] < 80


def test_a_layout_that_does_not_fit_the_gpus_is_named():
    with pytest.raises(ConfigError, match="64"):
        dry_run(_cfg("omni_8b", "parallel.llm=pp2xfsdp4xtp4"), 64)
    with pytest.raises(ConfigError, match="esp"):
        dry_run(_cfg("omni_8b", "parallel.encoder=edp8xesp8"), 64)
