"""Rounds as the merger's core keeps them: deltas admitted and waiting for a fold (`Pending`, queued
per fragment with the arrival history the round policy decides from: `RoundQueues`), a round
taken and not yet computed (`StartedFold`), and the share of a round a fold stands for.

A fold's share (merge.share_window, merger/fold/weighting.py `fold_share`) compares its members' raw
weights with those of the islands that contributed within the last `window` versions; each fold
notes its members' (version, weight) for the next, so the record is part of the core's state
(checkpointed; replay rebuilds it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

from dloco.merger.config import MergeConfig, RoundConfig
from dloco.merger.fold.admission import Candidate
from dloco.merger.fold.merge import Contribution, canonical, counters, per_island
from dloco.merger.fold.weighting import capped, fold_share, raw_weights, recent_others
from dloco.merger.state.round_policy import ArrivalStats, decide, note_arrival, predicted_near
from dloco.protocol import DeltaResult

# (island, epoch, delta_id)
DeltaKey = tuple[str, int, int]


@dataclasses.dataclass(frozen=True)
class StartedFold:
    fragment: int
    version: int
    members: list[Contribution]
    results: list[DeltaResult]
    # of a whole round (weighting.fold_share)
    share: float = 1.0
    # island -> the most its part may move the fragment (merger/fold/clipping.py)
    caps: dict[str, float] | None = None
    # island -> the norm each of its deltas counts with at most (fold.part_allowed)
    limits: dict[str, float] | None = None


@dataclasses.dataclass(frozen=True)
class Pending:
    contribution: Contribution
    fragment: int
    arrived: float
    wal_index: int | None


def delta_key(contribution: Contribution) -> DeltaKey:
    return contribution.island, contribution.epoch, contribution.delta_id


def contribution_of(candidate: Candidate, staleness: int) -> Contribution:
    """An admitted delta as the fold takes it."""
    return Contribution(
        candidate.island,
        candidate.epoch,
        candidate.delta_id,
        staleness,
        candidate.tokens,
        candidate.steps,
        candidate.tensors,
    )


def take_share(
    contributions: dict[str, tuple[int, float]],
    members: Sequence[Contribution],
    version: int,
    config: MergeConfig,
) -> float:
    """The share of a round a fold of `members` makes `version` with; their contributions are noted
    in `contributions` (island -> (version of the fold that took its latest delta, that delta's raw
    weight)) and those older than the window dropped."""
    window = config.share_window
    if window == 0:
        return 1.0
    # an island's deltas weigh as one, as the fold weighs them
    groups = per_island(canonical(members))
    others = recent_others(contributions, {group[0].island for group in groups}, version, window)
    raw = capped(
        raw_weights([counters(group) for group in groups], config.staleness_power),
        others,
        # noted capped: one island's claims do not shrink the others' shares
        config.max_weight_ratio,
    )
    pairs = [(group[0].island, weight) for group, weight in zip(groups, raw)]
    share = fold_share(pairs, contributions, version, window)
    mine: dict[str, float] = {}
    for island, weight in pairs:
        mine[island] = mine.get(island, 0.0) + weight
    contributions.update({island: (version, weight) for island, weight in mine.items()})
    for island in [i for i, (at, _) in contributions.items() if version - at > window]:
        del contributions[island]
    return share


class RoundQueues:
    """Per fragment: the admitted deltas waiting for a fold, in arrival order, and each island's
    arrival history with its predicted next arrival: what the round policy
    (merger/state/round_policy.py) decides from."""

    def __init__(self, fragments: int, config: RoundConfig) -> None:
        self.config = config
        self.pending: list[list[Pending]] = [[] for _ in range(fragments)]
        # of every delta in `pending`
        self.keys: set[DeltaKey] = set()
        self.history: list[dict[str, ArrivalStats]] = [{} for _ in range(fragments)]
        # per fragment, (predicted next arrival, island) sorted: the round policy looks only at
        # islands predicted near `now`, not at every island's history (thousands of islands)
        self.predicted: list[list[tuple[float, str]]] = [[] for _ in range(fragments)]

    def holds(self, key: DeltaKey) -> bool:
        return key in self.keys

    def add(self, pending: Pending, observe_arrival: bool = True) -> None:
        """Queue an admitted delta; `observe_arrival`: note its arrival in the history (replay's
        deltas are not)."""
        self.pending[pending.fragment].append(pending)
        self.keys.add(delta_key(pending.contribution))
        if observe_arrival:
            note_arrival(
                self.history[pending.fragment],
                self.predicted[pending.fragment],
                pending.contribution.island,
                pending.arrived,
                self.config.ema_alpha,
            )

    def take(self, fragment: int) -> list[Contribution]:
        """Every delta queued for `fragment`, as a round's members."""
        queue, self.pending[fragment] = self.pending[fragment], []
        members = [p.contribution for p in queue]
        self.keys -= {delta_key(c) for c in members}
        return members

    def take_logged(
        self, fragment: int, wanted: Sequence[DeltaKey]
    ) -> tuple[list[Contribution], list[DeltaKey]]:
        """A logged fold's members out of `fragment`'s queue, in the fold record's order, and the
        keys the queue lacks (then nothing is taken)."""
        by_key = {delta_key(p.contribution): p for p in self.pending[fragment]}
        missing = [key for key in wanted if key not in by_key]
        if missing:
            return [], missing
        self.pending[fragment] = [p for key, p in by_key.items() if key not in set(wanted)]
        self.keys -= set(wanted)
        return [by_key[key].contribution for key in wanted], []

    def due(
        self,
        now: float,
        busy: Collection[int] = (),
        held: Callable[[int, set[str]], bool] | None = None,
    ) -> tuple[list[int], float | None]:
        """Fragments to fold now, and the earliest time a waiting fragment must be decided again.
        Fragments in `busy` (a fold of theirs still computing: their deltas wait for the next round,
        decided when it is done) are not looked at: with many islands their queues are long.
        `held(fragment, pending islands)`: the fragment waits, at most round.cold_wait_s past its
        oldest pending delta (merger/state/core.py `due`)."""
        ready, wake = [], None
        for fragment, queue in enumerate(self.pending):
            if not queue or fragment in busy:
                continue
            if held is not None and held(fragment, {p.contribution.island for p in queue}):
                until = min(p.arrived for p in queue) + self.config.cold_wait_s
                if now < until:
                    wake = until if wake is None else min(wake, until)
                    continue
            decision = decide(
                now,
                [(p.contribution.island, p.arrived) for p in queue],
                predicted_near(self.history[fragment], self.predicted[fragment], now, self.config),
                self.config,
            )
            if decision.fold:
                ready.append(fragment)
            elif decision.wait_until is not None:
                wake = decision.wait_until if wake is None else min(wake, decision.wait_until)
        return ready, wake

    def intervals(self, now: float | None = None) -> list[float | None]:
        """Every island's EMA interval between its deltas of one fragment, over every fragment: what
        holds snapshots (round_policy.snapshot_due; a fragment whose second round has not begun is
        held by what the others know of a round).  With `now`, an island silent on a fragment for
        more than two of its intervals has left (or stalled): its interval no longer counts."""
        return [
            stats.interval
            for history in self.history
            for stats in history.values()
            if now is None or stats.interval is None or now - stats.last <= 2 * stats.interval
        ]
