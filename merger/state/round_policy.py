"""When to fold: a pure function of the pending arrivals, the clock reading and arrival history.

Rule (per fragment):
1. Fewer than K islands with a delta pending: wait for more, but never past ``oldest +
   quorum_timeout`` (a dead island must not stall the run; K = 1 folds on the first arrival).  The
   quorum counts islands, not deltas: two deltas of one island (it gave up waiting for a fold and
   sent its next) do not stand in for an island that has not arrived.
2. Quorum met at time q: fold now unless some island not yet pending is *predicted* (last arrival
   + EMA of its inter-arrival time) to arrive before ``q + grace_cap``; then wait until the
   earliest such prediction plus a small slack.  A prediction that has passed no longer counts,
   so each wait ends in a fold or a shorter wait; no wait goes past ``q + grace_cap``.

Also here: the arrival history a fragment keeps for the rule (`note_arrival`, with each island's
predicted next arrival kept sorted, so that `predicted_near` hands `decide` only the islands it
could wait for), and, as pure clock arithmetic, when snapshots are due (`snapshot_due`) and how
many catch-up replies a peer may still have (`CatchUpBudget`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from dloco.merger.config import RoundConfig

# intervals: a longer gap between an island's deltas of a fragment starts its history again
# (observe)
ABSENCE = 4


@dataclasses.dataclass(frozen=True)
class ArrivalStats:
    """One island's arrival history for one fragment."""

    # time of its latest delta
    last: float
    # EMA of the time between its deltas; None after a single arrival
    interval: float | None


@dataclasses.dataclass(frozen=True)
class Decision:
    fold: bool
    # when to decide again if not folding; None: only on the next arrival
    wait_until: float | None


def observe(stats: ArrivalStats | None, now: float, alpha: float) -> ArrivalStats:
    """Arrival history after a delta arrives at `now`.  A gap of more than ABSENCE intervals is an
    absence (a failure, a partition), not a long round: the history starts again, so that an island
    back from one does not stretch the mean round, which holds every fragment's snapshots
    (snapshot_due), for many rounds: in `dloco plan`'s seed scenario, one short failure left every
    island's deltas stale for many times its length (EXPERIMENTS.md)."""
    if stats is None:
        return ArrivalStats(last=now, interval=None)
    gap = max(0.0, now - stats.last)
    if stats.interval is not None and gap > ABSENCE * stats.interval:
        return ArrivalStats(last=now, interval=None)
    interval = gap if stats.interval is None else alpha * gap + (1 - alpha) * stats.interval
    return ArrivalStats(last=now, interval=interval)


def note_arrival(
    history: dict[str, ArrivalStats],
    predicted: list[tuple[float, str]],
    island: str,
    arrived: float,
    alpha: float,
) -> None:
    """Note a delta of `island` arriving at `arrived` in a fragment's history (`observe`) and in its
    predictions: (predicted next arrival, island), kept sorted."""
    old = history.get(island)
    new = history[island] = observe(old, arrived, alpha)
    if old is not None and old.interval is not None:
        del predicted[bisect.bisect_left(predicted, (old.last + old.interval, island))]
    if new.interval is not None:
        bisect.insort(predicted, (new.last + new.interval, island))


def predicted_near(
    history: Mapping[str, ArrivalStats],
    predicted: Sequence[tuple[float, str]],
    now: float,
    config: RoundConfig,
) -> dict[str, ArrivalStats]:
    """The arrival history of the islands whose next delta is predicted within (now -
    grace_slack, now + grace_cap]: the only ones `decide` can wait for (its deadline is at most
    now + grace_cap, and it drops predictions older than the slack), so its decision is the one
    over every island.
    """
    lo = bisect.bisect_left(predicted, (now - config.grace_slack_s,))
    hi = bisect.bisect_right(predicted, (now + config.grace_cap_s, "\U0010ffff"))
    return {island: history[island] for _, island in predicted[lo:hi]}


def decide(
    now: float,
    pending: Sequence[tuple[str, float]],
    history: Mapping[str, ArrivalStats],
    config: RoundConfig,
) -> Decision:
    """`pending`: (island, arrival time) of admitted deltas not folded yet, oldest first."""
    if not pending:
        return Decision(False, None)
    oldest = min(t for _, t in pending)
    # each island's earliest pending arrival
    first: dict[str, float] = {}
    for island, at in pending:
        first[island] = min(at, first.get(island, at))
    if len(first) < config.quorum:
        deadline = oldest + config.quorum_timeout_s
        return Decision(True, None) if now >= deadline else Decision(False, deadline)
    quorum_met = sorted(first.values())[config.quorum - 1]
    deadline = quorum_met + config.grace_cap_s
    if now >= deadline:
        return Decision(True, None)
    waiting_for = {island for island, _ in pending}
    predictions = [
        stats.last + stats.interval
        for island, stats in history.items()
        if island not in waiting_for
        and stats.interval is not None
        and now < stats.last + stats.interval + config.grace_slack_s
    ]
    upcoming = [p for p in predictions if p <= deadline]
    if not upcoming:
        return Decision(True, None)
    return Decision(False, min(min(upcoming) + config.grace_slack_s, deadline))


def snapshot_due(
    last_published: float | None, intervals: Iterable[float | None], every_round: float
) -> float:
    """When a fragment's next snapshot may go on the bus: `every_round` times the mean of
    `intervals` (each island's EMA interval between its deltas of one fragment, over every fragment:
    each island sends every fragment once per round, so the mean is the islands' mean round) after
    its last one.  Folds in between are held and go out together (a diff covers them all).  Every
    island receives each fragment once per mean round and sends it once per round of its own, so
    the downlink equals the uplink summed over the islands (at most: the harmonic mean is at most
    the mean), and an island's ratio is its round over the mean.  -inf (publish now) when the policy
    is off (0), nothing was published yet, or no interval is known."""
    known = [interval for interval in intervals if interval is not None]
    if every_round <= 0 or last_published is None or not known:
        return -math.inf
    return last_published + every_round * math.fsum(known) / len(known)


class CatchUpBudget:
    """How many catch-up replies one peer may still have: a token bucket holding 2 * fragments + 8
    replies, refilled at `fragments` a second.  A joining island asks for every fragment once, and
    one that misses diffs asks for a fragment at most once a second: both stay well within it."""

    def __init__(self, fragments: int) -> None:
        self.capacity, self.rate = 2 * fragments + 8, float(fragments)
        self.tokens, self.at = float(self.capacity), None

    def take(self, now: float) -> bool:
        """Spend one reply at time `now`; False when none is left."""
        if self.at is not None:
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
