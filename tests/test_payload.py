"""The decentralized data path on one host: a step laid out from metadata equals the decoded one, a host
reads only its rows' text, and a media segment is decoded only when the plan slices it for a local device."""
import numpy as np
import pytest

from omnijax.data.loader import Loader, LoaderConfig
from omnijax.data.payload import LazyRows, Payload, payload_bytes
from omnijax.data.sources import SourceSpec
from omnijax.parallel import routing
from omnijax.parallel.context import balanced_order

CFG = LoaderConfig(sources=[SourceSpec(name="world", kind="world")], samples_per_step=32, dp=8, microbatches=1,
                   window=2, row_len=128, max_rows=2, fixed_shapes=True,
                   max_encoder_rows={"vision": 512, "audio": 256}, seed=3)


@pytest.fixture(scope="module")
def steps():
    eager, lazy, part = Loader(CFG), Loader(CFG, lazy_media=True), Loader(CFG, lazy_media=True, text_ranks=[2, 5])
    return [tuple(ld.host_batch(s)["microbatches"][0] for ld in (eager, lazy, part)) for s in range(3)]


def test_layout_from_metadata_equals_the_decoded_step(steps):
    own = np.r_[4:6, 10:12]  # the rows of ranks 2 and 5 (2 rows each)
    for eager, lazy, part in steps:
        assert payload_bytes(part) == (0, payload_bytes(lazy)[1])  # nothing decoded before a slice asks
        assert np.array_equal(part["rows"], own) and np.array_equal(lazy["rows"], np.arange(16))
        seg = eager["segment_ids"]  # the step's rows from metadata, on every host: documents, tokens, sum n^2
        docs = [np.bincount(r[r > 0])[1:] for r in seg]
        assert np.array_equal(part["row_docs"], [[len(n), n.sum(), (n.astype(np.int64) ** 2).sum()] for n in docs])
        for k, v in eager.items():
            assert np.array_equal(np.asarray(lazy[k]), v), k  # np.asarray decodes everything
            if k.endswith("_inputs"):
                assert isinstance(part[k], LazyRows) and part[k].shape == v.shape
            elif k in ("tokens", "targets", "loss_mask", "segment_ids", "positions"):  # only its own rows built
                assert part[k].shape == (len(own), v.shape[1]) and np.array_equal(part[k], v[own]), k
            else:  # geometry: encoder segment ids, positions, destinations, identical on every host
                assert np.array_equal(np.asarray(part[k]), v), k


def test_a_slice_decodes_only_the_segments_it_touches():
    calls = []

    def seg(i, rows):
        return Payload(rows, 2, lambda: calls.append(i) or np.full((rows, 2), i, np.float32))

    buf = LazyRows(10, 2)
    buf.put(0, seg(1, 3))
    buf.put(4, seg(2, 4))  # row 3 and rows 8.. are padding
    assert np.array_equal(buf[3:5], [[0, 0], [2, 2]]) and calls == [2]
    assert buf.decoded_bytes == 4 * 2 * 4 and buf.total_bytes == 7 * 2 * 4
    assert np.array_equal(np.asarray(buf)[:3], np.ones((3, 2))) and calls == [2, 1]
    with pytest.raises(ValueError, match="increasing"):
        buf.put(5, seg(3, 1))


def test_bad_payload_becomes_zeros_and_is_counted():
    errors = []
    bad = Payload(2, 3, lambda: np.full((2, 3), np.nan, np.float32), "src[7] segment 1 (image)", errors.append)
    short = Payload(2, 3, lambda: np.ones((1, 3), np.float32), "src[8] segment 1 (image)", errors.append)
    assert not bad.get().any() and not short.get().any()
    assert errors == ["src[7] segment 1 (image)", "src[8] segment 1 (image)"]


def test_plan_builds_and_decodes_only_the_local_devices(steps):
    _, lazy, _ = steps[0]
    grid = routing.DeviceGrid((2, 2, 1, 1, 1, 2), esp=2)  # pp2 x dp2 x tp2, encoders edp4 x esp2
    red, dims = {"vision": 4, "audio": 4}, {n: lazy[f"{n}_inputs"].shape[1] for n in ("vision", "audio")}
    cost = lambda name, rows: float(rows)  # noqa: E731
    full = routing.build_plan({k: np.asarray(v) for k, v in lazy.items()}, grid, red, dims, cost,
                              order=balanced_order)
    fresh = Loader(CFG, lazy_media=True).host_batch(0)["microbatches"][0]
    local = [0, 1, 2, 3]
    mine = routing.build_plan(fresh, grid, red, dims, cost, order=balanced_order, fill_devices=local)
    assert mine.devices == tuple(local) and full.devices is None
    for k, v in full.arrays.items():  # this host's rows of the same plan: buffers, segment ids, routing tables
        assert np.array_equal(mine.arrays[k], v[local]), k
    assert mine.stats == full.stats and mine.capacities == full.capacities
    decoded, total = payload_bytes(fresh)
    assert 0 < decoded < total


def test_unreadable_text_keeps_the_layout_and_is_counted():
    """A record whose text cannot be read on the host that trains on it keeps its place (every host
    planned it), carries no loss, and is counted as a skipped record."""
    from omnijax.data.sample import BadSample
    from omnijax.data.sources import WorldSource

    class Unreadable(WorldSource):
        def text(self, index):
            raise BadSample(f"{self.name}[{index}]: truncated record")

    good = Loader(CFG, lazy_media=True).host_batch(0)["microbatches"][0]
    loader = Loader(CFG, lazy_media=True, sources=[Unreadable("world")])
    bad = loader.host_batch(0)["microbatches"][0]
    for k in ("segment_ids", "positions", "vision_dest", "audio_dest"):
        assert np.array_equal(bad[k], good[k]), k
    assert good["loss_mask"].any() and not bad["loss_mask"].any()
    assert loader.metrics()["skipped_bad_records"] == int((good["segment_ids"].max(axis=1)).sum())
