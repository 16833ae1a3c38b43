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
        # the thread runs ahead until its queue is full (a state, not a time: the deadline only guards a hang);
        # from then on it holds at most one more item in hand, blocked on the full queue
        deadline = time.monotonic() + 120
        while not pre._queue.full() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pre._queue.full()
        assert 3 + depth <= loader.i <= 3 + depth + 1
    assert [it.loader_state for it in items] == [{"i": 1}, {"i": 2}, {"i": 3}]   # ... the items do not
    assert [it.batch for it in items] == [10, 20, 30]
    pre.close()


class LazyCounting(Counting):
    """A loader whose state is costly to build: `lazy_state` captures the position, builds it when read."""

    def __init__(self):
        super().__init__()
        self.built = 0

    def lazy_state(self):
        from omnijax.data.loader import LoaderState

        i = self.i

        def make():
            self.built += 1
            return {"i": i}
        return LoaderState(make)


def test_a_lazy_state_is_built_only_for_the_position_a_checkpoint_reads():
    """The prefetcher takes the state after every batch; from a loader with `lazy_state` (the data plane:
    every planning group's deferred samples) only the one a checkpoint reads is serialized, exactly."""
    loader = LazyCounting()
    pre = Prefetcher(loader, lambda b: b["i"], depth=2)
    items = [next(pre) for _ in range(4)]
    pre.close()
    assert loader.built == 0
    assert dict(items[2].loader_state) == {"i": 3} and loader.built == 1
    assert items[2].loader_state == {"i": 3} and loader.built == 1   # built once, then kept
    assert [dict(it.loader_state) for it in items] == [{"i": 1}, {"i": 2}, {"i": 3}, {"i": 4}]


def test_loader_errors_reach_the_consumer_in_order():
    pre = Prefetcher(Counting(fail_at=2), lambda b: b, depth=2)
    assert next(pre).host_batch == {"i": 1} and next(pre).host_batch == {"i": 2}
    with pytest.raises(ValueError, match="bad batch 2"):
        next(pre)


def test_host_work_runs_on_its_own_cores_and_the_step_keeps_the_rest():
    import os
    import threading

    from omnijax.train.prefetch import pinned, split_cores

    assert split_cores(0) is None and split_cores(len(os.sched_getaffinity(0))) is None  # the step keeps a core
    split = split_cores(1)
    if split is None:  # a one-core machine: nothing to split, and the prefetcher must still run unpinned
        split = (set(os.sched_getaffinity(0)),) * 2
    step_cores, host_cores = split
    assert step_cores.isdisjoint(host_cores) or len(os.sched_getaffinity(0)) == 1
    seen = []

    def place(b):  # runs in the prefetch thread: where host work runs, and where threads it starts run
        child = []
        t = threading.Thread(target=lambda: child.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        seen.append((os.sched_getaffinity(0), child[0]))
        return b

    before = os.sched_getaffinity(0)
    with pinned(step_cores):
        pre = Prefetcher(Counting(), place, depth=1, cpus=host_cores)
        next(pre)
        pre.close()
        assert os.sched_getaffinity(0) == step_cores  # the consumer (the step's thread) stays where it was put
    assert seen[0] == (host_cores, host_cores)
    assert os.sched_getaffinity(0) == before


def test_cores_the_process_cannot_use_are_a_config_error():
    import os

    from omnijax.errors import ConfigError

    with pytest.raises(ConfigError, match="this machine's cores are"):
        Prefetcher(Counting(), lambda b: b, depth=1, cpus={os.cpu_count() + 3})
