"""Scale evidence without hardware: the host planner on abstract device grids, workload mixes from
published statistics, a step-time model of the joint step, and the baselines users run today.

Planning (`plan_step_hosts`, the plan one host makes for one step, from metadata only):
  global, identical on every host (O(samples · log hosts)):
    G1 samples -> host groups (the hosts that hold the same LLM batch shards), LPT by LLM cost
       with a token capacity per group (`routing.lpt_rounds`: LPT dealt in vectorized rounds);
    G2 encoder segments -> hosts, LPT by encoder cost (`routing.lpt_rounds`), independently of G1
       (decoupled: a segment is encoded wherever there is room, its outputs travel to its LLM row);
  local, only the host's own devices (O(samples / hosts)):
    L1 the group's samples -> its batch shards' rows and microbatches (`omnijax.data.balance.plan_step`);
    L2 rows -> batch shards by LLM cost (`routing.shard_rows`, `balance_rows`' greedy);
    L3 the host's segments -> its 8 devices with long-short SP (`routing.place_segments`,
       `build_plan`'s placement: capacity search, esp groups inside the host), then the second pass
       `placement_meta.refine_assignment` (local moves, splits and swaps inside the capacities);
  ahead, per window: the capacities every host fits, grown a bucket where balance needs room and
  gains more than the padding costs (`fit_balanced_capacities`).
On one host (8 devices) G1/G2 are the identity and L2/L3 (without the second pass) are exactly
`balance_rows` / `build_plan`'s placement (tests/test_scale.py checks it against the packed-batch planner).

Step-time model (`StepModel`): per device, encoder and LLM compute = cost-model FLOPs / (peak ×
efficiency); the routing all-to-all = its bytes over NVLink (same host) or the network (other hosts);
pipeline bubbles = (M + pp − 1)/M; FSDP/encoder collectives = ring bytes over the network. The
all-to-all is a barrier, so the step is max(encoder) + max(all-to-all) + max(LLM) + collectives over
devices (the slowest device of each phase), never the mean. `cpu_mode=True` sums work over devices
instead (8 fake devices share 2 cores: time follows total work) for the calibration against
`bench omni`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from omnijax.data import balance
from omnijax.errors import ConfigError
from omnijax.parallel import placement_meta, routing
from omnijax.parallel.device_grid import DeviceGrid
from omnijax.parallel.encoder_placement import BUCKET_GROWTH, Segment, _bucket

# ---------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """One table of the constants the model uses (sources in /tmp/readme_scale.md / README)."""

    name: str
    peak_flops: float          # dense bf16 FLOP/s per GPU
    efficiency: float          # achieved fraction of peak (MFU-like) for encoder and LLM compute
    nvlink_Bps: float          # per GPU per direction, inside a host of 8
    net_Bps: float             # per GPU (one NIC each), between hosts
    nvlink_latency_s: float = 3e-6
    net_latency_s: float = 10e-6
    gpus_per_host: int = 8


HARDWARE = {
    # H100 SXM: 989 TFLOP/s dense bf16, NVLink4 900 GB/s bidirectional (450 per direction), one 400 Gb/s
    # NDR NIC per GPU (50 GB/s); 40% of peak is the MFU Llama-3 reports at 16k GPUs (38-43%).
    "h100": Hardware("H100-SXM bf16", 989e12, 0.40, 450e9, 50e9),
    # H200 SXM: the same compute peak and links, more and faster HBM (141 GB, 4.8 TB/s); same efficiency.
    "h200": Hardware("H200-SXM bf16", 989e12, 0.40, 450e9, 50e9),
}


# ---------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """An LLM mesh shape that grows with N along fsdp (weak scaling), plus the encoder view's esp."""

    name: str
    pp: int
    tp: int
    ep: int = 1
    cp: int = 1
    esp: int = 1
    microbatches: int = 1
    rows_per_device: float = 2.0     # omni_8b on 64 GPUs: 128 rows of 4096 tokens
    row_len: int = 4096
    llm_params: float = 8.0e9        # parameters held (sharded) by the LLM mesh
    enc_params: float = 0.5e9
    embed_dim: int = 4096
    moe_top_k: int = 0               # MoE: expert all-to-all of top_k copies of every token per layer
    moe_layers: int = 0

    def grid(self, devices: int) -> routing.DeviceGrid:
        inner = self.pp * self.tp * self.ep * self.cp
        if devices % inner or devices % 8:
            raise ConfigError(f"layout {self.name}: {devices} devices do not split into pp*tp*ep*cp={inner} "
                              "and hosts of 8")
        return routing.DeviceGrid((self.pp, 1, devices // inner, self.ep, self.cp, self.tp), self.esp)

    def host_grid(self) -> routing.DeviceGrid:
        """The 8 devices of one host: the innermost axes of the flattened mesh order (tp, cp, ep, then fsdp)."""
        sizes, room = [1] * 6, 8
        for a in (5, 4, 3, 2):   # tp, cp, ep, fsdp (MESH_AXES order pp, dp, fsdp, ep, cp, tp)
            n = (self.tp, self.cp, self.ep, 8)[(5, 4, 3, 2).index(a)]
            take = math.gcd(n, room) if a != 2 else room
            sizes[a], room = take, room // take
        if room != 1:
            raise ConfigError(f"layout {self.name}: cannot form a host of 8 from its inner axes")
        return routing.DeviceGrid(tuple(sizes), self.esp)

    def shards(self, devices: int) -> int:
        return self.grid(devices).batch_shards


# ----------------------------------------------------------------------------- workload mixes
# Every number below is stated with its source in the README text (section "Scale evidence").
PATCH = 14                        # SigLIP-so400m/14 patches (omni_8b's vision encoder)
VIDEO_FPS = 2.0                   # omnijax media.video_fps default (Qwen2-VL samples video at 2 fps)
MEL_FPS = 100                     # Whisper log-mel frames per second (10 ms hop), omni_8b audio rows


@dataclass(frozen=True)
class Mix:
    name: str
    phases: tuple[dict[str, float], ...]   # modality shares per phase (the run walks through them)
    note: str = ""


MIXES = {
    "image": Mix("image", ({"image": 0.7, "text": 0.3}, {"image": 0.5, "video": 0.1, "text": 0.4},
                           {"image": 0.85, "text": 0.15}),
                 "native-resolution images 224-896 px a side -> 256-4,096 patches (NaViT, Qwen2-VL)"),
    "video": Mix("video", ({"video": 0.6, "image": 0.2, "text": 0.2}, {"video": 0.3, "image": 0.4, "text": 0.3},
                           {"video": 0.8, "text": 0.2}),
                 "clips 2-60 s at 2 fps, 224-448 px frames, temporal patch 2 -> up to ~15k patches (LLaVA-Video-178K)"),
    "audio_text": Mix("audio_text", ({"audio": 0.5, "text": 0.5}, {"audio": 0.2, "text": 0.8},
                                     {"audio": 0.6, "image": 0.1, "text": 0.3}),
                      "speech 1-30 s (LibriSpeech, Whisper's 30 s window) and long text up to 4k tokens"),
}


@dataclass
class StepMeta:
    """One global batch as metadata: per sample its encoder (or ''), encoder input rows and LLM tokens."""

    encoder: np.ndarray     # [S] object: "vision", "audio" or ""
    enc_rows: np.ndarray    # [S] int
    llm_tokens: np.ndarray  # [S] int (text + encoder output tokens)

    def __len__(self) -> int:
        return len(self.llm_tokens)


def _lognormal(rng, median, sigma, lo, hi, n):
    return np.clip(rng.lognormal(math.log(median), sigma, n), lo, hi)


def media_draws(mod: str, c: int, rng: np.random.Generator, row_len: int = 4096) -> dict[str, np.ndarray]:
    """The raw quantities of c samples of one modality, in the units a record's metadata has (pixels,
    seconds, text tokens): `image` h, w px; `video` seconds and a frame side in px; `audio` seconds;
    every modality its text tokens. The one statement of the mixes' distributions (docs/scale.md cites
    their sources): `_draw` turns them into rows here, `bench plan` into records' metadata."""
    if mod == "image":      # side lengths log-uniform in 224..896 px (aspect ratio free)
        h = np.exp(rng.uniform(math.log(224), math.log(896), c))
        w = np.exp(rng.uniform(math.log(224), math.log(896), c))
        return {"h": h, "w": w, "text": _lognormal(rng, 120, 0.8, 8, 1024, c)}
    if mod == "video":      # duration lognormal (median 20 s, 2-60 s), square frames 224..448 px
        dur = _lognormal(rng, 20, 0.8, 2, 60, c)
        side = np.exp(rng.uniform(math.log(224), math.log(448), c))
        return {"seconds": dur, "side": side, "text": _lognormal(rng, 100, 0.8, 8, 512, c)}
    if mod == "audio":      # utterance 1-30 s (LibriSpeech mean 12.3 s); prompt + transcript (~3 tokens/s)
        dur = _lognormal(rng, 10, 0.6, 1, 30, c)
        return {"seconds": dur, "text": _lognormal(rng, 60, 0.6, 8, 512, c) + dur * 3.0}
    if mod == "text":       # long documents / long SFT: median 1,000 tokens, up to a row
        return {"text": _lognormal(rng, 1000, 1.0, 32, row_len, c)}
    raise ConfigError(f"unknown modality {mod!r} in a mix; known: image, video, audio, text")


def _draw(mod: str, c: int, rng: np.random.Generator, row_len: int, red: dict[str, int]):
    """(encoder, input rows, LLM tokens) of c samples of one modality (`media_draws`' distributions)."""
    d = media_draws(mod, c, rng, row_len)
    text = d["text"]
    if mod == "image":      # patches of 14 px, 2x2 merge
        rows = ((d["h"] // (2 * PATCH) * 2) * (d["w"] // (2 * PATCH) * 2)).astype(np.int64)
        enc = "vision"
    elif mod == "video":    # 2 fps, tubes of 2 frames, whole tubes that fit one LLM row
        per = (d["side"] // (2 * PATCH) * 2) ** 2
        fit = np.floor((row_len - text) * red["vision"] / per)
        rows = (np.minimum(np.ceil(d["seconds"] * VIDEO_FPS / 2), fit) * per).astype(np.int64)
        enc = "vision"
    elif mod == "audio":    # 100 mel frames/s
        rows = (np.round(d["seconds"] * MEL_FPS / red["audio"]) * red["audio"]).astype(np.int64)
        enc = "audio"
    else:
        rows = np.zeros(c, np.int64)
        enc = ""
    tokens = np.minimum(text.astype(np.int64) + rows // red.get(enc, 1), row_len)
    return enc, rows, tokens


def sample_step(mix: Mix, phase: int, tokens: int, rng: np.random.Generator, row_len: int = 4096,
                reductions: dict[str, int] | None = None) -> StepMeta:
    """Samples of one global batch, in arrival order, until `tokens` LLM tokens (metadata only)."""
    red = reductions or {"vision": 4, "audio": 4}
    shares = mix.phases[phase % len(mix.phases)]
    mods = list(shares)
    p = np.array([shares[m] for m in mods], np.float64)
    p /= p.sum()
    E, R, T = [], [], []
    total = 0
    while total < tokens:
        n = max(64, int((tokens - total) / 600))
        kind = rng.choice(len(mods), n, p=p)
        enc = np.empty(n, object)
        rows = np.zeros(n, np.int64)
        tok = np.zeros(n, np.int64)
        for k, m in enumerate(mods):
            idx = np.flatnonzero(kind == k)
            if idx.size:
                enc[idx], rows[idx], tok[idx] = _draw(m, idx.size, rng, row_len, red)
        stop = min(n, int(np.searchsorted(total + np.cumsum(tok), tokens, side="left")) + 1)
        E.append(enc[:stop]), R.append(rows[:stop]), T.append(tok[:stop])
        total += int(tok[:stop].sum())
    return StepMeta(np.concatenate(E), np.concatenate(R), np.concatenate(T))


# ------------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class Costs:
    """Cost-model coefficients (MFLOP of training per span) and encoder reductions."""

    llm: tuple[float, float]
    encoders: dict[str, tuple[float, float]]
    reductions: dict[str, int]

    @classmethod
    def from_mm(cls, mm_cfg) -> "Costs":
        from omnijax.data.cost import CostModel
        from omnijax.data.packing import encoder_specs

        cm = CostModel.from_flops(mm_cfg)
        return cls((cm.llm.a, cm.llm.b), {k: (v.a, v.b) for k, v in cm.encoders.items()},
                   {n: s.group for n, s in encoder_specs(mm_cfg).items()})

    def encoder_fn(self, name: str, rows: int) -> float:
        """The multiplexer's default cost: audio attends over its rows after the reduction."""
        a, b = self.encoders[name]
        n = rows // self.reductions[name] if name == "audio" else rows
        return float(a * n + b * n * n)

    def padding_cost(self, name: str, rows: int) -> float:
        """Cost of `rows` buffer rows that hold nothing: the per-row (linear) work, which a fixed-size
        buffer spends whether a row is real or not (masked attention skips the rest)."""
        a, _ = self.encoders[name]
        return float(a * rows / (self.reductions[name] if name == "audio" else 1))

    def encoder_cost(self, enc: np.ndarray, rows: np.ndarray) -> np.ndarray:
        out = np.zeros(len(rows))
        for name, (a, b) in self.encoders.items():
            m = enc == name
            n = rows[m] // self.reductions[name] if name == "audio" else rows[m]
            out[m] = a * n + b * n.astype(np.float64) ** 2
        return out

    def llm_cost(self, tokens: np.ndarray) -> np.ndarray:
        a, b = self.llm
        t = np.asarray(tokens, np.float64)
        return a * t + b * t * t


# ----------------------------------------------------------------------------- host planning
@dataclass
class HostPlan:
    """What one host plans for one step, plus the figures the model needs."""

    group_of_sample: np.ndarray          # G1: host group (LLM batch shards) of every sample, -1 dropped
    host_of_segment: np.ndarray          # G2: encoding host of every encoder segment
    segment_sample: np.ndarray           # sample index of every segment
    host_load: np.ndarray                # G2 encoder cost per host
    device_enc: dict[int, np.ndarray]    # L3 per planned host: encoder cost of its 8 devices
    caps: dict[int, dict]                # L3 capacities per planned host
    shard_llm: dict[int, np.ndarray]     # L1+L2 per planned group: LLM cost of its shards
    group_rows_tokens: dict[int, int]    # real LLM tokens per planned group
    seconds: dict[str, float] = field(default_factory=dict)
    dropped: int = 0

    def capacities(self) -> dict[str, int]:
        """The step's common capacities: per buffer the largest any planned host needs."""
        out: dict[str, int] = {}
        for c in self.caps.values():
            for k, v in c.items():
                out[k] = max(out.get(k, 0), v)
        return out


def host_groups(layout: Layout, devices: int) -> tuple[int, int, int]:
    """(hosts, host groups, shards per group): hosts holding the same batch shards form a group
    (they differ only in pp); the flattened mesh order puts pp outermost, so host h is in group h % groups."""
    hosts = devices // 8
    groups = hosts // layout.pp
    shards = layout.shards(devices)
    if shards % groups:
        raise ConfigError(f"layout {layout.name}: {shards} batch shards do not split over {groups} host groups")
    return hosts, groups, shards // groups


def plan_step_hosts(meta: StepMeta, layout: Layout, devices: int, costs: Costs, plan_hosts: list[int],
                    *, fill: float = 0.99, long_factor: float = 1.0, capacities: dict | None = None,
                    refine: bool = True, growth: float = routing.BUCKET_GROWTH) -> HostPlan:
    """The plan of one step from metadata: G1, G2 (global) and L1-L3 for `plan_hosts` (see module doc).

    `capacities` pins the encoder buffers (the window's, as the trainer's `size_window` does; a host
    whose segments do not fit them searches its own). `seconds`: wall time of each part, summed over
    the planned hosts, and `host_s`: the slowest planned host's G1 + G2 + own L1-L3."""
    hosts, groups, per_group = host_groups(layout, devices)
    rows_per_shard = int(round(layout.rows_per_device * devices / layout.shards(devices)))
    M = max(1, layout.microbatches)
    if rows_per_shard % M:
        raise ConfigError(f"layout {layout.name}: {rows_per_shard} rows per shard do not split into {M} microbatches")
    sec: dict[str, float] = {}
    enc_c = costs.encoder_cost(meta.encoder, meta.enc_rows)
    llm_c = costs.llm_cost(meta.llm_tokens)
    t0 = time.perf_counter()
    room = fill * per_group * rows_per_shard * layout.row_len
    # rows carry only LLM work (encoders are placed apart, G2), so samples are balanced by LLM cost
    group_of, _ = routing.lpt_rounds(llm_c, groups, sizes=meta.llm_tokens, room=room)
    sec["G1_samples_to_groups"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    seg = np.flatnonzero((meta.encoder != "") & (group_of >= 0))
    host_of, host_load = routing.lpt_rounds(enc_c[seg], hosts)
    sec["G2_segments_to_hosts"] = time.perf_counter() - t0
    hg = layout.host_grid()
    cap = balance.Capacity(rows_per_shard // M, layout.row_len)
    device_enc, caps, shard_llm, group_tokens = {}, {}, {}, {}
    sec.update({"L1_pack_rows": 0.0, "L2_balance_rows": 0.0, "L3_place_segments": 0.0})
    dropped = int((group_of < 0).sum())
    by_group = np.argsort(group_of, kind="stable")
    bounds = np.searchsorted(group_of[by_group], np.arange(groups + 1))
    by_host = np.argsort(host_of, kind="stable")
    hbounds = np.searchsorted(host_of[by_host], np.arange(hosts + 1))
    local = {h: 0.0 for h in plan_hosts}
    for h in plan_hosts:
        g = h % groups
        if g not in shard_llm:
            t0 = time.perf_counter()
            mine = by_group[bounds[g]:bounds[g + 1]]
            items = [balance.Item(int(i), float(llm_c[i]), int(meta.llm_tokens[i])) for i in mine]
            plan = balance.plan_step(items, per_group, M, cap)
            rows: list[list[int]] = []
            for b in plan.bins:
                docs = [[] for _ in range(cap.rows)]
                for key, r in b:
                    docs[r].append(int(meta.llm_tokens[key]))
                rows += docs
            dropped += len(plan.unplaced)
            t1 = time.perf_counter()
            _, loads = routing.shard_rows(routing.row_costs_from_lengths(rows, costs.llm), per_group)
            t2 = time.perf_counter()
            sec["L1_pack_rows"] += t1 - t0
            sec["L2_balance_rows"] += t2 - t1
            local[h] += t2 - t0
            shard_llm[g] = loads
            group_tokens[g] = int(sum(sum(r) for r in rows))
        t0 = time.perf_counter()
        ids = seg[by_host[hbounds[h]:hbounds[h + 1]]]
        segs = routing.segments_from_metadata(list(meta.encoder[ids]), meta.enc_rows[ids], costs.reductions,
                                              costs.encoder_fn)
        device_enc[h], caps[h] = np.zeros(8), {}
        if segs:
            kw = dict(long_short=hg.esp > 1, long_factor=long_factor, growth=growth)
            names = {s.encoder for s in segs}
            pins = {k: v for k, v in (capacities or {}).items() if k.rsplit("_", 1)[0] in names}
            try:
                a, c = routing.place_segments(segs, hg, costs.reductions, capacities=pins, **kw)
            except ConfigError:   # this host outgrew the window's capacities: its own search
                a, c = routing.place_segments(segs, hg, costs.reductions, **kw)
            if refine:   # the second pass: local moves inside the capacities (`placement_meta`)
                a = placement_meta.refine_assignment(a, segs, hg, c, splittable=hg.esp > 1)
            device_enc[h], caps[h] = a.device_cost, c
        local[h] += time.perf_counter() - t0
        sec["L3_place_segments"] += time.perf_counter() - t0
    sec["host_s"] = sec["G1_samples_to_groups"] + sec["G2_segments_to_hosts"] + max(local.values(), default=0.0)
    return HostPlan(group_of, host_of, seg, host_load, device_enc, caps, shard_llm, group_tokens, sec, dropped)


def hosts_to_plan(host_load: np.ndarray, groups: int, group_load: np.ndarray, top: int = 24,
                  random: int = 8, seed: int = 0, heavy: np.ndarray | None = None) -> list[int]:
    """Hosts whose local plans decide the figures: all of them up to 128 hosts; beyond, the most
    loaded by encoder cost, those of the most loaded groups, the hosts of the `heavy` segments (the
    costliest: they set the max where they cannot be split finely enough), and a few random ones (the
    max over devices lies on such a host; the mean is known exactly from the totals)."""
    H = len(host_load)
    if H <= 128:
        return list(range(H))
    pp = H // groups
    pick = set(np.argsort(-host_load, kind="stable")[:top].tolist())
    for g in np.argsort(-group_load, kind="stable")[:top // 2].tolist():
        pick.update(g + s * groups for s in range(pp))
    if heavy is not None:
        pick.update(np.asarray(heavy).tolist())
    pick.update(np.random.default_rng(seed).choice(H, random, replace=False).tolist())
    return sorted(int(h) for h in pick)


# ---------------------------------------------------------------------------- step-time model
def shared_cores_s(work, cores: float, wait_cost: float = 0.0) -> float:
    """Wall seconds of one barrier-separated phase on fake devices that share `cores` CPU cores:
    device d must do `work[d]` seconds of single-core work, then waits at the phase's collective.

    How XLA:CPU runs a multi-device step: every device's program is a thread; the operating system
    shares the cores among the runnable threads (processor sharing), and a device that has finished
    waits at the collective's rendezvous, costing `wait_cost` of a runnable thread (0: it sleeps and
    frees its share; 1: it spins as hard as a working thread). While `a` devices work and `w` wait,
    each working one progresses at min(1, cores / (a + wait_cost·w)); the phase ends when the last
    one finishes. `wait_cost` = 0 gives max(Σ work / cores, max work) for equal works, 1 gives
    max work × devices / cores: the sum and the slowest-device aggregation are its two ends."""
    w = np.sort(np.atleast_1d(np.asarray(work, np.float64)))
    n = w.size
    if n == 0 or cores <= 0:
        return 0.0
    t, done = 0.0, 0.0
    for k in range(n):                       # devices finish in order of their work
        step = w[k] - done
        if step <= 0:
            continue
        active, waiting = n - k, k
        rate = min(1.0, cores / (active + wait_cost * waiting))
        t += step / rate
        done = w[k]
    return float(t)


@dataclass
class Phases:
    """Seconds per device of each phase of one step. The routing all-to-all is a collective over all
    devices, so encoders, all-to-all and LLM are separated by barriers: each phase lasts as long as
    its slowest device. `overlapped` (disaggregated): encoder and LLM devices are disjoint and run
    the two phases of consecutive steps at once, so the step is the slower of the two."""

    enc: np.ndarray
    route: np.ndarray
    llm: np.ndarray
    fixed: float = 0.0            # collectives and other per-step time every device spends
    overlapped: bool = False

    def step_s(self, cpu_mode: bool = False, cores: float | None = None, wait_cost: float = 0.0) -> float:
        """GPU mode: the slowest device of each phase. CPU mode (fake devices sharing cores): without
        `cores`, the sum of every device's work (what a CPU run's wall time follows when no device
        waits); with `cores`, each phase as `shared_cores_s` runs it on that many cores, a waiting
        device costing `wait_cost` of a working one (the calibration measures it, `mesh_probe`)."""
        enc, route, llm = (np.atleast_1d(np.asarray(x, np.float64)) for x in (self.enc, self.route, self.llm))
        if cpu_mode and cores is not None:
            return float(sum(shared_cores_s(x, cores, wait_cost) for x in (enc, route, llm)) + self.fixed)
        if cpu_mode:
            return float(enc.sum() + route.sum() + llm.sum() + self.fixed)
        if self.overlapped:
            return float(max(enc.max(), llm.max()) + route.max() + self.fixed)
        return float(enc.max() + route.max() + llm.max() + self.fixed)


@dataclass(frozen=True)
class StepModel:
    """Seconds from cost-model MFLOP and bytes, for one layout on one hardware table entry."""

    hw: Hardware
    layout: Layout
    bytes_per_value: int = 2      # bf16 activations and parameters on the wire

    def compute_s(self, mflop) -> np.ndarray:
        return np.asarray(mflop, np.float64) * 1e6 / (self.hw.peak_flops * self.hw.efficiency)

    @property
    def bubble(self) -> float:
        """GPipe/1F1B bubble: a stage is busy M of M + pp − 1 slots."""
        lay = self.layout
        m = max(1, lay.microbatches)
        return (m + lay.pp - 1) / m

    def llm_device_s(self, shard_mflop) -> np.ndarray:
        """A batch shard's LLM work is split over its pp·tp·cp devices; the pipeline adds its bubble."""
        lay = self.layout
        return self.compute_s(shard_mflop) / (lay.pp * lay.tp * lay.cp) * self.bubble

    def token_bytes(self) -> int:
        return self.layout.embed_dim * self.bytes_per_value

    def route_s(self, tokens, inter_fraction: float) -> np.ndarray:
        """All-to-all of `tokens` encoder outputs (per device): NVLink inside the host, NIC across."""
        b = np.asarray(tokens, np.float64) * self.token_bytes()
        return b * (inter_fraction / self.hw.net_Bps + (1 - inter_fraction) / self.hw.nvlink_Bps)

    def collectives_s(self, llm_devices: int, enc_devices: int, tokens_per_device: float) -> float:
        """Per-step collectives, assumed not overlapped with compute (an upper bound, the same for every
        variant on the same devices): FSDP all-gather (forward, backward) + reduce-scatter of the LLM
        over its fsdp group and of the encoders over their devices (ring: each GPU moves (n−1)/n of the
        shard group's bytes over its NIC); pipeline activations between stages (NIC); MoE dispatch and
        combine all-to-alls inside the host (ep ≤ 8, NVLink), forward and twice in backward."""
        lay, hw, B = self.layout, self.hw, self.bytes_per_value
        f = max(1, llm_devices // (lay.pp * lay.tp * lay.ep * lay.cp))
        t = 3 * lay.llm_params / (lay.pp * lay.tp * lay.ep) * B * (f - 1) / f / hw.net_Bps
        t += 2 * math.log2(max(f, 2)) * hw.net_latency_s
        if enc_devices > 1:
            t += 3 * lay.enc_params * B * (enc_devices - 1) / enc_devices / hw.net_Bps
        if lay.pp > 1:   # activations forward + gradients backward across each stage boundary, per tp rank
            t += 2 * tokens_per_device * lay.pp / lay.tp * self.token_bytes() / hw.net_Bps * (lay.pp - 1) / lay.pp
        if lay.moe_top_k:
            t += 2 * 3 * lay.moe_layers * tokens_per_device * lay.moe_top_k * self.token_bytes() / hw.nvlink_Bps
        return t


# ------------------------------------------------------------------------- variants on one step
def arrival_shards(tokens: np.ndarray, shards: int) -> np.ndarray:
    """The baselines' data path: samples in arrival order, each shard an equal run of tokens (no
    cost awareness; perfect token packing, which flatters them: no padding)."""
    before = np.cumsum(tokens) - tokens
    return np.minimum((before * shards // max(int(tokens.sum()), 1)).astype(np.int64), shards - 1)


def disaggregated_fraction(meta: StepMeta, costs: Costs, model: StepModel) -> float:
    """The encoder share of compute time on a profiled step (DistTrain sizes its encoder group from
    a profile once; it stays fixed while the mix changes)."""
    e = model.compute_s(costs.encoder_cost(meta.encoder, meta.enc_rows)).sum()
    llm = model.compute_s(costs.llm_cost(meta.llm_tokens)).sum() * model.bubble
    return float(e / (e + llm))


def coupled_phases(meta: StepMeta, layout: Layout, devices: int, costs: Costs, model: StepModel, fixed: float,
                   replicate: bool = False) -> Phases:
    """Coupled (Megatron-style): a sample's encoder work runs on pipeline stage 0 of its batch shard
    (arrival data path), split evenly over that stage's tp·cp devices as Megatron shards its ViT over
    the tensor-parallel group (no replicated work); other stages hold no encoder work and wait at the
    barrier. `replicate`: every tp/cp rank of stage 0 encodes the shard's whole set (encoders
    replicated inside the LLM mesh). No routing all-to-all: outputs are already where the LLM needs them."""
    lay = layout
    grid = lay.grid(devices)
    shards = grid.batch_shards
    a_shard = arrival_shards(meta.llm_tokens, shards)
    enc_shard = np.bincount(a_shard, weights=costs.encoder_cost(meta.encoder, meta.enc_rows), minlength=shards)
    llm_shard = np.bincount(a_shard, weights=costs.llm_cost(meta.llm_tokens), minlength=shards)
    stage0 = grid.axis("pp") == 0
    split = 1 if replicate else lay.tp * lay.cp
    enc = np.where(stage0, model.compute_s(enc_shard[grid.batch_shard()]) / split, 0.0)
    return Phases(enc, np.zeros(1), model.llm_device_s(llm_shard), fixed)


def disaggregated_phases(meta: StepMeta, layout: Layout, devices: int, costs: Costs, model: StepModel,
                         enc_fraction: float, llm_imbalance: float = 1.0) -> tuple[Phases, int]:
    """Disaggregated (DistTrain-style): a fixed share of whole hosts runs only the encoders (whole
    segments, LPT over those devices), the rest only the LLM (same layout shape, smaller fsdp); the two
    groups work on consecutive steps at once (pipelined), so the step is the slower group; every encoder
    output crosses hosts; the share is sized once from a profile and stays fixed. Returns (phases,
    encoder devices); phases.enc holds the encoder devices, phases.llm the LLM devices."""
    lay = layout
    hosts = devices // 8
    n_enc = int(min(hosts - 1, max(1, round(enc_fraction * hosts)))) * 8
    n_llm = devices - n_enc
    enc_c = costs.encoder_cost(meta.encoder, meta.enc_rows)
    seg = np.flatnonzero(meta.encoder != "")
    _, dis_enc = routing.lpt_rounds(enc_c[seg], n_enc)
    llm_total = costs.llm_cost(meta.llm_tokens).sum()
    llm_dev = model.llm_device_s(llm_total / (n_llm / (lay.pp * lay.tp * lay.cp)) * llm_imbalance)
    red = np.array([costs.reductions.get(e, 1) for e in meta.encoder])
    out_tok = np.where(meta.encoder != "", meta.enc_rows // red, 0).sum()
    route = model.route_s(out_tok / n_llm * lay.tp * lay.cp, 1.0)
    return Phases(model.compute_s(dis_enc), np.atleast_1d(route), np.full(n_llm, float(llm_dev)),
                  model.collectives_s(n_llm, n_enc, meta.llm_tokens.sum() / n_llm), overlapped=True), n_enc


def global_lpt_phases(meta: StepMeta, layout: Layout, devices: int, costs: Costs, model: StepModel,
                      fixed: float) -> tuple[Phases, float, float]:
    """Global greedy balancing (VeOmni / MindSpeed-MM style): every step all ranks all-gather the
    samples' lengths, then one greedy assigns whole samples (encoder and text together) to batch
    shards by total cost; a shard's encoder work is spread over its pp·tp·cp devices, but a segment is
    indivisible (no sequence parallelism for long ones). The all-gather and the greedy (timed here)
    sit on the critical path. Returns (phases, all-gather s, greedy s)."""
    lay, hw = layout, model.hw
    shards = lay.shards(devices)
    rows_per_shard = int(round(lay.rows_per_device * devices / shards))
    enc_c = costs.encoder_cost(meta.encoder, meta.enc_rows)
    llm_c = costs.llm_cost(meta.llm_tokens)
    t0 = time.perf_counter()
    g_shard, _ = routing.lpt_rounds(enc_c + llm_c, shards, sizes=meta.llm_tokens, room=rows_per_shard * lay.row_len)
    greedy_s = time.perf_counter() - t0
    ok = g_shard >= 0
    g_enc = np.bincount(g_shard[ok], weights=enc_c[ok], minlength=shards)
    g_big = np.zeros(shards)
    np.maximum.at(g_big, g_shard[ok], enc_c[ok])
    g_llm = np.bincount(g_shard[ok], weights=llm_c[ok], minlength=shards)
    span = lay.pp * lay.tp * lay.cp
    gather_s = math.log2(devices) * hw.net_latency_s + len(meta) * 16 / hw.net_Bps
    ph = Phases(model.compute_s(np.maximum(g_enc / span, g_big)), np.zeros(1), model.llm_device_s(g_llm),
                fixed + gather_s + greedy_s)
    return ph, gather_s, greedy_s


def evaluate(meta: StepMeta, hp: HostPlan, layout: Layout, devices: int, costs: Costs, model: StepModel,
             enc_fraction: float) -> dict:
    """omnijax's figures for one planned step and the modeled step time of every variant on it."""
    lay = layout
    hosts, groups, per_group = host_groups(layout, devices)
    shards = layout.shards(devices)
    rows_per_shard = int(round(layout.rows_per_device * devices / shards))
    enc_c = costs.encoder_cost(meta.encoder, meta.enc_rows)
    llm_c = costs.llm_cost(meta.llm_tokens)
    red = np.array([costs.reductions.get(e, 1) for e in meta.encoder])
    out_tok = np.where(meta.encoder != "", meta.enc_rows // red, 0)
    placed = hp.group_of_sample >= 0
    tokens_per_device = meta.llm_tokens.sum() / devices
    fixed = model.collectives_s(devices, devices, tokens_per_device)

    # ---- omnijax: decoupled encoders (G2 + L3), rows balanced (G1 + L1 + L2)
    dev_enc = np.concatenate([hp.device_enc[h] for h in sorted(hp.device_enc)])
    enc_mean = enc_c[hp.segment_sample].sum() / devices
    shard_llm = np.concatenate([hp.shard_llm[g] for g in sorted(hp.shard_llm)])
    llm_mean = llm_c[placed].sum() / shards
    caps = hp.capacities()
    enc_real = int(meta.enc_rows[hp.segment_sample].sum())
    enc_computed = devices * sum(caps.values())
    llm_real = int(meta.llm_tokens[placed].sum())
    llm_computed = shards * rows_per_shard * layout.row_len
    # routing bytes: a segment's outputs go to the tp·cp devices of its shard in every pp stage's host
    seg_group = hp.group_of_sample[hp.segment_sample]
    seg_tok = out_tok[hp.segment_sample].astype(np.float64)
    local = (hp.host_of_segment % groups) == seg_group      # encoded on one of its receiving hosts
    per_host = lay.tp * lay.cp
    total_b = seg_tok.sum() * per_host * lay.pp
    inter_b = (seg_tok * per_host * (lay.pp - local)).sum()
    inter = float(inter_b / total_b) if total_b else 0.0
    recv = np.array([out_tok[(hp.group_of_sample == g)].sum() for g in sorted(hp.shard_llm)]) / per_group
    host_tok = np.bincount(hp.host_of_segment, weights=seg_tok, minlength=hosts)
    send_tok = host_tok[sorted(hp.device_enc)] / 8 * lay.pp * per_host
    omni = Phases(model.compute_s(dev_enc), np.maximum(model.route_s(recv.max(initial=0), inter),
                                                       model.route_s(send_tok.max(initial=0), inter)),
                  model.llm_device_s(shard_llm), fixed)

    coupled = coupled_phases(meta, layout, devices, costs, model, fixed)
    replicated = coupled_phases(meta, layout, devices, costs, model, fixed, replicate=True)
    llm_shard = np.bincount(arrival_shards(meta.llm_tokens, shards), weights=llm_c, minlength=shards)
    llm_imb = float(llm_shard.max() / llm_shard.mean()) if llm_shard.mean() > 0 else 1.0
    disagg, n_enc = disaggregated_phases(meta, layout, devices, costs, model, enc_fraction, llm_imb)
    glpt, gather_s, greedy_s = global_lpt_phases(meta, layout, devices, costs, model, fixed)

    # the best any placement of these samples can do on these devices: every encoder's work spread evenly
    # (no padding, no straggler, no all-to-all) and the LLM rows perfectly balanced; against coupled this is
    # the Amdahl bound of decoupling on the mix (coupled's LLM phase and collectives stay)
    ideal = Phases(np.atleast_1d(model.compute_s(enc_c[hp.segment_sample].sum() / devices)), np.zeros(1),
                   model.llm_device_s(np.atleast_1d(llm_mean)), fixed)
    steps = {"omnijax": omni.step_s(), "coupled": coupled.step_s(), "replicated": replicated.step_s(),
             "ideal": ideal.step_s(),
             "disaggregated": disagg.step_s(), "global_lpt": glpt.step_s(),
             "global_lpt_without_greedy": glpt.step_s() - greedy_s}
    # no placement does better: the costliest segment whole on one device, or over one esp group
    biggest = float(enc_c[hp.segment_sample].max(initial=0.0)) / max(layout.esp, 1)
    return {
        "enc_cost_max_over_mean": float(dev_enc.max() / enc_mean) if enc_mean > 0 else 1.0,
        "enc_cost_bound": max(1.0, biggest / enc_mean) if enc_mean > 0 else 1.0,
        "llm_cost_max_over_mean": float(shard_llm.max() / llm_mean) if llm_mean > 0 else 1.0,
        "padded_fraction": 1.0 - (enc_real + llm_real) / max(enc_computed + llm_computed, 1),
        "enc_padded_fraction": 1.0 - enc_real / max(enc_computed, 1),
        "llm_padded_fraction": 1.0 - llm_real / max(llm_computed, 1),
        "inter_host_bytes_fraction": inter,
        "dropped_samples": hp.dropped,
        "enc_rows_per_device": enc_real / devices,
        "llm_tokens_per_device": llm_real / devices,
        "enc_devices_disaggregated": n_enc,
        "step_s": steps,
        "omnijax_phases_s": {"encoder": float(omni.enc.max()), "route": float(np.max(omni.route)),
                             "llm": float(omni.llm.max()), "collectives": fixed},
        "coupled_phases_s": {"encoder": float(coupled.enc.max()), "llm": float(coupled.llm.max()),
                             "collectives": fixed},
        "global_lpt_critical_s": gather_s + greedy_s,
    }


def window_capacities(meta: StepMeta, glob: HostPlan, layout: Layout, costs: Costs, hosts: list[int],
                      slack: float = 1.0, long_factor: float = 1.0, balance_target: float | None = None,
                      growth: float = routing.BUCKET_GROWTH) -> dict:
    """Encoder capacities every listed host's segments fit, searched jointly (`routing.fit_segment_capacities`):
    what the trainer's window fit does ahead of the steps (prefetched, not per step). `slack` > 1 adds
    room (rounded to the reduction) so the cost-balancing placement fits instead of best fit.
    `balance_target`: grow buffers, a bucket at a time, while a host's refined placement leaves a device
    above target × the step's mean device cost (`fit_balanced_capacities`)."""
    hg = layout.host_grid()
    parts = []
    for h in hosts:
        ids = glob.segment_sample[glob.host_of_segment == h]
        if ids.size:
            parts.append(routing.segments_from_metadata(list(meta.encoder[ids]), meta.enc_rows[ids], costs.reductions,
                                                        costs.encoder_fn))
    if not parts:
        return {}
    if balance_target is not None:
        mean = float(glob.host_load.sum()) / (len(glob.host_load) * 8)
        caps, _ = fit_balanced_capacities(parts, hg, costs.reductions, mean, target=balance_target,
                                                         long_short=hg.esp > 1, long_factor=long_factor,
                                                         pad_cost=costs.padding_cost, growth=growth)
    else:
        caps = routing.fit_segment_capacities(parts, hg, costs.reductions, long_short=hg.esp > 1,
                                              long_factor=long_factor, growth=growth)
    red = lambda k: costs.reductions[k.rsplit("_", 1)[0]]  # noqa: E731
    return {k: int(math.ceil(v * slack / red(k)) * red(k)) for k, v in caps.items()}


# ------------------------------------------------------------------------------------ one row
# The layouts come from the recipes themselves (`recipes/bench/scale.py::recipe_layout`), never a copy here.
def scaling_row(layout: Layout, devices: int, mix: Mix, costs: Costs, model: StepModel, *, steps: int = 3,
                token_fill: float = 0.95, seed: int = 0, slack: float = 1.0, long_factor: float = 1.0,
                refine: bool = True, balance_target: float | None = 1.05,
                growth: float = routing.BUCKET_GROWTH) -> dict:
    """Weak scaling: `steps` steps walking through the mix's phases, each with the per-device work of
    the layout (rows_per_device rows of row_len tokens, `token_fill` of them real); the plan of every
    step as one host makes it, and the modeled step time of every variant on the same batches."""
    tokens = int(layout.rows_per_device * devices * layout.row_len * token_fill)
    profile = sample_step(mix, 0, tokens, np.random.default_rng(seed + 999))
    f_enc = disaggregated_fraction(profile, costs, model)
    hosts, groups, _ = host_groups(layout, devices)
    rows, plan_s, parts, window_s = [], [], {}, []
    for k in range(steps):
        meta = sample_step(mix, k * len(mix.phases) // steps, tokens, np.random.default_rng(seed + k))
        glob = plan_step_hosts(meta, layout, devices, costs, [])
        ok = glob.group_of_sample >= 0
        g_load = np.bincount(glob.group_of_sample[ok], weights=costs.llm_cost(meta.llm_tokens[ok]), minlength=groups)
        seg_c = costs.encoder_cost(meta.encoder[glob.segment_sample], meta.enc_rows[glob.segment_sample])
        heavy = glob.host_of_segment[np.argsort(-seg_c, kind="stable")[:8]]
        pick = hosts_to_plan(glob.host_load, groups, g_load, seed=seed + k, heavy=heavy)
        t0 = time.perf_counter()
        caps = window_capacities(meta, glob, layout, costs, pick, slack, long_factor,  # the window fit, ahead
                                 balance_target if refine else None, growth)
        window_s.append(time.perf_counter() - t0)
        hp = plan_step_hosts(meta, layout, devices, costs, pick, capacities=caps, long_factor=long_factor,
                             refine=refine, growth=growth)
        plan_s.append(hp.seconds["host_s"])
        for key, v in hp.seconds.items():
            parts[key] = parts.get(key, 0.0) + v / steps
        rows.append(evaluate(meta, hp, layout, devices, costs, model, f_enc))
    mean = lambda key: float(np.mean([r[key] for r in rows]))  # noqa: E731
    step = {v: float(np.mean([r["step_s"][v] for r in rows])) for v in rows[0]["step_s"]}
    out = {"variant": layout.name, "devices": devices, "mix": mix.name, "steps": steps,
           "plan_s_per_host": round(max(plan_s), 3),
           "window_fit_s": round(max(window_s), 3),
           "enc_cost_max_over_mean": round(max(r["enc_cost_max_over_mean"] for r in rows), 3),
           "enc_cost_bound": round(max(r["enc_cost_bound"] for r in rows), 3),
           "llm_cost_max_over_mean": round(max(r["llm_cost_max_over_mean"] for r in rows), 3),
           "padded_fraction": round(mean("padded_fraction"), 4),
           "inter_host_bytes_fraction": round(mean("inter_host_bytes_fraction"), 3),
           "modeled_step_s": round(step["omnijax"], 3)}
    for v in ("coupled", "replicated", "disaggregated", "global_lpt", "global_lpt_without_greedy"):
        out[f"speedup_vs_{v}"] = round(step[v] / step["omnijax"], 3)
    # what no placement can beat: coupled's step over the ideal one (encoders spread evenly, nothing padded,
    # no all-to-all, LLM rows balanced), and the share of coupled's step its encoder phase takes
    out["speedup_vs_coupled_bound"] = round(step["coupled"] / step["ideal"], 3)
    out["coupled_encoder_share"] = round(float(np.mean([r["coupled_phases_s"]["encoder"] / r["step_s"]["coupled"]
                                                         for r in rows])), 4)
    out["global_lpt_critical_s"] = round(float(np.mean([r["global_lpt_critical_s"] for r in rows])), 3)
    out["coupled_phases_s"] = {k: round(float(np.mean([r["coupled_phases_s"][k] for r in rows])), 4)
                               for k in rows[0]["coupled_phases_s"]}
    out.update({"enc_padded_fraction": round(mean("enc_padded_fraction"), 4),
                "llm_padded_fraction": round(mean("llm_padded_fraction"), 4),
                "dropped_samples": int(sum(r["dropped_samples"] for r in rows)),
                "enc_rows_per_device": round(mean("enc_rows_per_device")),
                "llm_tokens_per_device": round(mean("llm_tokens_per_device")),
                "disaggregated_enc_devices": rows[0]["enc_devices_disaggregated"],
                "modeled_step_s_baselines": {v: round(t, 3) for v, t in step.items() if v not in ("omnijax", "ideal")},
                "modeled_step_s_ideal": round(step["ideal"], 3),
                "omnijax_phases_s": {k: round(float(np.mean([r["omnijax_phases_s"][k] for r in rows])), 4)
                                     for k in rows[0]["omnijax_phases_s"]},
                "planned_hosts": len(pick), "hosts": hosts,
                "plan_parts_s": {k: round(v, 3) for k, v in parts.items() if k != "host_s"},
                "hardware": model.hw.name})
    return out


# --------------------------------------------------------------------- CPU mode (calibration)
@dataclass(frozen=True)
class CpuConstants:
    """Seconds on this machine: per encoder / LLM (a per row, b per row pair, const per call) from
    timings of the real modules (`recipes calibrate_cost`'s fit), and memory copy bandwidth."""

    encoders: dict[str, tuple[float, float, float]]
    llm: tuple[float, float, float]
    copy_Bps: float
    # per encoder (a, b, const) of a buffer that holds nothing in a step: its `lax.cond` skips the encoder,
    # but forward + backward still write outputs and zero residuals of the buffer's capacity; {}: free
    empty: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def visited_blocks(seg: np.ndarray, block: int = 128) -> int:
    """Block pairs blockwise attention visits on a buffer of segment ids (`flash.visible_blocks`' rule:
    segment-id intervals of the two blocks overlap; each query block runs over one contiguous range)."""
    n = -(-seg.size // block) * block
    s = np.zeros(n, np.int64)
    s[:seg.size] = seg
    s = s.reshape(-1, block)
    lo, hi = s.min(1), s.max(1)
    vis = (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None])
    rows = vis.any(1)
    first = np.argmax(vis, 1)
    last = vis.shape[1] - np.argmax(vis[:, ::-1], 1)
    return int(np.where(rows, last - first, 0).sum())


def _segment_work(seg: np.ndarray, a: float, b: float) -> float:
    """a·(real rows) + b·Σ (rows of each segment)²: a buffer's segments as the module timing measured one
    segment (t = const + a·n + b·n²), whatever the buffer's capacity."""
    n = np.bincount(seg[seg > 0]).astype(np.float64)
    return float(a * n.sum() + b * (n * n).sum())


def plan_phases_cpu(plan: routing.Plan, batch: dict, esp: int, llm_width: int, cpu: CpuConstants,
                    block: int = 128, shards: int = 0, real_rows: bool = False) -> Phases:
    """Per-device work of a real plan (the arrays `build_plan` made) in seconds on this CPU: every
    non-empty encoder buffer costs const + a·capacity + b·block²·(block pairs blockwise attention
    visits; long buffers attend over the esp group's gathered rows with 1/esp of the heads), the
    all-to-all copies its fixed-capacity buffers, the LLM costs Σ documents (a·n + b·n²) once.
    `shards` > 0: the LLM per device instead (the rows are `shards` equal runs of batch shards, each
    shard's work split evenly over its D / shards devices, the call's const spread over all), so a
    per-phase aggregation (`Phases.step_s(cores=...)`) sees every device's share; the sum is unchanged.
    `real_rows`: a non-empty buffer costs const + its segments' a·n + b·n² (`_segment_work`) instead of
    a·capacity + the visited blocks: the encoder work follows the rows it holds, and what the capacity
    itself costs is charged apart (the calibration's capacity term)."""
    arr = plan.arrays
    D = arr["route_send"].shape[0]
    enc = np.zeros(D)
    for key in arr:
        parts = key.split("_")
        if len(parts) != 4 or parts[2:] != ["segment", "ids"] or parts[1] not in ("short", "long"):
            continue
        name, kind = parts[0], parts[1]
        if name not in cpu.encoders:
            continue
        a, b, const = cpu.encoders[name]
        seg = arr[key].reshape(D, -1)
        cap = seg.shape[1]
        idle = 0.0
        if name in cpu.empty and cap > 0:
            ea, eb, ec = cpu.empty[name]
            idle = ec + ea * cap + eb * cap * cap
        if kind == "long" and esp > 1:
            # the long buffers' branch is taken on every device or on none (a psum decides: collectives inside)
            grp = seg.reshape(D // esp, esp * cap)
            if not (grp > 0).any():
                enc += idle
                continue
            for g in range(D // esp):
                if (grp[g] > 0).any() and real_rows:
                    enc[g * esp:(g + 1) * esp] += const + _segment_work(grp[g], a, b) / esp
                elif (grp[g] > 0).any():
                    attn = b * block * block * visited_blocks(grp[g], block) / esp
                    enc[g * esp:(g + 1) * esp] += const + a * cap + attn
                elif cpu.empty:     # a group with nothing runs the branch too (on empty rows)
                    enc[g * esp:(g + 1) * esp] += const + a * cap
            continue
        for d in range(D):
            if (seg[d] > 0).any() and real_rows:
                enc[d] += const + _segment_work(seg[d], a, b)
            elif (seg[d] > 0).any():
                enc[d] += const + a * cap + b * block * block * visited_blocks(seg[d], block)
            else:
                enc[d] += idle
    route = np.full(D, 2.0 * arr["route_send"][0].size * llm_width * 4 / cpu.copy_Bps)
    a, b, const = cpu.llm
    per_row = []
    for row in np.asarray(batch["segment_ids"]):
        n = np.bincount(row[row > 0]).astype(np.float64)
        per_row.append(float((a * n + b * n * n).sum()))
    if shards > 0:
        shard = np.asarray(per_row).reshape(shards, -1).sum(1)
        return Phases(enc, route, np.repeat(shard / (D // shards), D // shards) + const / D)
    return Phases(enc, route, np.array([const + sum(per_row)]))


def fit_balanced_capacities(parts: list[list[Segment]], grid: DeviceGrid, reductions: dict[str, int],
                            mean_cost: float, *, target: float = 1.05, rounds: int = 4, long_short: bool = True,
                            pad_cost: Callable[[str, int], float] | None = None,
                            long_factor: float = 1.0, min_rows: int = 16,
                            growth: float = BUCKET_GROWTH) -> tuple[dict, list[float]]:
    """Common encoder capacities for `parts` (placements on grids of one shape: the hosts of a step,
    or a window's batches) that also leave room to balance: (capacities, worst device cost / mean_cost
    of each part after `place_segments` + `refine_assignment`).

    Starts from the smallest capacities the greedy fits (`routing.fit_segment_capacities`); those can
    be so tight that cost cannot move (a host whose cost sits in a few long clips fills its buffers
    with rows): while a part's worst device is above `target` × `mean_cost` (or × the costliest segment's
    share, whole or over an esp group, where that is higher: the step's slowest device cannot beat it),
    grow the one buffer (one bucket step) that lowers the worst such part most, for at most `rounds`
    steps. Padding is the price: every device computes the grown rows (`pad_cost(encoder, rows)`, the
    cost of rows that hold nothing: the per-row term), so a step is taken only if the worst device
    gains more than that. Done per window, ahead of the steps (the trainer's window fit)."""
    splittable = long_short and grid.esp > 1
    caps = routing.fit_segment_capacities(parts, grid, reductions, long_short=long_short, long_factor=long_factor,
                                          min_rows=min_rows, growth=growth)

    def worst(c: dict, p: int) -> float:
        segs = parts[p]
        if not segs or mean_cost <= 0:
            return 0.0
        names = {s.encoder for s in segs}
        pins = {k: v for k, v in c.items() if k.rsplit("_", 1)[0] in names}
        try:
            a, got = routing.place_segments(segs, grid, reductions, capacities=pins, long_short=long_short,
                                            long_factor=long_factor, min_rows=min_rows, growth=growth)
        except ConfigError:
            return math.inf
        a = placement_meta.refine_assignment(a, segs, grid, got, splittable=splittable)
        return float(a.device_cost.max()) / mean_cost

    # the step cannot beat its costliest segment (whole, or over one esp group): aim within target of that
    floor = max((s.cost for segs in parts for s in segs), default=0.0) / (grid.esp if splittable else 1)
    goal = target * max(1.0, floor / max(mean_cost, 1e-300))
    scores = [worst(caps, p) for p in range(len(parts))]
    for _ in range(rounds):
        bad = [p for p, s in enumerate(scores) if s > goal]
        if not bad:
            break
        now = max(scores[p] for p in bad)
        options = []
        for key in sorted(caps):
            name, kind = key.rsplit("_", 1)
            if kind == "long" and not splittable:
                continue
            r = reductions[name]
            grown = dict(caps)
            grown[key] = _bucket(caps[key] + 1, r, min_rows, growth)
            price = pad_cost(name, grown[key] - caps[key]) / mean_cost if pad_cost else 0.0
            options.append((max(worst(grown, p) for p in bad) + price, sum(grown.values()), key, grown))
        if not options:
            break
        score, _, _, grown = min(options, key=lambda o: o[:3])
        if score >= now - 1e-9:     # no step gains more than the padding it adds
            break
        caps = grown
        scores = [worst(caps, p) for p in range(len(parts))]
    return caps, scores
