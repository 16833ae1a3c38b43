"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMNIJAX_RUNS", os.path.join(os.path.dirname(__file__), "..", "runs", "tests"))


import pathlib  # noqa: E402

import pytest  # noqa: E402

CLUSTER_FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "cluster"


@pytest.fixture(scope="module")
def synthetic_cluster_data():
    """Synthetic profiles and workloads in the Pollux format (tests/fixtures/cluster): no shared data needed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNIJAX_SHARED_DATA", str(CLUSTER_FIXTURES))
        yield CLUSTER_FIXTURES
