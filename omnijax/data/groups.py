"""Planning groups: a step's rows cut into groups that are planned independently, so that a host plans
only the groups its own ranks hold, in time that does not grow with the number of hosts.

A group is a fixed block of the step's global rows (`rows` of them: the same block on every layout,
since a step has the same global rows on every layout). It draws its own samples (lane `index` of the
mixer's `count` lanes: disjoint positions of each source's permutation), defers what it has no room
for into its own next window, and chooses its samples against its share of the step's capacity, with
no notion of ranks: the samples of a step are the union of its groups' and do not depend on the
layout. One group (a step of at most `PLAN_ROWS` rows, the default) is exactly the loader's plan
without groups. Only then are a group's samples spread over the dp ranks that hold its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnijax.errors import ConfigError

PLAN_ROWS = 128  # rows per planning group by default: a host plans ~2k samples a window whatever the job's size


@dataclass(frozen=True)
class Groups:
    """How a step's `dp x rank_rows` global rows split into `count` planning groups of `rows` rows."""
    count: int
    rows: int
    dp: int
    rank_rows: int

    @classmethod
    def of(cls, dp: int, rank_rows: int, plan_rows: int = 0) -> "Groups":
        """Groups of at most `plan_rows` rows (0: `PLAN_ROWS`; a step of no more rows is one group): the
        fewest groups of equal size that tile the step. Depends on the step's rows only, never on how
        they split over ranks (`aligned` says whether a group holds whole ranks or a rank whole groups)."""
        total = dp * rank_rows
        limit = plan_rows or PLAN_ROWS
        if limit <= 0:
            raise ConfigError(f"plan_rows={plan_rows}: must be >= 0 (0: {PLAN_ROWS})")
        count = next(g for g in range(-(-total // limit), total + 1) if total % g == 0)
        return cls(count, total // count, dp, rank_rows)

    @property
    def aligned(self) -> bool:
        """A group holds whole ranks, or a rank whole groups (else a rank holds parts of two groups)."""
        return self.count == 1 or self.rows % self.rank_rows == 0 or self.rank_rows % self.rows == 0

    def ranks(self, group: int) -> range:
        """The dp ranks holding rows of `group`."""
        return range(group * self.rows // self.rank_rows, -(-(group + 1) * self.rows // self.rank_rows))

    def of_ranks(self, ranks) -> list[int]:
        """The groups holding rows of these dp ranks."""
        out = set()
        for r in ranks:
            lo, hi = r * self.rank_rows, (r + 1) * self.rank_rows
            out.update(range(lo // self.rows, -(-hi // self.rows)))
        return sorted(out)

    def share(self, total: int, group: int) -> int:
        """Group `group`'s part of an integer `total` (parts differ by at most one, sum to `total`)."""
        return (group + 1) * total // self.count - group * total // self.count

    def row_offset(self, group: int) -> int:
        """Where the group's rows start within a rank's rows (a rank holding several groups)."""
        return (group * self.rows) % self.rank_rows if self.rows < self.rank_rows else 0
