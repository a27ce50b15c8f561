"""What a simulated run produced (sim/engine.py): per island its tokens (trained, folded, useful,
lost, undecided), time and bytes; for the run its folds, staleness, real intervals and the merger's
backlog; and the utilisation that counts, read from them."""

from __future__ import annotations

import collections
import dataclasses
import functools

from dloco.sim.scenario import Scenario


@dataclasses.dataclass
class IslandRun:
    """What happened to one island."""

    name: str
    trained_tokens: int = 0
    # trained but never folded (killed before sending, or rejected), per fragment / P
    lost_tokens: float = 0.0
    # reason -> deltas
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    compute_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    deltas_sent: int = 0
    deltas_summed: int = 0
    failures: int = 0
    # of its trained work, folded by the end (per fragment / P, as lost_tokens)
    folded_tokens: float = 0.0
    # folded, each delta's tokens times q(the steps it covered)
    useful_tokens: float = 0.0
    # at the end still on the island or on its way: unsent, in its outbox, on the wire
    undecided_tokens: float = 0.0
    # the same, each part times q(the steps it will cover once sent): what it will be worth at best
    undecided_useful: float = 0.0
    # its first join: from its start to its first step (the model's download)
    startup_s: float = 0.0
    # steps each of its folded deltas covered: its real H
    intervals: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SimResult:
    scenario: Scenario
    islands: list[IslandRun]
    # per fragment
    folds: list[int]
    # staleness -> deltas folded with it
    staleness: collections.Counter
    folded_tokens: int
    # the fold worker's busy time
    fold_busy_s: float
    # coded delta bytes admitted and waiting for (or in) a fold, at most
    peak_pending_bytes: int
    events: int
    # per fragment, the steps each folded delta covered
    intervals: list[list[int]]
    # coded delta bytes admitted and not folded at the end
    queued_bytes: int
    # their tokens (per fragment / P)
    queued_tokens: float
    # per merger shard, the folding its worker still had ahead of it at the end
    backlog_s: list[float]

    @property
    def duration_s(self) -> float:
        return self.scenario.duration_s

    @functools.cached_property
    def _specs(self) -> dict:
        return {spec.name: spec for spec in self.scenario.islands}

    def _spec(self, run: IslandRun):
        return self._specs[run.name]

    def nominal_quality(self, run: IslandRun) -> float:
        """q of the island's own H: what its tokens are worth when every delta goes out on time."""
        return self.scenario.quality(self._spec(run).interval or self.scenario.interval)

    def capacity_tokens(self, run: IslandRun) -> float:
        """The work its chips could do in the steady state: from its first step (the start-up
        download is reported apart) to the end, trained or idle after a failure."""
        spec = self._spec(run)
        idle = max(0.0, self.duration_s - spec.start_s - run.startup_s - run.compute_s)
        return run.trained_tokens + idle * spec.tokens_per_step / spec.step_s

    def utilisation(self, run: IslandRun) -> float:
        """Steady-state utilisation that counts: of its capacity, the share folded, each delta
        weighted by q(the steps it covered) over q(its own H); work not yet at the merger at the end
        counts as it will at best, at q(the steps it covers so far).  Work rejected, lost to a
        failure or queued at an overloaded merger lowers it; so do deltas the outbox summed on a
        slow link (a longer real H).
        """
        capacity = self.capacity_tokens(run) * self.nominal_quality(run)
        return (
            min(1.0, (run.useful_tokens + run.undecided_useful) / capacity) if capacity > 0 else 0.0
        )

    def window_utilisation(self, run: IslandRun) -> float:
        """The same over the whole run, its start-up download and unfinished tail included."""
        spec = self._spec(run)
        return run.useful_tokens / (
            self.duration_s * spec.tokens_per_step / spec.step_s * self.nominal_quality(run)
        )

    @property
    def useful_tokens_s(self) -> float:
        """Useful (sync-DP-equivalent) tokens per second in the steady state."""
        return sum(
            self.utilisation(run) * self.nominal_quality(run) * spec.tokens_per_step / spec.step_s
            for run, spec in zip(self.islands, self.scenario.islands)
        )

    @property
    def goodput(self) -> float:
        """Useful tokens over the whole run, over what every island's chips could train in it at
        full speed."""
        return (
            sum(run.useful_tokens for run in self.islands)
            / self.duration_s
            / self.scenario.peak_tokens_s
        )

    @property
    def fold_load(self) -> float:
        """The folding asked of each shard's worker over the run's length: above 1 the merger falls
        behind."""
        return self.fold_busy_s / (self.duration_s * self.scenario.merger_shards)
