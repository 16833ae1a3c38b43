"""Host work off the critical path: read, decode, plan and transfer the next batches while the device steps.

A background thread pulls host batches from the loader and hands them to the placement (`put_batch`:
routing plan + device transfer), up to `depth` steps ahead. Each item carries the loader state as it was
right after its batch was read, so a checkpoint records the position the trainer has *consumed*, never
the prefetched one, and resume stays exact.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Prepared:
    host_batch: dict          # what the loader produced (numpy)
    batch: Any                # what the step consumes (device arrays)
    loader_state: dict        # the loader's state after this batch: the position to checkpoint once it is consumed
    metrics: dict             # the placement's figures for this batch (plan imbalance, padding, ...)


class Prefetcher:
    """Iterator of `Prepared` items; depth 0 does the work inline (no thread)."""

    def __init__(self, loader: Any, put_batch: Callable[[dict], Any], depth: int = 2,
                 placement_metrics: Callable[[], dict] | None = None):
        self.loader, self.put_batch, self.depth = loader, put_batch, int(depth)
        self.placement_metrics = placement_metrics or (lambda: {})
        self.wait_s = 0.0                      # time the consumer waited for the last item
        self._queue: queue.Queue = queue.Queue(maxsize=max(self.depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _prepare(self) -> Prepared:
        host_batch = next(self.loader)
        state = self.loader.get_state()
        batch = self.put_batch(host_batch)
        return Prepared(host_batch, batch, state, dict(self.placement_metrics()))

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self._prepare()
            except BaseException as exc:  # handed to the consumer, raised there
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
