"""Defence against poisoned deltas, as pure state the merger's core keeps per fragment.

Two histories per fragment, each of recent values per island:
- the norms of admitted deltas (`NormHistory` in `norms`): a delta more than `outlier_factor`
  times the median of the *other* islands' medians (while there are none, its own median) is
  rejected as an outlier at arrival (counted, logged, acknowledged, and a strike towards
quarantine);
- what each island's part of a fold moved the fragment (its weight in the fold times the norm of
  its combined delta; `moves`): a fold clips an island's part to `clip_factor` times the largest of
  the *other* islands' medians (`fold_caps`; merger/fold/merge.py `guard` clips).

A sender's own history never enters its own reference, so no sequence of its deltas (a slow ramp,
a burst) raises what it may send: the reference is the other islands' behaviour, which one key
cannot walk.  An island's median counts once it holds `min_own` values, so a new island's first
deltas do not set anyone's reference.  Before any other island has a reference (a cluster of one
island, or the first folds of a run), an island's part of a fold may move a fragment by at most
COLD_LIMIT times the fragment's own norm, and each of its deltas counts at most `cold_factor` times
the largest delta norm the other islands have on record, however few (`delta_limits`): a
key's 1e6x first delta, or a burst of them, beside an honest island's first delta keeps at most
that.  A key that sends before any other island has sent a delta to the fragment meets only
COLD_LIMIT.  A zero reference caps nothing.  Both histories are
checkpointed and rebuilt by replay, so a restarted merger or a standby that takes over judges with
the same references (merger/state/checkpoint.py).

An island whose deltas are rejected as hostile `strikes` times in a row (outliers, non-finite
values, shapes or bases that no honest island sends) is quarantined: its deltas are refused for
`seconds`, then judged again.
"""

from __future__ import annotations

import bisect
import collections
import functools
import statistics
from collections.abc import Callable, Iterable
from typing import NamedTuple

HOSTILE = frozenset({"outlier_norm", "non_finite", "layout_mismatch", "future_base"})
# without a reference, one island's part of a fold moves a fragment by at most this times its norm
COLD_LIMIT = 0.5
# (the tiny LM's first folds move a fragment by about a tenth of its norm)


class NormHistory:
    """Recent values (delta norms, or fold movements) of one fragment, per island.  The medians of
    the islands that hold at least `min_own` values are kept sorted on `record`, so a reference
    costs no sort of every island's history (thousands of islands: the merger's receive path, and
    the simulator's)."""

    def __init__(self, window: int = 16, min_own: int = 4) -> None:
        self.window, self.min_own = window, min_own
        self.norms: dict[str, collections.deque[float]] = {}
        # of the islands with at least min_own values
        self.medians: dict[str, float] = {}
        # those medians, sorted
        self._sorted: list[float] = []

    def reference(self, island: str, statistic: str = "median") -> float | None:
        """The median (or "max") over the other islands' medians; None when no other island has
        one."""
        values, own = self._sorted, self.medians.get(island)
        n = len(values) - (own is not None)
        if n <= 0:
            return None
        skip = bisect.bisect_left(values, own) if own is not None else len(values)

        def at(k: int) -> float:
            return values[k + (k >= skip)]

        if statistic == "max":
            return at(n - 1)
        middle = n // 2
        return at(middle) if n % 2 else (at(middle - 1) + at(middle)) / 2

    def limit(self, island: str, factor: float) -> float | None:
        """The largest norm `island`'s next delta may have: `factor` times the other islands'
        median, or while no other island has one, its own (an island alone is judged against itself:
        a jump is caught, a ramp is not, and nobody else's work is at stake until another island has
        a history); None: no judgement (factor 0, or no history yet)."""
        if factor <= 0:
            return None
        reference = self.reference(island)
        reference = self.medians.get(island) if reference is None else reference
        return factor * reference if reference is not None and reference > 0 else None

    def record(self, island: str, value: float) -> None:
        own = self.norms.setdefault(island, collections.deque(maxlen=self.window))
        own.append(value)
        if island in self.medians:
            del self._sorted[bisect.bisect_left(self._sorted, self.medians.pop(island))]
        if len(own) >= self.min_own:
            self.medians[island] = statistics.median(own)
            bisect.insort(self._sorted, self.medians[island])

    def export(self) -> dict[str, list[float]]:
        return {island: list(values) for island, values in sorted(self.norms.items())}

    def restore(self, data: dict[str, list[float]]) -> None:
        """Replace the history with `export`'s (a checkpoint's)."""
        self.norms, self.medians, self._sorted = {}, {}, []
        for island, values in data.items():
            for value in values:
                self.record(island, float(value))


class Quarantine:
    """Islands refused for a while after repeated hostile rejections; `now` is the caller's
    clock."""

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
        """Note a delta's outcome (reason "" = admitted); True when this puts `island` in
        quarantine."""
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


class ParamNorm(NamedTuple):
    """A fragment's norm as the guard asks for it: `exact()`, and `lower()`, a float never above
    it that costs a fraction of a pass (merger/state/param_norms.py)."""

    exact: Callable[[], float]
    lower: Callable[[], float]


class ColdCap(NamedTuple):
    """COLD_LIMIT times the fragment's norm, computed only where it can matter: a part that moves
    the fragment by at most `lower` (COLD_LIMIT times the norm's lower bound) is under the cap
    whatever its exact value, so only a part that moves more asks for `exact()` (None: a zero
    norm, which caps nothing; merger/fold/clipping.py `clip_factors`)."""

    lower: float
    exact: Callable[[], float | None]


def fold_caps(
    moves: NormHistory,
    params_norm: ParamNorm,
    islands: Iterable[str],
    factor: float,
) -> dict[str, float | ColdCap] | None:
    """The guard's cap on each island's part of a fold (merger/fold/merge.py `guard`): `factor`
    (clip_factor) times the largest of the other islands' median movements in `moves`; without
    one, a ColdCap: COLD_LIMIT times the norm of the fragment's parameters (`params_norm`, asked
    for only then).  None: the guard is off."""
    if factor <= 0:
        return None
    caps, cold = {}, None
    for island in islands:
        reference = moves.reference(island, "max")
        if reference is None:
            cold = caps[island] = _cold_cap(params_norm) if cold is None else cold
        # a zero reference (a fragment at zero, or that nobody moves) caps nothing
        elif reference > 0:
            caps[island] = factor * reference
    return caps


def _cold_cap(params_norm: ParamNorm) -> ColdCap:
    # a started fold keeps its caps: they hold the exact norm's function, not the ParamNorm
    norm = params_norm.exact

    @functools.cache
    def exact() -> float | None:
        cap = COLD_LIMIT * norm()
        return cap if cap > 0 else None

    return ColdCap(COLD_LIMIT * params_norm.lower(), exact)


def delta_limits(
    norms: NormHistory, moves: NormHistory, islands: Iterable[str], factor: float
) -> dict[str, float] | None:
    """For each of `islands` without a movement reference in `moves` (its first folds on a fresh
    merger, where `fold_caps` has only the fragment's norm): the most each of its deltas counts with
    in a fold (merger/fold/merge.py `part_allowed`), `factor` (merge.cold_factor) times the largest
    delta norm any other island has on record in `norms` (one is enough).  The largest, not a
    median: under a warm-up schedule an island's first deltas are tiny or zero, and one ahead of the
    others sends larger ones than they have.  An island no other island has sent a nonzero delta
    beside gets none.  None: off."""
    if factor <= 0:
        return None
    cold = [island for island in islands if moves.reference(island, "max") is None]
    if not cold:
        return {}
    largest = sorted(
        ((max(values), island) for island, values in norms.norms.items() if values), reverse=True
    )
    limits = {}
    for island in cold:
        reference = next((norm for norm, other in largest if other != island), None)
        if reference is not None and reference > 0:
            limits[island] = factor * reference
    return limits


def holds(config, live: int) -> bool:
    """Whether a fresh merger's first folds wait for another island (merger/state/core.py `due`):
    with `live` (islands heard from lately) at two or more, round.cold_wait_s set, and each delta
    judged in a fold (merge.cold_factor, within the guard: merge.clip_factor)."""
    merge = config.merge
    return (
        live >= 2
        and config.round.cold_wait_s > 0
        and merge.cold_factor > 0
        and merge.clip_factor > 0
    )


def unjudged(norms: NormHistory, moves: NormHistory, islands: Iterable[str]) -> bool:
    """Whether one of `islands` has a nonzero delta in `norms` and nothing to judge it against:
    no movement reference in `moves`, and no other island with a nonzero delta norm there (a
    fresh merger's first folds; merger/state/core.py `due` holds such a fold while another island is
    live).  Zero deltas (a warm-up's first, or every island's in a synchronous baseline's first
    round) are never held: they cannot move the model."""
    # after a fragment's first folds every island has a reference: no pass over the histories
    cold = [island for island in islands if moves.reference(island, "max") is None]
    if not cold:
        return False
    largest = {island: max(values, default=0.0) for island, values in norms.norms.items()}
    for island in cold:
        if largest.get(island, 0.0) > 0 and not any(
            norm > 0 for other, norm in largest.items() if other != island
        ):
            return True
    return False
