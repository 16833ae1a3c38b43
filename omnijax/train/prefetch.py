"""Host work off the critical path: read, decode, plan and transfer the next batches while the device steps.

A background thread pulls host batches from the loader and hands them to the placement (`put_batch`:
routing plan + device transfer), up to `depth` steps ahead. Each item carries the loader state as it was
right after its batch was read, so a checkpoint records the position the trainer has *consumed*, never
the prefetched one, and resume stays exact. A loader with `lazy_state` hands a position captured in O(1)
and serialized only when a checkpoint reads it (the data plane's state holds every planning group's
deferred samples: O(step) integers, not worth building for every batch).

With `reserve` (the multiplexer's), the batches of a data-plane window are read together and their
encoder capacities reserved from metadata before the first of them is placed: the window's steps share
one compiled program instead of compiling again whenever a later step outgrows the buffers.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from omnijax.errors import ConfigError


@dataclass
class Prepared:
    host_batch: dict          # what the loader produced (numpy)
    batch: Any                # what the step consumes (device arrays)
    loader_state: Mapping     # the loader's state after this batch: the position to checkpoint once it is consumed
                              # (a loader's `lazy_state`: serialized only when a checkpoint reads it)
    metrics: dict             # the placement's figures for this batch (plan imbalance, padding, ...)
    placement_state: dict = field(default_factory=dict)  # the placement's state once this batch was placed


class Prefetcher:
    """Iterator of `Prepared` items; depth 0 does the work inline (no thread)."""

    def __init__(self, loader: Any, put_batch: Callable[[dict], Any], depth: int = 2,
                 placement_metrics: Callable[[], dict] | None = None,
                 reserve: Callable[[list[dict]], Any] | None = None, window: int = 1, start: int = 0,
                 placement_state: Callable[[], dict] | None = None, cpus: set[int] | None = None):
        """`window`: steps planned together (the loader's window; groups align to step // window, also
        after resuming at `start` consumed steps); `reserve` sees each group's host batches first.
        `cpus`: the cores the prefetch thread (and every thread it starts, e.g. the loader's pools) may
        run on, so that host work does not take the cores the step's own threads run on (Linux)."""
        self.loader, self.put_batch, self.depth = loader, put_batch, int(depth)
        # the state after every batch: a loader's `lazy_state` (captured in O(1), serialized only if a
        # checkpoint reads it) where it has one, else its `get_state`
        self._state: Callable[[], Any] = getattr(loader, "lazy_state", None) or loader.get_state
        self.placement_metrics = placement_metrics or (lambda: {})
        self.placement_state = placement_state or (lambda: {})
        self.reserve, self.window, self._step = reserve, max(int(window), 1), int(start)
        self.cpus = set(cpus) if cpus else None
        if self.cpus and not (hasattr(os, "sched_setaffinity") and self.cpus <= set(range(os.cpu_count() or 1))):
            cores = f"0..{(os.cpu_count() or 1) - 1}" if hasattr(os, "sched_setaffinity") else "none (no pinning here)"
            raise ConfigError(f"prefetch cpus {sorted(self.cpus)}: this machine's cores are {cores}")
        self._ahead: deque[tuple[dict, dict]] = deque()  # (host batch, loader state after it) read, not yet placed
        self.wait_s = 0.0                      # time the consumer waited for the last item
        self._queue: queue.Queue = queue.Queue(maxsize=max(self.depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_group(self) -> None:
        for _ in range(self.window - self._step % self.window if self.reserve else 1):
            try:
                host_batch = next(self.loader)
            except StopIteration:
                if not self._ahead:
                    raise
                break
            self._ahead.append((host_batch, self._state()))
        if self.reserve and len(self._ahead) > 1:
            self.reserve([b for b, _ in self._ahead])

    def _prepare(self) -> Prepared:
        if not self._ahead:
            self._read_group()
        host_batch, state = self._ahead.popleft()
        self._step += 1
        batch = self.put_batch(host_batch)
        return Prepared(host_batch, batch, state, dict(self.placement_metrics()), dict(self.placement_state()))

    def _work(self) -> None:
        pinned = False
        while not self._stop.is_set():
            try:
                if self.cpus and not pinned:  # this thread; threads it starts inherit it
                    os.sched_setaffinity(0, self.cpus)
                    pinned = True
                item: Any = self._prepare()
            except BaseException as exc:  # handed to the consumer, raised there, naming what it was reading
                if isinstance(exc, Exception) and not isinstance(exc, StopIteration):
                    exc.add_note(f"(raised in the data thread while it read and placed step {self._step + 1})")
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Prepared:
        t0 = time.perf_counter()
        if self.depth <= 0:
            item: Any = self._prepare()
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="omnijax-prefetch", daemon=True)
                self._thread.start()
            item = self._queue.get()
        self.wait_s = time.perf_counter() - t0
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None


def split_cores(host_cores: int) -> tuple[set[int], set[int]] | None:
    """(step cores, host cores): the last `host_cores` of this process's cores for host work, the rest
    for the step's threads, as a GPU host keeps its data workers off the cores that drive the devices.
    None where that leaves the step no core (or the platform cannot pin threads)."""
    if host_cores <= 0 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= host_cores:
        return None
    return set(cores[:-host_cores]), set(cores[-host_cores:])


@contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """Every thread this process has now on `cpus` for the block (threads started inside inherit their
    starter's cores), then every thread back on the cores the calling thread had."""
    before = set(os.sched_getaffinity(0))
    _pin_all(cpus)
    try:
        yield
    finally:
        _pin_all(before)


def _pin_all(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
