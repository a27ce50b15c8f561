"""What a trained token is worth once folded: the planner's quality factor of a delta's interval.

A delta that covers H inner steps is worth q(H) tokens of synchronous data-parallel training
(q(1) = 1): q(H) is the tokens a budgeted sync-DP run needs to reach the loss that a budgeted
decoupled run at interval H reaches, over the tokens that run trained.  `dloco plan` multiplies
every folded token by q of the steps its delta covered (a delta the outbox summed covers them all),
so an interval that grows on a slow link costs useful tokens, and sync-DiLoCo's tokens count q(H)
too.

The default curve is this repository's own measurement (EXPERIMENTS.md, "Quality": the quality
suite's q(H) table, `dloco experiment quality --from-results experiments/results/quality`), on the
0.87 M parameter model, 4 islands, 16 M cluster tokens (18 per parameter), the whole validation
split, against data parallelism (one AdamW on the all-reduced gradient of the global batch, its lr
tuned):
- data parallelism's final loss falls 0.246 per doubling of its budget between 2 M and 16 M tokens
  (1.883 at 2 M, 1.146 at 16 M, 3 seeds each), so a decoupled final loss L at 16 M is what it
  reaches with 16 M x 2^-((L - 1.146) / 0.246) tokens;
- H = 12 (6 on the half-speed islands, the shipped profile; 3 seeds): 1.249, so q(12) = 0.747;
- H = 96 (48 on the half-speed islands; one seed): 1.350, so q(96) = 0.562;
- H = 384 (192 on the half-speed islands; one seed): 2.012, so q(384) = 0.087, at the profile's
  outer lr (0.15); each island's own model ended at 1.44-1.54. Outer lr 0.35 gave 1.980 (0.095)
  and 0.7 2.312 (0.037): about five outer steps per fragment, so one seed moves it that much.
Between measured intervals q is linear in ln H; past the last one it goes on with the last
segment's slope, never below FLOOR.  At 2 M tokens the same model measured q(6) = 0.33, q(12) =
0.37, q(24) = 0.33, q(48) = 0.26 (3 seeds each), q(96) = 0.21.  Published runs at 35 M-1 B
parameters (Streaming DiLoCo, docs/design.md "Numbers to respect"; DiLoCo's scaling laws: M = 4
learners 2.0 % behind data parallelism at 35 M) put the gap far smaller, so at scale this curve is
pessimistic; a scenario's `[quality]` table replaces it with the user's own measurement.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from dloco.protocol.errors import require

FLOOR = 0.05
# data parallelism's final validation loss at 2 M and 16 M cluster tokens (3 seeds each), and
# decoupled's at 16 M at H = 12 (3 seeds), 96 and 384 (one each): EXPERIMENTS.md, "Quality"
SYNC_DP_LOSS_2M = 1.8828
SYNC_DP_LOSS_16M = 1.1459
QUALITY_H12_LOSS = 1.2491
QUALITY_H96_LOSS = 1.3500
QUALITY_H384_LOSS = 2.0118


def slope_per_doubling(small: tuple[int, float], large: tuple[int, float]) -> float:
    """A reference's final loss fall per doubling of its budget, from (tokens, loss) at two
    budgets."""
    (b0, l0), (b1, l1) = small, large
    require(
        0 < b0 < b1 and l0 > l1,
        f"a slope needs a larger budget at a lower loss, got {small} and {large}",
    )
    return (l0 - l1) / math.log2(b1 / b0)


def factor_from_loss(loss: float, reference: float, slope: float) -> float:
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


SYNC_DP_SLOPE = slope_per_doubling((2_000_000, SYNC_DP_LOSS_2M), (16_000_000, SYNC_DP_LOSS_16M))
MEASURED = QualityCurve(
    (
        (1, 1.0),
        (12, factor_from_loss(QUALITY_H12_LOSS, SYNC_DP_LOSS_16M, SYNC_DP_SLOPE)),
        (96, factor_from_loss(QUALITY_H96_LOSS, SYNC_DP_LOSS_16M, SYNC_DP_SLOPE)),
        (384, factor_from_loss(QUALITY_H384_LOSS, SYNC_DP_LOSS_16M, SYNC_DP_SLOPE)),
    ),
    "measured at H = 12, 96 and 384, 16 M tokens, 0.87 M parameters, against data parallelism on"
    " the validation split (H = 384 at an outer lr tuned for 12-48): EXPERIMENTS.md, Quality",
)
