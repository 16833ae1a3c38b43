"""Philly cluster traces (Microsoft, msr-fiddle/philly-traces) to simulator workloads.

The public Philly trace says, per job, when it was submitted, how many GPUs it held and how long it ran,
but not what it trained. Pollux built its workloads from it by mapping each job's GPU-time onto one of
its six profiled applications (the rule in `../shared/data/README.md`): under 1 GPU-hour cifar10 or ncf,
under 10 deepspeech2 or bert, under 100 yolov3, else imagenet. `to_workload` applies the same rule, so a
converted trace keeps Philly's arrival pattern and size mix while its jobs run on measured profiles.

Inputs: the trace's own `cluster_job_log` (a JSON list of jobs with `jobid`, `submitted_time`
"YYYY-MM-DD HH:MM:SS", and `attempts`, each with `start_time`, `end_time` and `detail` (machines, each
with its `gpus`)), or a CSV with one row per job: job id, submit time (seconds or a timestamp), GPU count
and duration in seconds (column names in `CSV_COLUMNS`).
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from omnijax.cluster.traces import WORKLOAD_COLUMNS, JobSpec, load_profile
from omnijax.errors import UserError

# accepted spellings per field of the CSV form (the first present wins)
CSV_COLUMNS = {"job_id": ("job_id", "jobid", "id", "name"),
               "submit_time": ("submit_time", "submitted_time", "submit", "time"),
               "num_gpus": ("num_gpus", "num_gpu", "gpus", "gpu_num", "num_replicas"),
               "duration": ("duration", "run_time", "runtime", "duration_s")}
# GPU-hour limits of the Pollux mapping and the applications below each (picked at random among them)
GPU_HOUR_CLASSES = ((1.0, ("cifar10", "ncf")), (10.0, ("deepspeech2", "bert")), (100.0, ("yolov3",)),
                    (float("inf"), ("imagenet",)))
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True)
class PhillyJob:
    job_id: str
    submit_s: float        # seconds (timestamps read as UTC epoch seconds, numbers as given)
    num_gpus: int
    duration_s: float


def _timestamp(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return datetime.strptime(value.strip(), _TIME_FORMAT).replace(tzinfo=timezone.utc).timestamp()


def read_philly(path: str | Path) -> tuple[list[PhillyJob], int]:
    """Jobs of a Philly trace (JSON `cluster_job_log` or CSV), plus how many were skipped because they
    never ran (no attempt with both times, no GPUs, or zero duration). Unparsable records raise a
    UserError naming the file and the record."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Philly trace {path} does not exist")
    text = path.read_text()
    return _read_json(path, text) if text.lstrip().startswith("[") else _read_csv(path, text)


def _read_json(path: Path, text: str) -> tuple[list[PhillyJob], int]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    jobs, skipped = [], 0
    for i, rec in enumerate(records):
        where = f"{path} job {i} ({rec.get('jobid', '?') if isinstance(rec, dict) else '?'})"
        try:
            submit = _timestamp(rec["submitted_time"])
            runs = [(a["start_time"], a["end_time"], a.get("detail") or []) for a in rec.get("attempts") or []]
            runs = [(s, e, d) for s, e, d in runs if s not in (None, "None", "") and e not in (None, "None", "")]
            if not runs:
                skipped += 1
                continue
            start, end = _timestamp(runs[0][0]), _timestamp(runs[-1][1])
            gpus = sum(len(m.get("gpus") or []) for m in runs[-1][2])
            job = PhillyJob(str(rec["jobid"]), submit, gpus, end - start)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UserError(f"{where}: cannot parse ({exc.__class__.__name__}: {exc})") from None
        if job.num_gpus <= 0 or job.duration_s <= 0:
            skipped += 1
            continue
        jobs.append(job)
    return jobs, skipped


def _read_csv(path: Path, text: str) -> tuple[list[PhillyJob], int]:
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in reader.fieldnames or []]
    cols = {}
    for field, names in CSV_COLUMNS.items():
        found = [h for h in header if h.lower() in names]
        if not found:
            raise UserError(f"{path} row 1: no {field} column (any of {', '.join(names)}) in header {header}")
        cols[field] = found[0]
    jobs, skipped = [], 0
    for i, row in enumerate(reader):
        row = {k.strip(): v for k, v in row.items() if k is not None}
        try:
            job = PhillyJob(row[cols["job_id"]].strip(), _timestamp(row[cols["submit_time"]]),
                            int(float(row[cols["num_gpus"]])), float(row[cols["duration"]]))
        except (AttributeError, TypeError, ValueError) as exc:
            raise UserError(f"{path} row {i + 2}: cannot parse ({exc})") from None
        if not np.isfinite(job.submit_s) or not np.isfinite(job.duration_s) or job.num_gpus < 0 or job.duration_s < 0:
            raise UserError(f"{path} row {i + 2}: bad job {job} (GPU count and duration must be >= 0)")
        if job.num_gpus == 0 or job.duration_s == 0:
            skipped += 1
            continue
        jobs.append(job)
    return jobs, skipped


def application_for(gpu_hours: float, rng: np.random.Generator) -> str:
    """Pollux's mapping of a job's GPU-time onto a profiled application (module docstring)."""
    for limit, apps in GPU_HOUR_CLASSES:
        if gpu_hours < limit:
            return apps[0] if len(apps) == 1 else str(rng.choice(apps))
    raise AssertionError("unreachable: the last class has no limit")


def job_shape(application: str, num_gpus: int, max_gpus: int) -> tuple[int, int]:
    """(requested GPUs, total batch size) for a Philly job of `num_gpus` GPUs run as `application`:
    the smallest profiled batch per GPU, clamped to the profiled batch sizes and to `max_gpus`."""
    prof = load_profile(application)
    batches = sorted(prof.iterations)
    n = max(1, min(num_gpus, max_gpus))
    batch = min(batches, key=lambda b: (abs(np.log(b / (batches[0] * n))), b))
    n = max(1, min(n, int(batch // prof.min_local_bsz)))   # the local batch stays within what was measured
    return n, int(batch)


def to_workload(jobs: Sequence[PhillyJob], start_s: float | None = None, hours: float = 8.0, count: int = 0,
                seed: int = 0, max_gpus: int = 64) -> list[JobSpec]:
    """Jobs submitted within `hours` from `start_s` (None: the first submission), `count` of them sampled
    at random (0: all), as simulator jobs named `<application>-<index>` in arrival order, arriving at
    their submission time minus the window start."""
    if hours <= 0 or count < 0 or max_gpus < 1:
        raise UserError(f"hours={hours}, count={count}, max_gpus={max_gpus}: need hours > 0, count >= 0, max_gpus >= 1")
    if not jobs:
        raise UserError("the Philly trace holds no job that ran")
    t0 = min(j.submit_s for j in jobs) if start_s is None else start_s
    window = [j for j in jobs if t0 <= j.submit_s < t0 + hours * 3600.0]
    if not window:
        raise UserError(f"no Philly job submitted in the {hours} h from {t0}")
    rng = np.random.default_rng(seed)
    if count and count < len(window):
        window = [window[i] for i in sorted(rng.choice(len(window), count, replace=False))]
    window.sort(key=lambda j: (j.submit_s, j.job_id))
    out = []
    for i, j in enumerate(window):
        app = application_for(j.num_gpus * j.duration_s / 3600.0, rng)
        n, batch = job_shape(app, j.num_gpus, max_gpus)
        out.append(JobSpec(f"{app}-{i}", float(round(j.submit_s - t0)), app, n, batch))
    return out


def write_workload(specs: Sequence[JobSpec], path: str | Path) -> Path:
    """The workload CSV the simulator reads (`traces.WORKLOAD_COLUMNS`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(WORKLOAD_COLUMNS)
        for s in specs:
            w.writerow([s.name, int(s.time) if float(s.time).is_integer() else s.time, s.application, s.num_replicas,
                        s.batch_size])
    return path
