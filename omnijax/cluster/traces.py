"""Loading job workloads and the per-application profiles the simulator runs them on.

Workloads give job arrivals (name, time, application, requested GPUs, batch size): the bundled Pollux
sets by name (`workloads/workload-3`) or any CSV file of the same columns by path. Per-application
profiles give measured step/sync times per placement and the iterations each batch size needs, from
which the simulator derives job speed and job length. Both live under `<root>/pollux`, where root is
`$OMNIJAX_SHARED_DATA` or `<repo>/../shared/data` (`../shared/data/README.md` says where the files come
from; the tests point the root at synthetic files of the same format under `tests/fixtures/cluster`).
"""
from __future__ import annotations

import csv
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omnijax.errors import UserError

_REPO_ROOT = Path(__file__).resolve().parents[2]
APPLICATIONS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")
WORKLOAD_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


def shared_data_root() -> Path:
    """`$OMNIJAX_SHARED_DATA` if set, else `<repo>/../shared/data`; a clear UserError if missing."""
    env = os.environ.get("OMNIJAX_SHARED_DATA")
    root = Path(env) if env else _REPO_ROOT.parent / "shared" / "data"
    if not (root / "pollux").is_dir():
        raise UserError(
            f"cluster workload data not found: {root / 'pollux'} is missing. Put the Pollux data folder "
            f"there (see shared/data/README.md) or set OMNIJAX_SHARED_DATA to the folder that holds 'pollux/'.")
    return root


@dataclass(frozen=True)
class JobSpec:
    """One submitted job as the workload file describes it."""
    name: str
    time: float             # submission time, seconds from the start of the workload
    application: str
    num_replicas: int       # GPUs the user asked for
    batch_size: int         # total batch size (fixed for the job's life here)


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        raise UserError(f"missing data file {path}; the Pollux data folder looks incomplete")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _natural(p: Path) -> tuple:
    """Sort key: `workload-10` after `workload-9`."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name))


def workload_sets() -> list[str]:
    """Names like `workloads/workload-1` for every bundled workload file available."""
    root = shared_data_root() / "pollux"
    return sorted(f"{d.name}/{p.stem}" for d in root.iterdir() if d.is_dir() and d.name.startswith("workloads")
                  for p in d.glob("workload-*.csv"))


def is_path(name: str) -> bool:
    """A user's file or folder (ends in .csv, or exists as a path) rather than a bundled workload name."""
    return name.endswith(".csv") or Path(name).expanduser().exists()


def workload_path(name: str) -> Path:
    """The CSV file of a bundled workload name (`workloads/workload-3`, or `workload-3` for the main folder),
    or `name` itself when it is a path to a CSV file."""
    if is_path(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"workload file {path} does not exist")
        return path
    folder, _, stem = name.rpartition("/")
    path = shared_data_root() / "pollux" / (folder or "workloads") / f"{stem}.csv"
    if not path.exists():
        raise UserError(f"unknown workload '{name}': {path} does not exist; choose from {', '.join(workload_sets())} "
                        f"or give a path to a CSV file with columns {','.join(WORKLOAD_COLUMNS)}")
    return path


def workload_files(source: str, files: int = 1) -> list[str]:
    """The workloads one bench row averages. A bundled set name (`workloads`) gives `<set>/workload-1..files`;
    a folder gives its first `files` CSV files in natural order; files == 0 takes all; a CSV file gives itself.
    A path that exists is read as a path, anything else as a bundled set."""
    if is_path(source):
        path = Path(source).expanduser()
        if path.is_file():
            return [str(path)]
        if not path.is_dir():
            raise UserError(f"workload file {path} does not exist")
        found = sorted(path.glob("*.csv"), key=_natural)
        if not found:
            raise UserError(f"workload folder {path} holds no .csv files")
        return [str(p) for p in (found[:files] if files else found)]
    if files:
        return [f"{source}/workload-{i}" for i in range(1, files + 1)]
    folder = shared_data_root() / "pollux" / source
    found = sorted(folder.glob("workload-*.csv"), key=_natural)
    if not found:
        raise UserError(f"unknown workload set {source!r}: {folder} holds no workload-*.csv; choose a folder of "
                        f"{shared_data_root() / 'pollux'} or give a path to a CSV file or a folder of them")
    return [f"{source}/{p.stem}" for p in found]


def read_workload(path: str | Path) -> list[JobSpec]:
    """Jobs of one workload CSV in file order; a UserError naming the file and row for anything the
    simulator could not run (missing column, unparsable number, unknown application, non-positive sizes,
    negative time, duplicate name)."""
    path = Path(path)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in WORKLOAD_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path} row 1: header {reader.fieldnames} lacks column(s) {', '.join(missing)}; "
                            f"a workload needs {','.join(WORKLOAD_COLUMNS)}")
        rows = list(reader)
    if not rows:
        raise UserError(f"{path}: no jobs (only a header)")
    jobs: list[JobSpec] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        where = f"{path} row {i + 2}"
        try:
            spec = JobSpec(row["name"].strip(), float(row["time"]), row["application"].strip(),
                           int(row["num_replicas"]), int(row["batch_size"]))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{where}: cannot parse ({exc})") from None
        if spec.application not in APPLICATIONS:
            raise UserError(f"{where}: unknown application {spec.application!r}; the simulator has profiles of "
                            f"{', '.join(APPLICATIONS)}")
        if not spec.name:
            raise UserError(f"{where}: empty job name")
        if spec.num_replicas <= 0 or spec.batch_size <= 0 or not np.isfinite(spec.time) or spec.time < 0:
            raise UserError(f"{where}: bad job {spec} (num_replicas and batch_size must be > 0, time >= 0)")
        if spec.name in seen:
            raise UserError(f"{where}: job name {spec.name!r} already used in row {seen[spec.name]}")
        seen[spec.name] = i + 2
        jobs.append(spec)
    return jobs


def load_workload(name: str, limit: int = 0) -> list[JobSpec]:
    """Jobs of a bundled workload (`workloads/workload-3`) or of a CSV file path, by arrival time;
    the first `limit` (0: all)."""
    jobs = read_workload(workload_path(name))
    jobs.sort(key=lambda j: (j.time, j.name))
    return jobs[:limit] if limit else jobs


@dataclass
class AppProfile:
    """Measured behaviour of one application, turned into step-time and job-length functions."""
    name: str
    local_bsz: np.ndarray       # measured single-GPU local batch sizes
    compute_s: np.ndarray       # step_time - sync_time at those sizes (mean over repeats)
    sync_points: np.ndarray     # rows (num_nodes, log2 num_replicas)
    sync_s: np.ndarray          # mean sync time at those points
    iterations: dict[int, int] = field(default_factory=dict)   # total batch size -> iterations to finish

    @property
    def max_local_bsz(self) -> float:
        return float(self.local_bsz.max())

    @property
    def min_local_bsz(self) -> float:
        return float(self.local_bsz.min())

    def compute_time(self, local_bsz: float) -> float:
        """Per-step compute at a local batch; above the measured maximum, gradient accumulation."""
        accum = max(1, int(np.ceil(local_bsz / self.max_local_bsz - 1e-9)))
        per = local_bsz / accum
        t = np.interp(np.log(max(per, 1e-9)), np.log(self.local_bsz), np.log(self.compute_s))
        return accum * float(np.exp(t))

    def sync_time(self, num_nodes: int, num_replicas: int) -> float:
        if num_replicas <= 1:
            return 0.0
        return float(self._sync(num_nodes, float(np.log2(num_replicas))))

    @functools.cached_property
    def _sync(self):
        return _sync_interpolator(self.sync_points, self.sync_s)

    def step_time(self, num_replicas: int, num_nodes: int, batch_size: int) -> float:
        """Seconds per iteration of the total batch on `num_replicas` GPUs spread over `num_nodes` nodes."""
        if num_replicas <= 0:
            raise ValueError("step_time needs at least one replica")
        return self.compute_time(batch_size / num_replicas) + self.sync_time(num_nodes, num_replicas)

    def total_iterations(self, batch_size: int) -> int:
        """Iterations to reach the final measured epoch; log-log interpolation between batch sizes."""
        if batch_size in self.iterations:
            return self.iterations[batch_size]
        bs = np.array(sorted(self.iterations))
        its = np.array([self.iterations[b] for b in bs])
        return int(round(np.exp(np.interp(np.log(batch_size), np.log(bs), np.log(its)))))


def _sync_interpolator(points: np.ndarray, values: np.ndarray):
    """Linear interpolation over (nodes, log2 replicas), nearest neighbour outside the measured hull."""
    from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator
    lin = LinearNDInterpolator(points, values)
    near = NearestNDInterpolator(points, values)

    @functools.lru_cache(maxsize=4096)
    def f(nodes: int, log_r: float) -> float:
        v = float(lin(nodes, log_r))
        return v if np.isfinite(v) else float(near(nodes, log_r))
    return f


def load_profile(name: str) -> AppProfile:
    """Read placements.csv, scalability.csv and validation-*.csv of application `name` under the data root
    (cached per root, so pointing OMNIJAX_SHARED_DATA elsewhere takes effect)."""
    if name not in APPLICATIONS:
        raise UserError(f"unknown application '{name}'; known: {', '.join(APPLICATIONS)}")
    return _load_profile(name, shared_data_root())


@functools.lru_cache(maxsize=None)
def _load_profile(name: str, root: Path) -> AppProfile:
    folder = root / "pollux" / "traces" / name
    compute: dict[float, list[float]] = {}
    sync: dict[tuple[int, float], list[float]] = {}
    for row in _read_csv(folder / "placements.csv"):
        placement = row["placement"]
        nodes, replicas = len(placement), sum(int(c) for c in placement)
        step, sy = float(row["step_time"]), float(row["sync_time"])
        if replicas == 1:
            compute.setdefault(float(row["local_bsz"]), []).append(step - sy)
        else:
            sync.setdefault((nodes, float(np.log2(replicas))), []).append(sy)
    for row in _read_csv(folder / "scalability.csv"):
        key = (int(row["num_nodes"]), float(np.log2(int(row["num_replicas"]))))
        sync.setdefault(key, []).append(float(row["sync_time"]))
    if not compute:
        raise UserError(f"{folder / 'placements.csv'}: no single-GPU rows, cannot derive compute time")
    bsz = np.array(sorted(compute))
    iterations = {}
    for path in folder.glob("validation-*.csv"):
        rows = _read_csv(path)
        if rows:
            iterations[int(path.stem.split("-")[1])] = int(float(rows[-1]["iteration"]))
    if not iterations:
        raise UserError(f"{folder}: no validation-<batch>.csv files")
    keys = sorted(sync)
    return AppProfile(
        name=name, local_bsz=bsz, compute_s=np.array([max(np.mean(compute[b]), 1e-6) for b in bsz]),
        sync_points=np.array(keys, dtype=float), sync_s=np.array([np.mean(sync[k]) for k in keys]),
        iterations=iterations)
