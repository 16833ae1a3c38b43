"""Step-time model read from a compiled program's scheduled HLO.

`parse_hlo` reads the text of a compiled (scheduled) module: computations, instructions in schedule
order, shapes, operands, called computations and collective groups. `predict` replays the entry
schedule on a target (device roofline + a hierarchical network): compute ops run in schedule order
on one compute stream; collectives run on `comm_streams` streams as soon as their operands are
ready and a stream is free, so they overlap with compute exactly as far as the program's data
dependencies (and our optimization-barrier chains) allow — what a latency-hiding scheduler can reach.
With `overlap=False` every collective blocks the compute stream (a program without async collectives).

Scaling: the program is per device. A collective whose replica group spans every device of the
compiled program is modelled over the whole target (`hosts × gpus_per_host` ranks, hierarchical:
NVLink inside a host, the network between hosts); smaller groups stay inside one host.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "token": 0, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"(pred|[sufc]\d+|bf16|f8\w*|token)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "opt-barrier", "after-all",
         "partition-id", "replica-id", "iota", "copy-done", "add-dependency"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "log", "tanh",
                "sqrt", "rsqrt", "power", "negate", "abs", "compare", "select", "clamp", "logistic", "erf",
                "exponential-minus-one", "log-plus-one", "sign", "cosine", "sine", "floor", "ceil", "and",
                "or", "xor", "not", "atan2", "remainder", "round-nearest-even", "round-nearest-afz", "cbrt", "tan"}


@dataclass
class Shape:
    arrays: list[tuple[str, tuple[int, ...]]]

    @property
    def nbytes(self) -> int:
        return sum(_DTYPE_BYTES.get(d, 4) * int(np.prod(s, dtype=np.int64)) for d, s in self.arrays)

    @property
    def elements(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for _, s in self.arrays)

    @property
    def dims(self) -> tuple[int, ...]:
        return self.arrays[0][1] if self.arrays else ()

    @property
    def dtype(self) -> str:
        return self.arrays[0][0] if self.arrays else "f32"


@dataclass
class Instr:
    name: str
    opcode: str
    shape: Shape
    operands: list[str]
    attrs: str
    root: bool = False

    def called(self) -> list[str]:
        names = []
        for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
                    "false_computation"):
            m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
            if m:
                names += [n.strip().lstrip("%") for n in m.group(1).strip("{}").split(",") if n.strip()]
        return names

    def group_size(self, default: int) -> int:
        m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", self.attrs)
        if m:
            return len([x for x in m.group(1).split(",") if x.strip()])
        m = re.search(r"replica_groups=\[(\d+),(\d+)\]", self.attrs)
        if m:
            return int(m.group(2))
        return default


@dataclass
class Computation:
    name: str
    instrs: list[Instr]
    entry: bool = False

    def table(self) -> dict[str, Instr]:
        return {i.name: i for i in self.instrs}


def _split_shape(rest: str) -> tuple[str, str]:
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].strip()
    head, _, tail = rest.partition(" ")
    return head, tail.strip()


def _parse_shape(text: str) -> Shape:
    return Shape([(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(text)])


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    shape_text, rest = _split_shape(m.group(3))
    om = re.match(r"([\w\-]+)\((.*)$", rest)
    if not om:
        return None
    opcode, tail = om.group(1), om.group(2)
    depth, i = 1, 0
    while i < len(tail) and depth:
        depth += tail[i] == "("
        depth -= tail[i] == ")"
        i += 1
    operand_text, attrs = tail[:i - 1], tail[i:]
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    return Instr(m.group(2), opcode, _parse_shape(shape_text), operands, attrs, bool(m.group(1)))


def parse_hlo(text: str) -> dict[str, Computation]:
    """Computations of an HLO module text, instructions in their (scheduled) order."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m:
                current = Computation(m.group(2), [], entry=bool(m.group(1)))
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        instr = _parse_instr(line)
        if instr:
            current.instrs.append(instr)
    if not any(c.entry for c in comps.values()):
        raise ValueError("parse_hlo: no ENTRY computation found (pass compiled.as_text())")
    return comps


def entry(comps: dict[str, Computation]) -> Computation:
    return next(c for c in comps.values() if c.entry)


def collectives_in_order(text_or_comps: str | dict[str, Computation]) -> list[Instr]:
    """Collective instructions of the entry computation, in schedule order (async pairs once)."""
    comps = parse_hlo(text_or_comps) if isinstance(text_or_comps, str) else text_or_comps
    out = []
    for ins in entry(comps).instrs:
        base = ins.opcode.removesuffix("-start")
        if base in COLLECTIVES and not ins.opcode.endswith("-done"):
            out.append(ins)
    return out


# --------------------------------------------------------------------------------- FLOP counting
def _dot_flops(ins: Instr, table: dict[str, Instr]) -> float:
    lhs = table.get(ins.operands[0]) if ins.operands else None
    if lhs is None:
        return 0.0
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    dims = [int(x) for x in m.group(1).split(",") if x] if m else []
    k = int(np.prod([lhs.shape.dims[d] for d in dims])) if dims else 1
    return 2.0 * ins.shape.elements * k


def _conv_flops(ins: Instr, table: dict[str, Instr]) -> float:
    rhs = table.get(ins.operands[1]) if len(ins.operands) > 1 else None
    if rhs is None or not rhs.shape.dims:
        return 0.0
    out_features = max(rhs.shape.dims[-1], 1)
    return 2.0 * ins.shape.elements * rhs.shape.elements / out_features


def _trip_count(ins: Instr) -> int:
    m = re.search(r'known_trip_count[^0-9]*(\d+)', ins.attrs)
    return int(m.group(1)) if m else 1


def computation_flops(comps: dict[str, Computation], name: str, _memo: dict | None = None) -> tuple[float, float]:
    """(dot/conv FLOPs, elementwise FLOPs) of computation `name`, recursing into calls and loops."""
    memo = _memo if _memo is not None else {}
    if name in memo:
        return memo[name]
    comp = comps[name]
    table = comp.table()
    mm = ew = 0.0
    for ins in comp.instrs:
        if ins.opcode == "dot":
            mm += _dot_flops(ins, table)
        elif ins.opcode == "convolution":
            mm += _conv_flops(ins, table)
        elif ins.opcode in _ELEMENTWISE:
            ew += ins.shape.elements
        elif ins.opcode in ("reduce", "reduce-window"):
            src = table.get(ins.operands[0]) if ins.operands else None
            ew += src.shape.elements if src else 0
        if ins.opcode in COLLECTIVES or ins.opcode.removesuffix("-start") in COLLECTIVES:
            continue  # their to_apply is the reduction, not compute of this device
        called = [c for c in ins.called() if c in comps]
        if ins.opcode == "conditional" and called:
            sub = [computation_flops(comps, c, memo) for c in called]
            best = max(sub, key=lambda s: s[0] + s[1])
            mm, ew = mm + best[0], ew + best[1]
        elif ins.opcode in ("fusion", "call", "while", "async-start", "custom-call"):
            mult = _trip_count(ins) if ins.opcode == "while" else 1
            for c in called:
                a, b = computation_flops(comps, c, memo)
                mm, ew = mm + mult * a, ew + mult * b
    memo[name] = (mm, ew)
    return mm, ew


def program_flops(hlo_text: str) -> dict[str, float]:
    """FLOPs per device of a compiled program: matmul, elementwise and their sum."""
    comps = parse_hlo(hlo_text)
    mm, ew = computation_flops(comps, entry(comps).name)
    return {"matmul_flops": mm, "elementwise_flops": ew, "flops": mm + ew}


# ------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class DeviceModel:
    name: str
    matmul_flops: dict[str, float]       # dense peak per dtype (f32 dots run as TF32 on tensor cores)
    vector_flops: float
    hbm_Bps: float
    efficiency: float = 0.6              # achieved fraction of peak for large matmuls
    launch_s: float = 2e-6               # per kernel

    def op_time(self, mm_flops: float, ew_flops: float, nbytes: float, dtype: str) -> float:
        peak = self.matmul_flops.get(dtype, self.matmul_flops["f32"]) * self.efficiency
        t = max(mm_flops / peak + ew_flops / self.vector_flops, nbytes / (self.hbm_Bps * 0.8))
        return t + self.launch_s


@dataclass(frozen=True)
class NetworkModel:
    gpus_per_host: int = 8
    hosts: int = 8
    nvlink_Bps: float = 450e9          # per GPU per direction
    net_Bps: float = 400e9 / 8         # per GPU (one NIC each), bytes/s
    nvlink_latency_s: float = 3e-6
    net_latency_s: float = 10e-6

    @property
    def world(self) -> int:
        return self.gpus_per_host * self.hosts

    def collective_s(self, kind: str, nbytes: float, ranks: int) -> float:
        lat, bw = self.collective_parts(kind, nbytes, ranks)
        return lat + bw

    def collective_parts(self, kind: str, nbytes: float, ranks: int) -> tuple[float, float]:
        """(latency, bandwidth) seconds of one collective, hierarchical ring estimates; `nbytes` is
        the full (unsharded) buffer. Concurrent collectives overlap latencies but share bandwidth."""
        g = min(ranks, self.gpus_per_host)
        h = max(1, ranks // self.gpus_per_host) if ranks > self.gpus_per_host else 1
        if ranks <= 1:
            return 0.0, 0.0
        intra = (g - 1) / g * nbytes / self.nvlink_Bps if g > 1 else 0.0
        inter = (h - 1) / h * (nbytes / g) / self.net_Bps if h > 1 else 0.0
        # tree-like latency (NCCL picks trees for small messages), ring bandwidth terms
        lat = math.log2(g) * self.nvlink_latency_s + (math.log2(h) if h > 1 else 0.0) * self.net_latency_s
        if kind == "all-reduce":
            return 2 * lat, 2 * (intra + inter)
        if kind in ("all-gather", "reduce-scatter"):
            return lat, intra + inter
        if kind == "all-to-all":
            return lat, (nbytes * (ranks - 1) / ranks) / (self.net_Bps if h > 1 else self.nvlink_Bps)
        return lat, nbytes / (self.net_Bps if h > 1 else self.nvlink_Bps)


H100 = DeviceModel("H100-SXM", {"f32": 494e12, "bf16": 989e12, "f16": 989e12, "f8e4m3fn": 1979e12}, 67e12, 3.35e12)
H200 = DeviceModel("H200-SXM", {"f32": 494e12, "bf16": 989e12, "f16": 989e12, "f8e4m3fn": 1979e12}, 67e12, 4.8e12)
DEVICES = {"h100": H100, "h200": H200}


def network(gbps: float = 400.0, hosts: int = 8, gpus_per_host: int = 8) -> NetworkModel:
    """Hosts of NVLink-connected GPUs joined by `gbps` Gb/s per GPU (100–400 typical)."""
    return NetworkModel(gpus_per_host=gpus_per_host, hosts=hosts, net_Bps=gbps * 1e9 / 8)


# ---------------------------------------------------------------------------------- prediction
@dataclass
class Prediction:
    step_s: float
    compute_s: float
    comm_s: float
    flops: float
    collectives: list[dict] = field(default_factory=list)

    @property
    def lower_bound_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)


def _collective_bytes(ins: Instr, table: dict[str, Instr]) -> float:
    kind = ins.opcode.removesuffix("-start")
    if kind == "reduce-scatter":     # full buffer = its operand
        return sum(table[o].shape.nbytes for o in ins.operands if o in table) or ins.shape.nbytes
    if kind == "all-gather" and ins.opcode.endswith("-start"):
        return ins.shape.nbytes / 2   # async start's shape is (operand, output)
    return ins.shape.nbytes


@dataclass
class _Totals:
    compute_s: float = 0.0
    comm_lat_s: float = 0.0
    comm_bw_s: float = 0.0
    flops: float = 0.0
    collectives: list = field(default_factory=list)

    def add(self, other: "_Totals", times: int = 1) -> None:
        self.compute_s += other.compute_s * times
        self.comm_lat_s += other.comm_lat_s * times
        self.comm_bw_s += other.comm_bw_s * times
        self.flops += other.flops * times
        self.collectives += other.collectives

    def comm_s(self, streams: int) -> float:
        """Least time the collectives need: bandwidth is shared, latencies overlap over `streams`."""
        return max(self.comm_bw_s, (self.comm_bw_s + self.comm_lat_s) / max(1, streams))

    def collective(self, ins: Instr, kind: str, nbytes: float, ranks: int, lat: float, bw: float) -> None:
        self.comm_lat_s += lat
        self.comm_bw_s += bw
        self.collectives.append({"op": kind, "bytes": int(nbytes), "ranks": ranks, "s": lat + bw})


class _Sim:
    """Discrete-event replay of one computation.

    overlap=True: a list scheduler. The compute stream runs, among the ops whose operands are done,
    first those that feed a collective (so collectives start as early as dependencies allow, as a
    latency-hiding scheduler would place them), then the rest, each group in program order.
    Collectives run on `streams` communication streams. overlap=False: strict program order on one
    stream, collectives included.
    """

    def __init__(self, comps, device, net, program_devices, comm_streams, overlap):
        self.comps, self.device, self.net = comps, device, net
        self.program_devices, self.streams, self.overlap = program_devices, max(1, comm_streams), overlap
        self.flops_memo: dict = {}

    def ranks(self, ins: Instr) -> int:
        size = ins.group_size(self.program_devices)
        return self.net.world if size >= self.program_devices else size

    def _compute_cost(self, ins: Instr, table: dict[str, Instr]) -> tuple[float, float]:
        mm = ew = 0.0
        if ins.opcode == "dot":
            mm = _dot_flops(ins, table)
        elif ins.opcode == "convolution":
            mm = _conv_flops(ins, table)
        elif ins.opcode in _ELEMENTWISE:
            ew = ins.shape.elements
        if ins.opcode in ("fusion", "custom-call"):
            for c in ins.called():
                if c in self.comps:
                    a, b = computation_flops(self.comps, c, self.flops_memo)
                    mm, ew = mm + a, ew + b
        nbytes = ins.shape.nbytes + sum(table[o].shape.nbytes for o in ins.operands if o in table)
        return self.device.op_time(mm, ew, nbytes, ins.shape.dtype), mm + ew

    def _nested(self, ins: Instr) -> tuple[float, _Totals]:
        """Duration and totals of a while/conditional/call, simulated on its own."""
        called = [c for c in ins.called() if c in self.comps]
        tot = _Totals()
        if not called:
            return 0.0, tot
        if ins.opcode == "while":
            body = _body_of(ins, called)
            span, sub = self.run(body)
            trips = _trip_count(ins)
            tot.add(sub, trips)
            return span * trips, tot
        if ins.opcode == "conditional":
            runs = [self.run(c) for c in called]
            span, sub = max(runs, key=lambda r: r[0])     # charge the longest branch
            tot.add(sub)
            return span, tot
        span, sub = self.run(called[0])
        tot.add(sub)
        return span, tot

    def run(self, name: str) -> tuple[float, _Totals]:
        import heapq

        comp = self.comps[name]
        table = comp.table()
        instrs = comp.instrs
        index = {ins.name: i for i, ins in enumerate(instrs)}
        ops = [sorted({index[o] for o in ins.operands if o in index}) for ins in instrs]
        users: list[list[int]] = [[] for _ in instrs]
        for i, deps in enumerate(ops):
            for d in deps:
                users[d].append(i)
        is_coll = [ins.opcode.removesuffix("-start") in COLLECTIVES and not ins.opcode.endswith("-done")
                   for ins in instrs]
        feeds = [False] * len(instrs)          # transitive producers of a collective
        stack = [i for i, c in enumerate(is_coll) if c]
        while stack:
            for d in ops[stack.pop()]:
                if not feeds[d]:
                    feeds[d] = True
                    stack.append(d)
        tot = _Totals()
        done = [math.nan] * len(instrs)
        missing = [len(d) for d in ops]
        ready_at = [0.0] * len(instrs)
        compute_free, comm_free, link_free = 0.0, [0.0] * self.streams, [0.0]
        pending: list = []      # (ready, order key, i) for ops that need the compute stream

        def key(i):
            return (0 if feeds[i] else 1, i) if self.overlap else (0, i)

        def finish(i, t):
            done[i] = t
            for u in users[i]:
                missing[u] -= 1
                ready_at[u] = max(ready_at[u], t)
                if missing[u] == 0:
                    became_ready(u)

        def became_ready(i):
            nonlocal comm_free
            ins = instrs[i]
            r = ready_at[i]
            if ins.opcode in _FREE or ins.opcode.endswith("-done"):
                finish(i, r)
            elif is_coll[i] and self.overlap:
                base = ins.opcode.removesuffix("-start")
                nbytes = _collective_bytes(ins, table)
                lat, bw = self.net.collective_parts(base, nbytes, self.ranks(ins))
                tot.collective(ins, base, nbytes, self.ranks(ins), lat, bw)
                k = int(np.argmin(comm_free))
                start = max(r, comm_free[k])
                end = max(start + lat, link_free[0]) + bw    # one network: bandwidth is not additive
                link_free[0] = comm_free[k] = end
                finish(i, end)
            else:
                heapq.heappush(pending, (r, key(i), i))

        for i in range(len(instrs)):
            if missing[i] == 0:
                became_ready(i)
        waiting: list = []      # ops ready by compute_free, ordered by key
        while pending or waiting:
            if not self.overlap:
                horizon = math.inf           # one stream: everything ready is ready by compute_free
            elif waiting or not pending:
                horizon = compute_free
            else:
                horizon = max(compute_free, pending[0][0])
            while pending and pending[0][0] <= horizon:
                r, k, i = heapq.heappop(pending)
                heapq.heappush(waiting, (k, r, i))
            k, r, i = heapq.heappop(waiting)
            ins = instrs[i]
            start = max(r, compute_free)
            if is_coll[i]:           # overlap=False: the collective blocks the stream
                base = ins.opcode.removesuffix("-start")
                nbytes = _collective_bytes(ins, table)
                lat, bw = self.net.collective_parts(base, nbytes, self.ranks(ins))
                tot.collective(ins, base, nbytes, self.ranks(ins), lat, bw)
                t = lat + bw
            elif ins.opcode in ("while", "conditional", "call"):
                t, sub = self._nested(ins)
                tot.add(sub)
            else:
                t, fl = self._compute_cost(ins, table)
                tot.compute_s += t
                tot.flops += fl
            compute_free = start + t
            finish(i, compute_free)
        end = max([compute_free, *comm_free, *[d for d in done if not math.isnan(d)]], default=0.0)
        return end, tot


def _body_of(ins: Instr, called: list[str]) -> str:
    m = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else called[-1]


def predict(hlo_text: str, device: DeviceModel = H100, net: NetworkModel | None = None, *,
            program_devices: int = 8, comm_streams: int = 1, overlap: bool = True) -> Prediction:
    """Predicted step time of a compiled per-device program on `device` × `net` (see module doc)."""
    comps = parse_hlo(hlo_text)
    sim = _Sim(comps, device, net or network(), program_devices, comm_streams, overlap)
    step, tot = sim.run(entry(comps).name)
    return Prediction(step, tot.compute_s, tot.comm_s(comm_streams if overlap else 1), tot.flops, tot.collectives)


def check_flops(compiled: Any) -> dict[str, float]:
    """Our FLOP count of a compiled program next to XLA's own `cost_analysis()`."""
    ours = program_flops(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost.get("flops", 0.0))
    return {**ours, "xla_flops": xla, "ratio": ours["flops"] / xla if xla else math.nan}
