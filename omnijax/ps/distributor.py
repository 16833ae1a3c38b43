"""Load distribution among parameter servers.

Pure planning (`plan_placement`, `makespan`, `stragglers`) plus a small deterministic controller
(`Distributor`) fed with the servers' per-step reports. Exploitation: estimate every server's seconds
per byte from its reported transfer and processing time and move blocks from slow to fast servers when
the predicted step time drops by `min_gain`. Exploration: every `explore_every` steps try one server more
(from the spare pool) or one fewer, measure throughput for `trial_steps`, keep the change only if it
raised throughput by `min_gain`, else revert. The trainer applies every decision at an agreed future step.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence


def server_loads(block_bytes: Sequence[int], placement: Sequence[int]) -> dict[int, int]:
    loads: dict[int, int] = {}
    for nbytes, sid in zip(block_bytes, placement):
        loads[sid] = loads.get(sid, 0) + nbytes
    return loads


def makespan(block_bytes: Sequence[int], placement: Sequence[int], cost: Mapping[int, float]) -> float:
    """Predicted step time of the busiest server: max over servers of bytes × seconds-per-byte."""
    return max((cost[s] * b for s, b in server_loads(block_bytes, placement).items()), default=0.0)


def plan_placement(block_bytes: Sequence[int], current: Sequence[int] | None, cost: Mapping[int, float],
                   servers: Sequence[int]) -> tuple[int, ...]:
    """Assign every block to one of `servers`, changing `current` as little as needed to cut the makespan.

    Blocks on servers outside `servers` (or all, when `current` is None) are placed first, largest first,
    where they finish earliest; then single blocks move off the busiest server while that strictly lowers
    its time without making the receiver the new maximum. Deterministic; never worse than `current`."""
    servers = sorted(set(servers))
    if not servers:
        raise ValueError("plan_placement needs at least one server")
    if any(cost[s] <= 0 for s in servers):
        raise ValueError(f"costs must be > 0, got {dict(cost)}")
    n = len(block_bytes)
    place = list(current) if current is not None else [-1] * n
    if len(place) != n:
        raise ValueError(f"current placement has {len(place)} blocks, expected {n}")
    allowed = set(servers)
    time = {s: 0.0 for s in servers}
    homeless = []
    for b in range(n):
        if place[b] in allowed:
            time[place[b]] += cost[place[b]] * block_bytes[b]
        else:
            homeless.append(b)
    for b in sorted(homeless, key=lambda b: (-block_bytes[b], b)):
        s = min(servers, key=lambda s: (time[s] + cost[s] * block_bytes[b], s))
        place[b], time[s] = s, time[s] + cost[s] * block_bytes[b]
    for _ in range(n * len(servers)):
        hi = max(servers, key=lambda s: (time[s], -s))
        best = None
        for b in (b for b in range(n) if place[b] == hi):
            for t in servers:
                if t == hi:
                    continue
                new_pair = max(time[hi] - cost[hi] * block_bytes[b], time[t] + cost[t] * block_bytes[b])
                if new_pair < time[hi] * (1 - 1e-9) and (best is None or new_pair < best[0]):
                    best = (new_pair, b, t)
        if best is None:
            break
        _, b, t = best
        time[hi] -= cost[hi] * block_bytes[b]
        time[t] += cost[t] * block_bytes[b]
        place[b] = t
    return tuple(place)


def stragglers(cost: Mapping[int, float], factor: float = 1.5) -> list[int]:
    """Servers whose seconds-per-byte exceed `factor` × the median of all servers."""
    if not cost:
        return []
    med = statistics.median(cost.values())
    return sorted(s for s, c in cost.items() if c > factor * med)


@dataclass
class Decision:
    placement: tuple[int, ...]
    reason: str           # rebalance | explore_add | explore_remove | keep | revert
    detail: str = ""


@dataclass
class Distributor:
    """Deterministic controller: `observe` reports, `decide` after each finished step."""
    block_bytes: tuple[int, ...]
    pool: tuple[int, ...]               # every server id that may be used
    rebalance: bool = True
    rebalance_every: int = 4
    explore_every: int = 0
    trial_steps: int = 6
    min_gain: float = 0.05
    min_servers: int = 1
    max_servers: int = 0
    smoothing: float = 0.5
    processing_in_cost: bool = True     # False: price servers by their (modelled) transfer seconds alone
    cost: dict[int, float] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    _busy: dict[int, list[float]] = field(default_factory=dict)
    _durations: dict[int, float] = field(default_factory=dict)
    _trial: dict | None = None
    _settle_until: int = -1
    _last_explore: int = 0
    _try_add_next: bool = True

    def observe(self, step: int, step_seconds: float, server_stats: Sequence[Mapping] = ()) -> None:
        """One finished step's wall time and any server reports (bytes, transfer_s, processing_s)."""
        self._durations[step] = step_seconds
        for st in server_stats:
            acc = self._busy.setdefault(st["sid"], [0.0, 0.0])
            acc[0] += st["transfer_s"] + (st["processing_s"] if self.processing_in_cost else 0.0)
            acc[1] += st["bytes_in"] + st["bytes_out"]

    def _update_costs(self) -> None:
        for sid, (busy, nbytes) in self._busy.items():
            if nbytes > 0 and busy > 0:
                c = busy / nbytes
                old = self.cost.get(sid)
                self.cost[sid] = c if old is None else self.smoothing * old + (1 - self.smoothing) * c
        self._busy.clear()

    def _rate(self, first: int, last: int) -> float | None:
        d = [self._durations[s] for s in range(first, last + 1) if s in self._durations]
        return len(d) / sum(d) if d and sum(d) > 0 else None

    def _costs_for(self, servers: Sequence[int]) -> dict[int, float]:
        known = [self.cost[s] for s in servers if s in self.cost]
        fill = statistics.median(known) if known else 1.0
        return {s: self.cost.get(s, fill) for s in servers}

    def decide(self, step: int, placement: tuple[int, ...], effective: int) -> Decision | None:
        """Called after step `step` finished; a returned plan takes effect at step `effective`."""
        active = sorted(set(placement))
        if self._trial is not None:
            t = self._trial
            if step < t["measure_to"]:
                return None
            self._trial = None
            new_rate = self._rate(t["measure_from"], t["measure_to"])
            keep = new_rate is not None and t["base_rate"] and new_rate >= t["base_rate"] * (1 + self.min_gain)
            self._settle_until = effective + 1
            self._last_explore = step
            row = dict(step=step, kind=t["kind"], base_rate=t["base_rate"], trial_rate=new_rate, kept=bool(keep))
            self.history.append(row)
            if keep:
                return Decision(placement, "keep", f"{t['kind']}: {new_rate:.2f} vs {t['base_rate']:.2f} steps/s")
            return Decision(t["before"], "revert", f"{t['kind']}: {new_rate} vs {t['base_rate']} steps/s")
        if step < self._settle_until:
            self._busy.clear()
            return None
        if step % self.rebalance_every == 0:
            self._update_costs()
        if self.rebalance and step % self.rebalance_every == 0 and all(s in self.cost for s in active):
            cost = self._costs_for(active)
            plan = plan_placement(self.block_bytes, placement, cost, active)
            before, after = makespan(self.block_bytes, placement, cost), makespan(self.block_bytes, plan, cost)
            if after < before * (1 - self.min_gain):
                self._settle_until = effective + 1
                self.history.append(dict(step=step, kind="rebalance", predicted_before=before, predicted_after=after,
                                         stragglers=stragglers(cost)))
                return Decision(plan, "rebalance", f"predicted step {before:.4f}s -> {after:.4f}s")
        if self.explore_every and step - self._last_explore >= self.explore_every:
            self._last_explore = step
            spare = [s for s in self.pool if s not in active]
            cap = self.max_servers or len(self.pool)
            can_add, can_remove = bool(spare) and len(active) < cap, len(active) > self.min_servers
            if not (can_add or can_remove):
                return None
            add = can_add and (self._try_add_next or not can_remove)
            self._try_add_next = not add
            base = self._rate(step - self.trial_steps + 1, step)
            if base is None:
                return None
            if add:
                servers = active + [spare[0]]
                kind = f"explore_add:{spare[0]}"
            else:
                cost = self._costs_for(active)
                drop = max(active, key=lambda s: (cost[s], s))
                servers = [s for s in active if s != drop]
                kind = f"explore_remove:{drop}"
            cost = self._costs_for(servers)
            plan = plan_placement(self.block_bytes, [p if p in servers else -1 for p in placement], cost, servers)
            settle = 2
            self._trial = dict(kind=kind, before=placement, base_rate=base, measure_from=effective + settle,
                               measure_to=effective + settle + self.trial_steps - 1)
            return Decision(plan, kind.split(":")[0], kind)
        return None
