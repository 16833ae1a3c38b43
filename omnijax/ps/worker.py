"""Worker actor: pulls blocks, computes the gradient of the flat parameter vector with JAX, pushes chunks.

Chunks go out in priority order (block 0 first) with a credit window: at most `credit_bytes` of
gradient are in flight (sent, not yet acknowledged by a server) at any time, so the servers that hold
the first layers get their bytes first and a slow server cannot make the worker flood memory.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from omnijax.ps.blocks import Block, ParamLayout, chunk_ranges, join_blocks


class PSWorker:
    """Ray actor body (wrapped with `ray.remote` by the cluster)."""

    def __init__(self, index: int):
        self.index = index
        self.servers: dict[int, Any] = {}

    def ping(self) -> int:
        return self.index

    def configure(self, spec_blob: bytes, layout: ParamLayout, blocks: tuple[Block, ...], num_workers: int,
                  chunk_bytes: int, credit_bytes: int, predict_with: bytes | None = None) -> int:
        """Build the model from its factory and compile the flat-vector gradient once."""
        import cloudpickle
        import jax
        from flax import nnx

        model_fn, loss_fn, batch_fn = cloudpickle.loads(spec_blob)
        key = (spec_blob, layout, predict_with)
        if getattr(self, "_grad_key", None) != key:  # a new run of the same job reuses the compiled step
            graphdef, _, rest = nnx.split(model_fn(), nnx.Param, ...)

            def loss_of_flat(flat, batch):
                return loss_fn(nnx.merge(graphdef, layout.unflatten(flat), rest), batch)

            value_and_grad = jax.value_and_grad(loss_of_flat)
            if predict_with is None:
                fn = value_and_grad
            else:  # weight prediction: the gradient at w^ = w + Opt(w, g), optimizer state discarded
                opt = cloudpickle.loads(predict_with)

                def fn(flat, batch):
                    loss, g = value_and_grad(flat, batch)
                    updates, _ = opt.update(g, opt.init(flat), flat)
                    return loss, value_and_grad(flat + updates, batch)[1]

            self._grad, self._grad_key = jax.jit(fn), key
        self.batch_fn, self.layout, self.blocks, self.num_workers = batch_fn, layout, blocks, num_workers
        self.set_comm(chunk_bytes, credit_bytes)
        return self.index

    def set_comm(self, chunk_bytes: int, credit_bytes: int) -> None:
        self.chunk_elems, self.credit_bytes = max(1, chunk_bytes // 4), max(4, credit_bytes)
        self.chunks = [(b, s, e) for b in self.blocks for s, e in chunk_ranges(b.size, self.chunk_elems)]

    def set_servers(self, servers: dict[int, Any]) -> None:
        self.servers = dict(servers)

    def step(self, step: int, placement: tuple[int, ...]) -> dict:
        """One iteration: pull (blocks at version `step`), gradient, push. Returns loss and timings."""
        import ray

        t0 = time.perf_counter()
        by_server: dict[int, list[int]] = {}
        for b, sid in enumerate(placement):
            by_server.setdefault(sid, []).append(b)
        refs = {sid: self.servers[sid].pull.remote(idx, step, self.index) for sid, idx in by_server.items()}
        parts: list[Any] = [None] * len(self.blocks)
        for sid, ref in refs.items():
            for b, arr in zip(by_server[sid], ray.get(ref)):
                parts[b] = arr
        flat = join_blocks(parts, self.blocks, self.layout.total)
        t1 = time.perf_counter()
        batch = self.batch_fn(step, self.index, self.num_workers)
        loss, grad = self._grad(flat, batch)
        grad = np.asarray(grad)
        loss = float(loss)
        t2 = time.perf_counter()
        inflight: dict[Any, int] = {}
        sent = 0
        for block, s, e in self.chunks:  # priority order: block 0 first
            chunk = grad[block.start + s:block.start + e]
            while inflight and sum(inflight.values()) + chunk.nbytes > self.credit_bytes:
                done, _ = ray.wait(list(inflight), num_returns=1)
                for ref in done:
                    ray.get(ref)  # surface server errors here
                    del inflight[ref]
            ref = self.servers[placement[block.index]].push.remote(block.index, step, self.index, s, chunk, block.size)
            inflight[ref] = chunk.nbytes
            sent += chunk.nbytes
        ray.get(list(inflight))
        t3 = time.perf_counter()
        return dict(worker=self.index, step=step, loss=loss, pull_s=t1 - t0, compute_s=t2 - t1,
                    push_s=t3 - t2, bytes_pushed=sent)
