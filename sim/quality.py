"""What a trained token is worth once folded: the planner's quality factor of a delta's interval.

A delta that covers H inner steps is worth q(H) tokens of synchronous data-parallel training
(q(1) = 1): q(H) is the tokens a budgeted sync-DP run needs to reach the loss that a budgeted
decoupled run at interval H reaches, over the tokens that run trained.  `dloco plan` multiplies
every folded token by q of the steps its delta covered (a delta the outbox summed covers them all),
so an interval that grows on a slow link costs useful tokens, and sync-DiLoCo's tokens count q(H)
too.

The default curve is this repository's own measurement (EXPERIMENTS.md, "Quality"), on the 0.87 M
parameter model, 4 islands, 16 M cluster tokens (18 per parameter), one run each, taken against
the baseline then called sync-dp, which is `sync-avg` now (parameter averaging after each island's
own AdamW step, not data parallelism: against data parallelism every q below is lower, by how
much EXPERIMENTS.md "Quality" says):
- that baseline's final loss falls 0.289 per doubling of its budget between 2 M and 16 M tokens
  (2.116 at 2 M, 1.249 at 16 M), so a decoupled final loss L at 16 M is what it reaches with
  16 M x 2^-((L - 1.249) / 0.289) tokens;
- H = 48 (24 on the half-speed islands): 1.311, so q(48) = 13.8 M / 16 M = 0.862;
- H = 24 (12 on the half-speed islands): 1.277, so q(24) = 15.0 M / 16 M = 0.935;
- H = 12 (6 on the half-speed islands, the shipped profile): 1.252, so q(12) = 15.9 M / 16 M =
0.993. Between measured intervals q is linear in ln H; past the last one it goes on with the last
segment's slope, never below FLOOR.  Published runs at 35 M-1 B parameters (Streaming DiLoCo,
docs/design.md "Numbers to respect") put the gap at H = 100 near 1 %; a scenario's `[quality]`
table replaces this curve with the user's own measurement.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from dloco.protocol.errors import require

FLOOR = 0.05
# the baseline's (sync-avg's) final loss per doubling of its budget, 2 M -> 16 M tokens
SYNC_DP_SLOPE = 0.289
SYNC_DP_LOSS_16M = 1.249
QUALITY_H48_LOSS = 1.311
QUALITY_H24_LOSS = 1.277
QUALITY_H12_LOSS = 1.252


def slope_per_doubling(small: tuple[int, float], large: tuple[int, float]) -> float:
    """A reference's final loss fall per doubling of its budget, from (tokens, loss) at two
    budgets."""
    (b0, l0), (b1, l1) = small, large
    require(
        0 < b0 < b1 and l0 > l1,
        f"a slope needs a larger budget at a lower loss, got {small} and {large}",
    )
    return (l0 - l1) / math.log2(b1 / b0)


def factor_from_loss(
    loss: float, reference: float = SYNC_DP_LOSS_16M, slope: float = SYNC_DP_SLOPE
) -> float:
    """Tokens sync-dp needs for `loss`, over the budget that reached it (both budgeted runs)."""
    return min(1.0, 2.0 ** (-(loss - reference) / slope))


@dataclasses.dataclass(frozen=True)
class QualityCurve:
    """q(H) through (H, q) points, H ascending from (1, 1.0): sync-DP's own interval."""

    points: tuple[tuple[int, float], ...]
    source: str = ""

    def __post_init__(self) -> None:
        intervals = [h for h, _ in self.points]
        require(
            intervals == sorted(set(intervals)) and self.points[:1] == ((1, 1.0),),
            f"quality intervals must ascend from (1, 1.0), got {list(self.points)}",
        )
        require(
            all(0 < q <= 1 for _, q in self.points),
            f"quality factors must be in (0, 1], got {[q for _, q in self.points]}",
        )

    @classmethod
    def of(cls, intervals, factors, source: str) -> QualityCurve:
        """From a scenario's `[quality]` table: H = 1 at factor 1 is implied."""
        require(
            len(intervals) == len(factors) >= 1
            and all(isinstance(h, int) and h >= 1 for h in intervals),
            f"[quality] needs as many factors as intervals (ints >= 1), got {intervals!r} and"
            f" {factors!r}",
        )
        points = tuple(zip(intervals, (float(q) for q in factors)))
        return cls(points if points[0][0] == 1 else ((1, 1.0), *points), source)

    @classmethod
    def flat(cls) -> QualityCurve:
        return cls(((1, 1.0),), "every token counts alike")

    def __call__(self, steps: float) -> float:
        """q of a delta that covered `steps` inner steps."""
        points = self.points
        if len(points) == 1 or steps <= 1:
            return 1.0
        i = min(bisect.bisect_right([h for h, _ in points], steps), len(points) - 1)
        (h0, q0), (h1, q1) = points[i - 1], points[i]
        slope = (q1 - q0) / math.log(h1 / h0)
        return max(FLOOR, min(1.0, q0 + slope * math.log(steps / h0)))


MEASURED = QualityCurve(
    (
        (1, 1.0),
        (12, factor_from_loss(QUALITY_H12_LOSS)),
        (24, factor_from_loss(QUALITY_H24_LOSS)),
        (48, factor_from_loss(QUALITY_H48_LOSS)),
    ),
    "measured at H = 12-48, 16 M tokens, 0.87 M parameters, against sync-avg (parameter"
    " averaging after each island's step); against data parallelism every q is lower:"
    " EXPERIMENTS.md, Quality",
)
