"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""
import os

# --xla_backend_optimization_level=0: compiling is ~80% of the suite's CPU time and this level cuts the whole
# suite's CPU by a fifth (user 22.9 -> 18.3 min, all tests passing). What the tests check (layouts equal to
# one device, exact resume, bitwise exports) holds at any level; programs run slower, which the tests'
# few steps do not feel. The multi-host tests' processes inherit it, and test_faults.py passes it on.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMNIJAX_RUNS", os.path.join(os.path.dirname(__file__), "..", "runs", "tests"))
# One persistent compilation cache for the run: both xdist workers and every process the tests start
# (multi-host pairs, launch restarts, recipe subprocesses) read what another already compiled. The
# size cap turns on jax's file lock, so concurrent writers never expose a half-written entry.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["OMNIJAX_RUNS"], "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))


import pathlib  # noqa: E402

import pytest  # noqa: E402

CLUSTER_FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "cluster"


@pytest.fixture(scope="module")
def synthetic_cluster_data():
    """Synthetic profiles and workloads in the Pollux format (tests/fixtures/cluster): no shared data needed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNIJAX_SHARED_DATA", str(CLUSTER_FIXTURES))
        yield CLUSTER_FIXTURES


def pytest_collection_modifyitems(items):
    """The slow tests first (stable otherwise): xdist hands out work in collection order, so a long test
    collected last keeps one worker busy after the other has finished everything else."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
