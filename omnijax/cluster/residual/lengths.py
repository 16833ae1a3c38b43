"""Job lengths from observed outcomes: the lengths of finished jobs of the same class."""
from __future__ import annotations

import numpy as np

from omnijax.cluster.jobs import Job


def median_left(totals: np.ndarray, progress: float) -> float | None:
    """The median, over the lengths in `totals` a job at `progress` has not yet outlived, of the steps left;
    None when it has outlived them all."""
    left = totals[totals > 1.02 * progress] - progress
    return max(float(np.median(left)), 1.0) if left.size else None


class ClassLengths:
    """Lengths of finished jobs per job class (application, batch size), observed online, and whether they
    predict that class better than the scheduler's other estimate.

    Jobs recur in production clusters, and the lengths of earlier runs predict a recurring job's length where a
    curve fitted to its own loss cannot (3Sigma, Park et al., EuroSys'18, schedules on run-time distributions
    learned from job history). A job's remaining steps are the median over its class's lengths it has not yet
    outlived (`median_left`), so a job that outlives its class's usual length is not called done.
    How alike a class's jobs are is not assumed: every slot both estimates of each job's length are recorded
    (`record`), scored when the job finishes, and a class's lengths are used only while their mean log error
    over its finished jobs is at most the other estimate's (`trusted`; before any score, they are)."""

    def __init__(self):
        self.seen: dict[tuple[str, int], list[float]] = {}
        self._pending: dict[str, list[tuple[float, float]]] = {}
        self._error: dict[tuple[str, int], np.ndarray] = {}     # summed |log error|: class lengths, other; count

    def record(self, job: Job, class_total: float, other_total: float) -> None:
        self._pending.setdefault(job.name, []).append((class_total, other_total))

    def finished(self, job: Job) -> None:
        key = (job.application, job.batch_size)
        self.seen.setdefault(key, []).append(job.progress)
        guesses = np.asarray(self._pending.pop(job.name, []), dtype=float).reshape(-1, 2)
        if guesses.size:
            err = self._error.setdefault(key, np.zeros(3))
            err[:2] += np.abs(np.log(np.maximum(guesses, 1.0) / max(job.progress, 1.0))).sum(0)
            err[2] += len(guesses)

    def trusted(self, job: Job) -> bool:
        err = self._error.get((job.application, job.batch_size))
        return err is None or err[0] <= err[1]

    def remaining(self, job: Job) -> float | None:
        lengths = self.seen.get((job.application, job.batch_size))
        return median_left(np.asarray(lengths), job.progress) if lengths else None
