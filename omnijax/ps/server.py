"""Parameter-server actor: owns blocks of the flat parameter vector and their optax state.

Runs as an asyncio Ray actor so that a pull can wait for the version it needs while pushes from other
workers keep arriving. Per block it keeps the parameters, the optimizer state, the version (number of
applied steps in sync mode, of applied worker gradients in async mode) and the previous version (to roll
back to the last consistent state after a worker dies).

Moves happen at an agreed version: `schedule_move(b, v, dest)` makes the owner hand the block (and any
partial gradients) to `dest` right after applying the update that brings it to version `v`; requests
that still reach the old owner afterwards are forwarded, so no gradient is lost or applied twice.

Straggler injection is deterministic: a simulated link of `link_bytes_per_s` serialises every byte the
server receives or sends, and `slowdown` multiplies its per-byte time; `neighbour=True` instead runs a
CPU-bound thread inside the server process (a noisy neighbour, not deterministic).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


class PSAborted(RuntimeError):
    """Raised to waiting pulls when the trainer aborts a step (a worker or server died)."""


@dataclass
class ServerKnobs:
    mode: str = "sync"               # "sync" | "async"
    num_workers: int = 1
    staleness: int = 0               # async: a pull for iteration k needs every worker's k-1-staleness applied
    staleness_mode: str = "none"     # async: delay compensation on when it starts with "delay_comp"
    dc_lambda: float = 0.04          # delay compensation strength
    link_bytes_per_s: float = 0.0    # simulated link bandwidth (0 = no link delay)
    slowdown: float = 1.0            # straggler: per-byte link time multiplier
    neighbour: bool = False          # straggler: CPU-bound thread in this process


class _BlockState:
    __slots__ = ("param", "opt", "version", "prev", "applied", "backup")

    def __init__(self, param, opt, version: int, applied: dict[int, int]):
        self.param, self.opt, self.version = param, opt, version
        self.prev = None                         # (param, opt, version, applied) before the last update
        self.applied = dict(applied)             # async: worker -> iterations of it applied
        self.backup: dict[int, np.ndarray] = {}  # async delay compensation: worker -> params it pulled


class ParameterServer:
    """Ray actor body (wrapped with `ray.remote` by the cluster)."""

    def __init__(self, sid: int):
        self.sid = sid
        self._stop_neighbour = threading.Event()
        self._neighbour: threading.Thread | None = None
        self._reset()

    # ---------------------------------------------------------------------------------- setup
    def _reset(self) -> None:
        self.blocks: dict[int, _BlockState] = {}
        self.pending: dict[tuple[int, int], dict[int, list]] = {}  # (block, step) -> worker -> [{start: chunk}, filled, size]
        self.moves: dict[int, tuple[int, Any, int]] = {}             # block -> (at_version, dest, dest_sid)
        self.forward: dict[int, tuple[Any, int]] = {}                 # block -> (dest, dest_sid)
        self.retired: set[int] = set()
        self.aborted = False
        self._stats = dict(bytes_in=0, bytes_out=0, transfer_s=0.0, processing_s=0.0, updates=0)
        self._steps_seen: set[int] = set()
        self._changed: asyncio.Condition | None = None
        self._link: asyncio.Lock | None = None

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._link = asyncio.Lock()
        return self._changed

    async def configure(self, optimizer_blob: bytes, knobs: ServerKnobs) -> int:
        """Forget every block and set the optimizer and knobs for a new run."""
        import cloudpickle
        import jax
        import optax

        self._reset()
        self.knobs = knobs
        if getattr(self, "_opt_blob", None) == optimizer_blob:  # same optimizer: keep the compiled update
            self.set_straggler(knobs.slowdown, knobs.neighbour)
            return self.sid
        self._opt_blob = optimizer_blob
        opt = cloudpickle.loads(optimizer_blob)
        self._opt = opt

        def apply(param, opt_state, grad):
            updates, opt_state = opt.update(grad, opt_state, param)
            return optax.apply_updates(param, updates), opt_state

        self._apply = jax.jit(apply)
        self._compiled: set[int] = set()
        self._init = jax.jit(opt.init)
        self.set_straggler(knobs.slowdown, knobs.neighbour)
        return self.sid

    def set_straggler(self, slowdown: float, neighbour: bool = False) -> None:
        """Slow this server down from now on (per-byte delay factor and/or a CPU-bound neighbour)."""
        self.knobs.slowdown = float(slowdown)
        self.knobs.neighbour = bool(neighbour)
        if neighbour and self._neighbour is None:
            self._stop_neighbour.clear()

            def spin() -> None:
                while not self._stop_neighbour.is_set():
                    sum(i * i for i in range(20000))

            self._neighbour = threading.Thread(target=spin, daemon=True)
            self._neighbour.start()
        elif not neighbour and self._neighbour is not None:
            self._stop_neighbour.set()
            self._neighbour = None

    def ping(self) -> int:
        return self.sid

    # ------------------------------------------------------------------------------ transfer
    async def _transfer(self, nbytes: int, inbound: bool) -> None:
        self._cond()
        self._stats["bytes_in" if inbound else "bytes_out"] += nbytes
        k = self.knobs
        if k.link_bytes_per_s <= 0:
            return
        seconds = nbytes / k.link_bytes_per_s * k.slowdown
        async with self._link:
            await asyncio.sleep(seconds)
        self._stats["transfer_s"] += seconds

    # ------------------------------------------------------------------------------- blocks
    async def init_block(self, index: int, param: np.ndarray, version: int = 0) -> None:
        """Own block `index` with fresh optimizer state (start of training)."""
        import jax.numpy as jnp
        p = jnp.asarray(param, jnp.float32)
        await self.install(index, p, self._init(p), version, {w: version for w in range(self.knobs.num_workers)}, {})

    async def install(self, index: int, param, opt, version: int, applied: dict[int, int],
                      pending: dict[int, dict[int, list]]) -> None:
        """Receive a block (and partial gradients for it) from its previous owner or a checkpoint."""
        import jax.numpy as jnp
        cond = self._cond()
        self.forward.pop(index, None)
        param = jnp.asarray(param)
        if param.size not in self._compiled:  # compile now, so that reported processing time is steady-state
            import jax
            jax.block_until_ready(self._apply(param, opt, jnp.zeros_like(param)))
            self._compiled.add(param.size)
        self.blocks[index] = _BlockState(param, opt, int(version), applied)
        for step, by_worker in pending.items():
            self._merge(index, step, by_worker)
        await self._settle(index)
        async with cond:
            cond.notify_all()

    def _merge(self, index: int, step: int, by_worker: dict[int, list]) -> None:
        mine = self.pending.setdefault((index, step), {})
        for w, (chunks, filled, size) in by_worker.items():
            entry = mine.setdefault(w, [{}, 0, size])
            entry[0].update(chunks)
            entry[1] += filled

    async def schedule_move(self, index: int, at_version: int, dest: Any, dest_sid: int) -> None:
        """Hand block `index` to `dest` once it reaches `at_version` (-1: as soon as possible)."""
        state = self.blocks.get(index)
        if state is None:
            raise RuntimeError(f"server {self.sid}: asked to move block {index} it does not own")
        if at_version >= 0 and state.version > at_version:
            raise RuntimeError(f"server {self.sid}: block {index} is already at version {state.version} > "
                               f"agreed move version {at_version}")
        self.moves[index] = (at_version, dest, dest_sid)
        await self._settle(index)

    async def _export(self, index: int) -> None:
        _, dest, dest_sid = self.moves.pop(index)
        state = self.blocks.pop(index)
        pending = {step: self.pending.pop((b, step)) for (b, step) in list(self.pending) if b == index}
        self.forward[index] = (dest, dest_sid)
        await dest.install.remote(index, np.asarray(state.param), state.opt, state.version, state.applied, pending)

    async def _settle(self, index: int) -> None:
        """Apply every complete gradient for `index`, then hand it over if its agreed version has come."""
        state = self.blocks.get(index)
        if state is None:
            return
        k = self.knobs
        if k.mode == "sync":
            while True:
                got = self.pending.get((index, state.version))
                if not got or len(got) < k.num_workers or any(e[1] < e[2] for e in got.values()):
                    break
                del self.pending[(index, state.version)]
                t0 = time.perf_counter()
                grad = self._assemble(got[0])
                for w in range(1, k.num_workers):  # fixed order: bitwise reproducible sums
                    grad += self._assemble(got[w])
                grad /= np.float32(k.num_workers)
                self._update(state, grad, None)
                self._stats["processing_s"] += time.perf_counter() - t0
        else:
            for key in sorted(key for key in self.pending if key[0] == index):
                got = self.pending[key]
                for w in sorted(got):
                    if got[w][1] < got[w][2]:
                        continue
                    entry = got.pop(w)
                    t0 = time.perf_counter()
                    self._update(state, self._assemble(entry), w)
                    state.applied[w] = max(state.applied.get(w, 0), key[1] + 1)
                    self._stats["processing_s"] += time.perf_counter() - t0
                if not got:
                    del self.pending[key]
        move = self.moves.get(index)
        if move is not None and (move[0] < 0 or state.version >= move[0]):
            await self._export(index)
        cond = self._cond()
        async with cond:
            cond.notify_all()

    @staticmethod
    def _assemble(entry: list) -> np.ndarray:
        chunks, _, size = entry
        out = np.empty(size, np.float32)
        for start, chunk in chunks.items():
            out[start:start + chunk.size] = chunk
        return out

    def _update(self, state: _BlockState, grad: np.ndarray, worker: int | None) -> None:
        k = self.knobs
        if worker is not None and k.staleness_mode.startswith("delay_comp") and worker in state.backup:
            # g~ = g + lambda * g * g * (w_now - w_pulled): first-order correction of the gradient delay
            delta = np.asarray(state.param) - state.backup.pop(worker)
            grad = grad + np.float32(k.dc_lambda) * grad * grad * delta
        state.prev = (state.param, state.opt, state.version, dict(state.applied))
        state.param, state.opt = self._apply(state.param, state.opt, grad)
        state.version += 1
        self._stats["updates"] += 1
        self._steps_seen.add(state.version)

    # ---------------------------------------------------------------------------- requests
    def _ready(self, index: int, version: int) -> bool:
        state = self.blocks.get(index)
        if state is None:
            return False
        if self.knobs.mode == "sync":
            return state.version >= version
        live = [n for w, n in state.applied.items() if w not in self.retired]
        return not live or min(live) >= version - self.knobs.staleness

    async def pull(self, indices: list[int], version: int, worker: int) -> list[np.ndarray]:
        """Blocks `indices` at `version` (sync) or within the staleness bound for iteration `version`."""
        cond = self._cond()
        out: list[Any] = [None] * len(indices)
        forwarded = []
        for i, index in enumerate(indices):
            async with cond:
                await cond.wait_for(lambda: self.aborted or index in self.forward or self._ready(index, version))
            if self.aborted:
                raise PSAborted(f"server {self.sid}: step aborted")
            if index in self.forward:
                forwarded.append((i, self.forward[index][0].pull.remote([index], version, worker)))
                continue
            state = self.blocks[index]
            out[i] = np.asarray(state.param)
            if self.knobs.staleness_mode.startswith("delay_comp"):
                state.backup[worker] = out[i]
        own = sum(a.nbytes for a in out if a is not None)
        await self._transfer(own, inbound=False)
        for i, ref in forwarded:
            out[i] = (await ref)[0]
        return out

    async def push(self, index: int, step: int, worker: int, start: int, chunk: np.ndarray, block_size: int) -> None:
        """Gradient chunk [start, start+len) of block `index` from `worker` for `step` (iteration)."""
        if self.aborted:
            raise PSAborted(f"server {self.sid}: step aborted")
        if index in self.forward:
            await self.forward[index][0].push.remote(index, step, worker, start, chunk, block_size)
            return
        await self._transfer(chunk.nbytes, inbound=True)
        t0 = time.perf_counter()
        entry = self.pending.setdefault((index, step), {}).setdefault(worker, [{}, 0, block_size])
        entry[0][start] = chunk
        entry[1] += chunk.size
        self._stats["processing_s"] += time.perf_counter() - t0
        if index in self.forward:  # moved while we waited on the link: hand this chunk on
            by_worker = self.pending.pop((index, step), {})
            if by_worker:
                await self.forward[index][0].install_pending.remote(index, step, by_worker)
            return
        await self._settle(index)

    async def install_pending(self, index: int, step: int, by_worker: dict[int, list]) -> None:
        """Partial gradients forwarded by a previous owner (they arrived during the hand-over)."""
        if index in self.forward:
            await self.forward[index][0].install_pending.remote(index, step, by_worker)
            return
        self._merge(index, step, by_worker)
        await self._settle(index)

    # ------------------------------------------------------------------------ control, faults
    async def snapshot(self, indices: list[int] | None = None) -> dict[int, dict]:
        """Parameters, optimizer state and version of owned blocks (a consistent point is the caller's job)."""
        import jax
        return {i: dict(param=np.asarray(s.param), opt=jax.device_get(s.opt), version=s.version,
                        applied=dict(s.applied))
                for i, s in self.blocks.items() if indices is None or i in indices}

    def versions(self) -> dict[int, int]:
        return {i: s.version for i, s in self.blocks.items()}

    async def abort(self) -> None:
        """Wake every waiting pull with PSAborted (a participant died)."""
        cond = self._cond()
        self.aborted = True
        async with cond:
            cond.notify_all()

    async def rollback(self, version: int) -> dict[int, int]:
        """Bring every owned block back to `version` (at most one step back), drop partial gradients."""
        for i, s in self.blocks.items():
            if s.version == version + 1 and s.prev is not None:
                s.param, s.opt, s.version, s.applied = s.prev
                s.prev = None
            elif s.version != version:
                raise RuntimeError(f"server {self.sid}: block {i} at version {s.version} cannot roll back to {version}")
            s.backup.clear()
        self.pending.clear()
        self.moves.clear()
        self.aborted = False
        return self.versions()

    async def retire_worker(self, worker: int) -> None:
        """Async mode: a dead worker no longer holds back the staleness bound; drop its partial gradients."""
        cond = self._cond()
        self.retired.add(worker)
        for key in list(self.pending):
            self.pending[key].pop(worker, None)
            if not self.pending[key]:
                del self.pending[key]
        async with cond:
            cond.notify_all()

    def stats(self) -> dict:
        """Counters since the last call: bytes in/out, link (transfer) time, processing time, updates,
        and the same times per step (steps = distinct versions this server's blocks advanced through)."""
        steps = max(1, len(self._steps_seen))
        out = dict(self._stats, sid=self.sid, blocks=sorted(self.blocks), steps=len(self._steps_seen),
                   transfer_s_per_step=self._stats["transfer_s"] / steps,
                   processing_s_per_step=self._stats["processing_s"] / steps)
        self._stats = dict(bytes_in=0, bytes_out=0, transfer_s=0.0, processing_s=0.0, updates=0)
        self._steps_seen = set()
        return out
