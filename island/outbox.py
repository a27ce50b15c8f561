"""The outbox: at most one pending delta per fragment, and when one may go.  Pure: no locks,
clocks or sockets (times are given).

When the link is slower than deltas are made, a newer delta of a fragment whose older one is still
unsent is summed onto it.  Each is the change since the previous send or adoption, so the sum is
the change since the older one's anchor; their step and token counts add up and the newer base
version is kept.  The outbox therefore never holds more than P deltas, and no trained work is
dropped.

Work held across a partition (`BusState`): while the delta bus is down nothing leaves the outbox,
so what the island trains meanwhile is summed there instead of queueing in ZeroMQ on one old base,
to be rejected as stale once the cut heals.  When the island adopts a newer value of a fragment
(adoption "rebase"), its unsent delta is rebased onto that version (`Outbox.rebase`): the work is
not in the new value, so it goes out as a change of it.  After the bus comes back a delta waits
(at most `REJOIN_WAIT_S`) until the island has adopted the newest value of its fragment heard
since, so that it does not go out on the base it was held on.  A delta summed from many is
scaled down to a few times the norm of the fragment's recent deltas (`held_scale`): the merger's
outlier check would otherwise reject the whole of it, and its fold clips a large part anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Callable, Sequence

import numpy as np

# a summed delta is scaled down to at most this times the norm of the fragment's recent deltas:
# the work of a long partition, summed, goes out within the merger's outlier check (20x the other
# islands' median, merger/fold/outliers.py) with room for islands that differ by a few times
HELD_NORM_FACTOR = 4.0
# after the delta bus comes back, a held delta waits at most this long for its fragment's newest
# value: about two of the merger's heartbeat timeouts, enough for a catch-up of the tests' and the
# profile's models over their links; a model whose catch-up takes longer sends on an older base
# (the staleness bound then decides)
REJOIN_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class PendingDelta:
    fragment: int
    # the fragment's version the work was last based on
    base_version: int
    # anchor - theta, float32
    delta: dict[str, np.ndarray]
    # inner steps of work it carries
    steps: int
    tokens: int
    # deltas summed into it (1: as the loop made it)
    parts: int = 1


def summed(older: PendingDelta, newer: PendingDelta) -> PendingDelta:
    """`newer` on top of `older` (same fragment): deltas, steps and tokens added, `newer`'s base
    version."""
    return PendingDelta(
        newer.fragment,
        newer.base_version,
        {path: newer.delta[path] + older.delta[path] for path in newer.delta},
        newer.steps + older.steps,
        newer.tokens + older.tokens,
        newer.parts + older.parts,
    )


def held_scale(norm: float, recent: Sequence[float], factor: float = HELD_NORM_FACTOR) -> float:
    """What a summed delta of norm `norm` is scaled by before it goes: 1, or down to `factor`
    times the median of `recent` (the norms of the fragment's last deltas as the loop made them).
    Without a reference, 1."""
    if not recent or norm <= 0:
        return 1.0
    limit = factor * statistics.median(recent)
    return 1.0 if norm <= limit else limit / norm


def rebased(pending: PendingDelta, version: int) -> PendingDelta:
    """`pending` as a change of `version` of its fragment, when that is newer than its base."""
    if version <= pending.base_version:
        return pending
    return dataclasses.replace(pending, base_version=version)


@dataclasses.dataclass
class BusState:
    """What the publisher knows of the delta bus: up or down, and, once it has come back, which
    versions of each fragment the island has heard of since (`sendable`)."""

    down: bool = False
    # when the bus last came back after being down; None: never down
    back_at: float | None = None
    # fragment -> (the newest version heard of, when it was last heard)
    heard: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def went_down(self) -> None:
        self.down = True

    def came_back(self, now: float) -> None:
        """The first connection is not a return: only a bus that was down waits for news."""
        if self.down:
            self.down, self.back_at = False, now

    def heard_of(self, fragment: int, version: int, now: float) -> None:
        if version >= self.heard.get(fragment, (-1, 0.0))[0]:
            self.heard[fragment] = (version, now)

    def sendable(self, pending: PendingDelta, now: float, wait_s: float = REJOIN_WAIT_S) -> bool:
        """Never while the bus is down.  Within `wait_s` of its return, only once a version of the
        fragment has been heard of since and the delta has been rebased onto the newest one."""
        if self.down:
            return False
        if self.back_at is None or now - self.back_at >= wait_s:
            return True
        version, when = self.heard.get(pending.fragment, (-1, float("-inf")))
        return when >= self.back_at and pending.base_version >= version


class Outbox:
    """Pending deltas, taken in the order their fragments became pending."""

    def __init__(self) -> None:
        self._pending: dict[int, PendingDelta] = {}
        self._order: collections.deque[int] = collections.deque()

    def __len__(self) -> int:
        return len(self._order)

    def put(self, delta: PendingDelta) -> bool:
        """Queue `delta`; True when it was summed onto an unsent delta of its fragment."""
        older = self._pending.get(delta.fragment)
        if older is None:
            self._order.append(delta.fragment)
            self._pending[delta.fragment] = delta
            return False
        self._pending[delta.fragment] = summed(older, delta)
        return True

    def rebase(self, fragment: int, version: int) -> bool:
        """The unsent delta of `fragment`, if any, as a change of `version` (when newer than its
        base).  True when one was rebased."""
        pending = self._pending.get(fragment)
        if pending is None or version <= pending.base_version:
            return False
        self._pending[fragment] = rebased(pending, version)
        return True

    def take(self, ready: Callable[[PendingDelta], bool] | None = None) -> PendingDelta | None:
        """The oldest pending delta (of those `ready` accepts), removed from the outbox; None when
        there is none."""
        for fragment in self._order:
            if ready is None or ready(self._pending[fragment]):
                self._order.remove(fragment)
                return self._pending.pop(fragment)
        return None
