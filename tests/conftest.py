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
# (multi-host pairs, launch restarts, recipe subprocesses) read what another already compiled.
# No size cap (jax's default): with one, every write first lists the whole folder and reads each entry's
# access time (jax's LRU eviction, under a file lock), so a run of N entries spends ~N^2/2 file reads on
# it: test_lora.py alone (~760 entries) took 110.6 CPU-s with the 4 GiB cap and 83.3 without. Without the
# lock a reader can meet an entry another process is still writing: jax then warns that it could not read
# it and compiles instead (it never runs a partial program). `make clean` removes the folder.
# Process 1 of a multi-process test compiles its programs again: jax writes the cache from process 0
# only, and on CPU the key holds each process's topology (jax_share_binary_between_hosts waits for a key
# process 0 never writes); no public option changes either.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["OMNIJAX_RUNS"], "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pathlib  # noqa: E402

import pytest  # noqa: E402

CLUSTER_FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "cluster"


@pytest.fixture(scope="module")
def synthetic_cluster_data():
    """Synthetic profiles and workloads in the Pollux format (tests/fixtures/cluster): no shared data needed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNIJAX_SHARED_DATA", str(CLUSTER_FIXTURES))
        yield CLUSTER_FIXTURES


def _module_fixtures(item) -> bool:
    """Whether the test uses a module- (or wider-) scoped fixture defined in its own module."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "package", "session") and d.baseid == module for ds in defs for d in ds)


def _group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def pytest_itemcollected(item):
    """Tests that share a module-scoped fixture are one xdist group (their module's, unless they name one):
    pytest builds such a fixture once per worker that runs one of its tests, and again each time a worker
    comes back to the module, so spread over both workers a LoRA run or a set of HF folders was built two or
    more times."""
    if _group(item) is None and _module_fixtures(item):
        item.add_marker(pytest.mark.xdist_group(pathlib.Path(item.nodeid.split("::")[0]).stem))


def pytest_collection_modifyitems(config, items):
    """The slow tests first, a group with its slow member (stable otherwise): xdist hands out the groups
    first (most tests first), then single tests in collection order, so a long test collected last would
    keep one worker busy after the other has finished everything else.

    `--dist loadgroup` sends a group to one worker by the `@group` suffix xdist puts on each test's id, which
    pytest-xdist 3.8 writes to `item._nodeid`; pytest 9 keeps the id in `item._id` and never reads it, so
    every group was silently spread over both workers (one local Ray per worker, every fixture built twice).
    The suffix is written where this pytest reads it; where xdist's own write works, it is left alone."""
    if getattr(config.option, "loadgroup", False):
        for item in items:
            group = _group(item)
            if group is not None and not item.nodeid.endswith(f"@{group}") and hasattr(item, "_id"):
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(f"{item.nodeid}@{group}")
    slow = {_group(item) for item in items if item.get_closest_marker("slow") is not None} - {None}
    items.sort(key=lambda item: item.get_closest_marker("slow") is None and _group(item) not in slow)
