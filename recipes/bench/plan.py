"""The loader's own planner at real batch sizes: seconds per step per host and memory, from metadata.

What is timed is `omnijax.data.loader.Loader.window_plan` (the layout-free selection of each step's
samples, the spread over the dp ranks, the step layouts) exactly as training runs it, on a source of
metadata only: samples drawn from `bench scale`'s distributions (`omnijax.perfmodel.scale`: images
224-896 px, clips 2-60 s, speech 1-30 s, text to 4k tokens) under its image / video / audio_text mixes,
shaped for `omni_8b`'s encoders (SigLIP/14 with a 2x2 merge, Whisper-style audio). A global batch is
`rows_per_device` rows of `row_len` tokens per device (2 x 4k, as `bench scale`), one dp rank per
device as the trainer's data plane has, and every host plans the whole step (the plan is identical
everywhere). Rows: devices x mix, with `plan_s_per_step` (mean over the timed windows, the first one's
start-up included), `peak_rss_mb` growth while planning, and the step's samples and items. Nothing is
decoded; no device is used.
"""
from __future__ import annotations

import math
import resource
import time
from typing import Iterator

import numpy as np

DESCRIPTION = "loader planner at 1k-16k devices (2 rows of 4k tokens each): seconds per step per host, memory"


def _options(overrides: list[str]) -> dict:
    opts = {"devices": "1024,4096,16384", "mixes": "image,video,audio_text", "rows_per_device": 2,
            "row_len": 4096, "window": 4, "windows": 1, "samples_per_row": 4, "seed": 0}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.removeprefix("bench.")
        if key not in opts:
            from omnijax.errors import ConfigError

            raise ConfigError(f"bench plan: unknown option '{key}'; known: {', '.join(opts)}")
        opts[key] = type(opts[key])(value)
    return opts


class MetaSource:
    """Metadata of a synthetic source (a mix phase of `bench scale`'s distributions): `size` records drawn
    once at construction (outside the timed planning; a real source reads them from its shards'
    sidecars), so `meta` is a lookup; `get` is never needed."""

    CHUNK = 4096

    def __init__(self, name: str, shares: dict[str, float], seed: int, row_len: int, size: int = 32768):
        self.name, self.shares, self.seed, self.row_len = name, shares, seed, row_len
        self.metadata_in_memory = False
        self._metas = [m for c in range(-(-size // self.CHUNK)) for m in self._draw(c)][:size]

    def __len__(self) -> int:
        return len(self._metas)

    def meta(self, index: int):
        return self._metas[index]

    def _draw(self, chunk: int) -> list:
        from omnijax.data.sample import SampleMeta, SegmentMeta

        rng = np.random.default_rng([self.seed, chunk])
        n = self.CHUNK
        mods = list(self.shares)
        p = np.array([self.shares[m] for m in mods], np.float64)
        kind = rng.choice(len(mods), n, p=p / p.sum())
        logu = lambda lo, hi: np.exp(rng.uniform(math.log(lo), math.log(hi), n)).astype(np.int64)  # noqa: E731
        logn = lambda med, s, lo, hi: np.clip(rng.lognormal(math.log(med), s, n), lo, hi)  # noqa: E731
        h, w, vside = logu(224, 896), logu(224, 896), logu(224, 448) // 28 * 28
        dur_v, dur_a = logn(20, 0.8, 2, 60), logn(10, 0.6, 1, 30)
        text = {"image": logn(120, 0.8, 8, 1024).astype(np.int64), "video": logn(100, 0.8, 8, 512).astype(np.int64),
                "audio": (logn(60, 0.6, 8, 512) + 3 * dur_a).astype(np.int64),
                "text": logn(1000, 1.0, 32, self.row_len).astype(np.int64)}
        out = []
        for i in range(n):
            mod = mods[kind[i]]
            t = int(text[mod][i])
            if mod == "image":
                seg = SegmentMeta("image", (int(h[i]), int(w[i]), 3))
            elif mod == "video":
                per = (int(vside[i]) // 28) ** 2          # LLM tokens per 2-frame tube after the 2x2 merge
                frames = min(2 * math.ceil(dur_v[i]), 2 * max(1, (self.row_len - t) // per))
                seg = SegmentMeta("video", (frames, int(vside[i]), int(vside[i]), 3))
            elif mod == "audio":
                seg = SegmentMeta("audio", (int(dur_a[i] * 16000),))
            else:
                seg = None
            segs = (SegmentMeta("text", (t,), loss=True),) if seg is None else (seg, SegmentMeta("text", (t,), loss=True))
            out.append(SampleMeta(segs, self.name, chunk * n + i))
        return out

    def get(self, index: int):  # pragma: no cover - planning never reads payloads
        raise NotImplementedError("bench plan's source holds metadata only")


def _mm_config():
    from omnijax.config import build
    from recipes.common import CONFIGS
    from omnijax.train.multimodal import MultimodalConfig as OmniConfig, check

    return build(OmniConfig, CONFIGS / "omni_8b.yaml", [], check=check).model


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def plan_row(devices: int, mix_name: str, opts: dict, mm_cfg) -> dict:
    """Time the loader's window plans for one global batch size and mix."""
    from omnijax.data.loader import Loader, LoaderConfig
    from omnijax.data.sources import SourceSpec
    from omnijax.perfmodel.scale import MIXES

    mix = MIXES[mix_name]
    rows = devices * opts["rows_per_device"]
    names = [f"{mix_name}{k}" for k in range(len(mix.phases))]
    sources = [MetaSource(n, mix.phases[k], opts["seed"] + k, opts["row_len"]) for k, n in enumerate(names)]
    W = opts["window"]
    schedule = [{"step": k * W, "weights": {n: float(j == k) for j, n in enumerate(names)}} for k in range(len(names))]
    cfg = LoaderConfig(sources=[SourceSpec(name=n, kind="world") for n in names], mix=schedule, seed=opts["seed"],
                       samples_per_step=opts["samples_per_row"] * rows, dp=devices, microbatches=1, window=W,
                       row_len=opts["row_len"], max_rows=opts["rows_per_device"], fixed_shapes=True)
    loader = Loader(cfg, mm_cfg=mm_cfg, sources=sources)
    rss0 = _rss_mb()  # after the sources' metadata: what planning itself adds
    t0 = time.perf_counter()
    samples = items = 0
    for w in range(opts["windows"]):
        wp = loader.window_plan(w)
        samples += sum(len(b) for b in wp.plan.bins)
        items += len(wp.items)
    secs = time.perf_counter() - t0
    steps = opts["windows"] * W
    return {"variant": "loader_plan", "devices": devices, "mix": mix_name, "global_rows": rows,
            "row_len": opts["row_len"], "window": W, "steps": steps,
            "plan_s_per_step": round(secs / steps, 3), "samples_per_step": round(samples / steps, 1),
            "items_per_window": round(items / opts["windows"], 1), "peak_rss_growth_mb": round(_rss_mb() - rss0, 1),
            "plans_on": "every host (the whole step, identical everywhere)"}


def run(overrides: list[str]) -> Iterator[dict]:
    opts = _options(overrides)
    mm_cfg = _mm_config()
    rows = []
    for mix in [m for m in opts["mixes"].split(",") if m]:
        for devices in [int(d) for d in opts["devices"].split(",") if d]:
            row = plan_row(devices, mix, opts, mm_cfg)
            rows.append(row)
            yield row
    by = {}
    for r in rows:
        by.setdefault(r["mix"], []).append(r)
    for mix, rs in by.items():
        rs = sorted(rs, key=lambda r: r["devices"])
        if len(rs) > 1:
            yield {"variant": "loader_plan_growth", "mix": mix, "devices": f"{rs[0]['devices']}->{rs[-1]['devices']}",
                   "plan_s_growth": round(rs[-1]["plan_s_per_step"] / max(rs[0]["plan_s_per_step"], 1e-9), 2)}
