"""Host work ahead of the step: consumed vs prefetched loader position, errors surface in the consumer."""
import time

import pytest

from omnijax.train.prefetch import Prefetcher


class Counting:
    def __init__(self, fail_at: int = -1):
        self.i, self.fail_at = 0, fail_at

    def __next__(self):
        if self.i == self.fail_at:
            raise ValueError(f"bad batch {self.i}")
        self.i += 1
        return {"i": self.i}

    def get_state(self):
        return {"i": self.i}


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_carry_the_consumed_position(depth):
    loader = Counting()
    pre = Prefetcher(loader, lambda b: b["i"] * 10, depth=depth)
    items = [next(pre) for _ in range(3)]
    if depth:
        deadline = time.time() + 5
        while loader.i < 3 + depth and time.time() < deadline:  # the thread runs ahead ...
            time.sleep(0.01)
        time.sleep(0.05)
        assert 3 + depth <= loader.i <= 3 + depth + 1  # depth queued, one more in hand at most
    assert [it.loader_state for it in items] == [{"i": 1}, {"i": 2}, {"i": 3}]   # ... the items do not
    assert [it.batch for it in items] == [10, 20, 30]
    pre.close()


def test_loader_errors_reach_the_consumer_in_order():
    pre = Prefetcher(Counting(fail_at=2), lambda b: b, depth=2)
    assert next(pre).host_batch == {"i": 1} and next(pre).host_batch == {"i": 2}
    with pytest.raises(ValueError, match="bad batch 2"):
        next(pre)
