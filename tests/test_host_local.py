"""Host work O(local): on a fake multi-host layout (no devices: the plan is global metadata, the arrays are
one host's), the token rows a host builds for process p are exactly the rows of the whole step that p's
devices hold, the step's geometry is the same on every host, the plan made from a host's batch equals
the plan made from the whole step, and a host's arrays do not grow with the number of hosts."""
import numpy as np
import pytest

from omnijax.data.loader import Loader, LoaderConfig
from omnijax.data.payload import LazyRows, Runs
from omnijax.data.sources import SourceSpec
from omnijax.parallel import hosts, routing
from omnijax.parallel.context import balanced_order
from omnijax.parallel.device_grid import MESH_AXES
from omnijax.parallel.multiplex import microbatch_views

LLM = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
ROWS = 2            # LLM rows per batch shard (one data-plane rank)
PER_HOST = 4        # devices per host


def config(shards: int) -> LoaderConfig:
    """A step of `shards` ranks of ROWS rows; samples and encoder rows in proportion (fixed per-host work)."""
    return LoaderConfig(sources=[SourceSpec(name="world", kind="world")], samples_per_step=8 * shards, dp=shards,
                        window=2, row_len=128, max_rows=ROWS, fixed_shapes=True,
                        encoder_rows={"vision": 256 * shards, "audio": 128 * shards}, seed=5)


def layout(hosts_: int) -> tuple[routing.DeviceGrid, np.ndarray]:
    """pp2 x fsdp(hosts) x tp2 devices, hosts of PER_HOST consecutive devices in mesh order (pp outermost):
    every host holds 2 batch shards (replicated over tp inside it); the two pp stages of a shard sit on
    different hosts, which build the same rows."""
    grid = routing.DeviceGrid((2, 1, hosts_, 1, 1, 2))
    return grid, (np.arange(grid.num_devices) // PER_HOST).reshape(grid.sizes)


def host_loader(cfg: LoaderConfig, owner: np.ndarray, process: int) -> tuple[Loader, np.ndarray]:
    rows = hosts.host_rows(owner, MESH_AXES, ("dp", "fsdp", "ep"), cfg.dp * ROWS, process)
    return Loader(cfg, lazy_media=True, text_ranks=sorted({int(r) // ROWS for r in rows})), rows


@pytest.fixture(scope="module")
def fake4():
    grid, owner = layout(4)           # 16 devices, 4 hosts; 4 shards over fsdp (2 per host)
    cfg = config(grid.batch_shards)
    whole = Loader(cfg)               # every row, every payload decoded: the reference
    return grid, owner, cfg, [whole.host_batch(s)["microbatches"][0] for s in range(2)]


def test_a_host_builds_exactly_its_rows_of_the_step(fake4):
    grid, owner, cfg, whole = fake4
    B = cfg.dp * ROWS
    for p in (0, 1, 3):
        loader, own = host_loader(cfg, owner, p)
        for s, ref in enumerate(whole):
            mine = loader.host_batch(s)["microbatches"][0]
            assert np.array_equal(mine["rows"], own) and len(own) == 2 * ROWS and own.max() < B
            for k in LLM:
                assert mine[k].shape == (len(own), cfg.row_len), k
                assert np.array_equal(mine[k], np.asarray(ref[k])[own]), (p, s, k)
            assert mine["loss_mask"].any()
            seg = np.asarray(ref["segment_ids"])  # every row's documents, tokens and sum n^2, from metadata
            n_of = [np.bincount(r[r > 0])[1:].astype(np.int64) for r in seg]
            assert np.array_equal(mine["row_docs"], [[len(n), n.sum(), (n * n).sum()] for n in n_of])
            for name in ("vision", "audio"):  # the step's encoder geometry: the same on every host
                assert isinstance(mine[f"{name}_segment_ids"], Runs) and isinstance(mine[f"{name}_inputs"], LazyRows)
                for key in ("segment_ids", "positions", "dest"):
                    assert np.array_equal(np.asarray(mine[f"{name}_{key}"]), ref[f"{name}_{key}"]), (p, s, name, key)
                assert mine[f"{name}_inputs"].decoded_bytes == 0  # nothing decoded before the plan slices it


def test_the_plan_from_a_hosts_rows_equals_the_plan_from_the_whole_step(fake4):
    """The routing plan (placement, capacities, statistics, this host's buffers and tables) and the pipeline's
    microbatch views made from a host's own rows are those of the whole step."""
    grid, owner, cfg, whole = fake4
    ref = whole[0]
    loader, own = host_loader(cfg, owner, 2)
    mine = loader.host_batch(0)["microbatches"][0]
    plan_grid = routing.DeviceGrid((2, 1, 4, 1, 1, 2), esp=2)
    red = {"vision": 4, "audio": 4}
    dims = {n: ref[f"{n}_inputs"].shape[1] for n in red}
    cost = lambda name, rows: float(rows)  # noqa: E731
    devices = [d for d in range(plan_grid.num_devices) if owner.reshape(-1)[d] == 2]
    full = routing.build_plan(ref, plan_grid, red, dims, cost, order=balanced_order)
    part = routing.build_plan(mine, plan_grid, red, dims, cost, order=balanced_order, fill_devices=devices)
    assert part.stats == full.stats and part.capacities == full.capacities
    for k, v in full.arrays.items():
        assert np.array_equal(part.arrays[k], v[devices]), k
    for m, (a, b) in enumerate(zip(microbatch_views(ref, 2, tuple(red)), microbatch_views(mine, 2, tuple(red)))):
        for k in LLM:
            assert np.array_equal(b[k], a[k][b["rows"]]), (m, k)
        for name in red:
            for key in ("segment_ids", "dest"):
                assert np.array_equal(np.asarray(b[f"{name}_{key}"]), a[f"{name}_{key}"]), (m, name, key)
    assert routing.shard_cost_max_over_mean(mine, 8, (1.0, 0.01)) == routing.shard_cost_max_over_mean(ref, 8, (1.0, 0.01))


def _nbytes(batch: dict, keys) -> int:
    return sum(np.asarray(batch[k]).nbytes for k in keys)


def test_host_arrays_do_not_grow_with_the_hosts():
    """At a fixed per-host batch (2 shards of 2 rows per host), process 0's token arrays have the same
    bytes on 2, 4 and 8 hosts; the step's own metadata that a host keeps (`row_docs`, the encoder runs)
    is a few integers per global row and per segment (under 1/10 of the step's token rows at 128 tokens a
    row; 32x less at the recipes' 4,096). A host that
    lays the whole step out (every rank built) grows with the hosts: the check can fail."""
    sizes, whole_sizes = [], []
    for n_hosts in (2, 4, 8):
        grid, owner = layout(n_hosts)
        cfg = config(grid.batch_shards)
        loader, own = host_loader(cfg, owner, 0)
        batch = loader.host_batch(0)["microbatches"][0]
        sizes.append(_nbytes(batch, LLM + ("rows",)))
        step_rows_bytes = cfg.dp * ROWS * cfg.row_len * 4 * len(LLM)
        runs = [batch[f"{n}_{k}"] for n in ("vision", "audio") for k in ("segment_ids", "dest")]
        meta = batch["row_docs"].nbytes + sum(r.starts.nbytes + r.lengths.nbytes + r.values.nbytes for r in runs)
        assert meta < step_rows_bytes / 10, (n_hosts, meta)
        everything = Loader(cfg, lazy_media=True).host_batch(0)["microbatches"][0]
        whole_sizes.append(_nbytes(everything, LLM))
    assert sizes[0] == sizes[1] == sizes[2] == 2 * ROWS * (128 * 4 * len(LLM) + 8)
    assert whole_sizes == [h * ROWS * 128 * 4 * len(LLM) for h in (2, 4, 8)]
