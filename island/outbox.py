"""The outbox: at most one pending delta per fragment.  Pure: no locks, clocks or sockets.

When the link is slower than deltas are made, a newer delta of a fragment whose older one is still
unsent is summed onto it.  Each is the change since the previous send or adoption, so the sum is
the change since the older one's anchor; their step and token counts add up and the newer base
version is kept.  The outbox therefore never holds more than P deltas, and no trained work is
dropped.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np


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


def summed(older: PendingDelta, newer: PendingDelta) -> PendingDelta:
    """`newer` on top of `older` (same fragment): deltas, steps and tokens added, `newer`'s base
    version."""
    return PendingDelta(
        newer.fragment,
        newer.base_version,
        {path: newer.delta[path] + older.delta[path] for path in newer.delta},
        newer.steps + older.steps,
        newer.tokens + older.tokens,
    )


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

    def take(self, ready: Callable[[PendingDelta], bool] | None = None) -> PendingDelta | None:
        """The oldest pending delta (of those `ready` accepts), removed from the outbox; None when
        there is none."""
        for fragment in self._order:
            if ready is None or ready(self._pending[fragment]):
                self._order.remove(fragment)
                return self._pending.pop(fragment)
        return None
