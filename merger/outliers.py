"""Defence against poisoned deltas, as pure state the merger's core keeps per fragment.

A delta's norm is judged against recent history: the median norm of its sender's last deltas and the
median, over islands, of every island's own median (one island cannot move that by sending many
deltas, small or large).  A delta more than `factor` times the larger of the two is an outlier.  It is
rejected, not clipped: a clipped poisoned delta still moves the model in the attacker's direction,
and a rejection is counted, logged and acknowledged, so an honest island that trips it is seen.
Until a fragment has `min_fragment` admitted norms there is no reference (nothing is judged).

An island whose deltas are rejected as hostile `strikes` times in a row (outliers, non-finite
values, shapes or bases that no honest island sends) is quarantined: its deltas are refused for
`seconds`, then judged again.
"""

from __future__ import annotations

import bisect
import collections
import statistics

HOSTILE = frozenset({"outlier_norm", "non_finite", "layout_mismatch", "future_base"})


class NormHistory:
    """Recent admitted delta norms of one fragment, per island.  Each island's median and the sorted
    list of them are kept up to date on `record`, so judging a delta does not re-sort every island's
    history (hundreds of islands: the merger's receive path, and the simulator's)."""

    def __init__(self, window: int = 16, min_own: int = 4, min_fragment: int = 8) -> None:
        self.window, self.min_own, self.min_fragment = window, min_own, min_fragment
        self.norms: dict[str, collections.deque[float]] = {}
        self.medians: dict[str, float] = {}
        self._sorted: list[float] = []  # every island's median, sorted
        self._count = 0  # norms held, over every island

    def limit(self, island: str, factor: float) -> float | None:
        """The largest norm `island`'s next delta may have; None: no judgement (factor 0, or too little history)."""
        if factor <= 0 or self._count < self.min_fragment:
            return None
        middle = len(self._sorted) // 2
        reference = self._sorted[middle] if len(self._sorted) % 2 else (self._sorted[middle - 1] + self._sorted[middle]) / 2
        own = self.norms.get(island)
        if own is not None and len(own) >= self.min_own:
            reference = max(reference, self.medians[island])
        return factor * reference if reference > 0 else None

    def record(self, island: str, norm: float) -> None:
        own = self.norms.setdefault(island, collections.deque(maxlen=self.window))
        self._count += len(own) < self.window
        own.append(norm)
        if island in self.medians:
            del self._sorted[bisect.bisect_left(self._sorted, self.medians[island])]
        self.medians[island] = statistics.median(own)
        bisect.insort(self._sorted, self.medians[island])


class Quarantine:
    """Islands refused for a while after repeated hostile rejections; `now` is the caller's clock."""

    def __init__(self, strikes: int = 5, seconds: float = 60.0) -> None:
        self.strikes, self.seconds = strikes, seconds
        self.count: collections.Counter[str] = collections.Counter()
        self.until: dict[str, float] = {}

    def held(self, island: str, now: float) -> float:
        """Seconds of quarantine left for `island` (0: free)."""
        left = self.until.get(island, 0.0) - now
        if left <= 0 and island in self.until:
            del self.until[island]
        return max(0.0, left)

    def judge(self, island: str, reason: str, now: float) -> bool:
        """Note a delta's outcome (reason "" = admitted); True when this puts `island` in quarantine."""
        if reason not in HOSTILE:
            if not reason:
                self.count.pop(island, None)
            return False
        self.count[island] += 1
        if self.count[island] < self.strikes:
            return False
        del self.count[island]
        self.until[island] = now + self.seconds
        return True
