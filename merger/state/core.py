"""The merger's state machine: admit, log, decide, fold.  No sockets and no clock reads.

`MergerCore` owns the global model (one `FragmentState` per fragment; a merger shard's core holds
values for its own fragments only, and empty states for the others) and applies the pure core
(`admission`, `round_policy`, `rounds`, `fold`).  It writes every admitted delta to the write-ahead
log *before* it can be folded, and a fold record naming the round's members after each fold, so the
log alone determines the model: replay and crash recovery feed the same records back through
`apply_record`.  Time is passed in by the caller.
"""

# Over 400 lines: one state machine (offer, admit, fold, install, settle) over shared fields;
# its parts that stand alone are the rest of this package.

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from dloco.merger.config import MergerConfig
from dloco.merger.engines import coded
from dloco.merger.fold import outliers
from dloco.merger.fold.admission import Candidate, admit, delta_norm
from dloco.merger.fold.merge import (
    Contribution,
    FoldReport,
    FragmentState,
    PendingStep,
    ReplayError,
    fold,
    init_state,
    taken,
)
from dloco.merger.fold.outer import make_step, outer_optimizer
from dloco.merger.fold.outliers import NormHistory, Quarantine, delta_limits, fold_caps
from dloco.merger.fold.warmup import warm_up_folds
from dloco.merger.log import records
from dloco.merger.log.wal import Log
from dloco.merger.state.param_norms import ParamNorms
from dloco.merger.state.round_policy import ArrivalStats
from dloco.merger.state.rounds import (
    DeltaKey,
    Pending,
    RoundQueues,
    StartedFold,
    contribution_of,
    take_share,
)
from dloco.protocol import Assembled, Codec, DeltaResult


class MergerCore:
    def __init__(
        self,
        config: MergerConfig,
        model: str,
        fragments: Sequence[Sequence[str]],
        params: Mapping[str, np.ndarray],
        log: Log | None = None,
        remember: int = 1 << 16,
    ) -> None:
        self.config, self.model, self.log, self.remember = config, model, log, remember
        self.fragments = [list(f) for f in fragments]
        self.optimizer = outer_optimizer(config.outer)
        self._step = make_step(self.optimizer)
        held = records.held_fragments(self.fragments, params)
        self.layouts = [
            {path: tuple(np.shape(params[path])) for path in paths} if mine else {}
            for paths, mine in zip(self.fragments, held)
        ]
        self.states = [
            init_state({path: params[path] for path in paths} if mine else {}, self.optimizer)
            for paths, mine in zip(self.fragments, held)
        ]
        self.queues = RoundQueues(len(self.fragments), config.round)
        # fragment -> version of its latest started fold
        self._started: dict[int, int] = {}
        # per fragment, island -> (version of the fold that took its latest delta, that delta's raw
        # weight): who makes up a whole round, for merge.share_window (checkpointed; replay rebuilds
        # it)
        self.last_contributions: list[dict[str, tuple[int, float]]] = [{} for _ in self.fragments]
        self.settled: collections.OrderedDict[DeltaKey, DeltaResult] = collections.OrderedDict()
        self.rejected: collections.Counter[str] = collections.Counter()
        # per fragment (merger/fold/outliers.py; checkpointed, rebuilt by replay): recent admitted
        # delta norms, the outlier check's reference; and what each island's part of a fold moved
        # it, the guard's
        self.norms = [NormHistory() for _ in self.fragments]
        self.moves = [NormHistory() for _ in self.fragments]
        self.quarantine = Quarantine()
        # the guard's cold reference, computed ahead (merger/state/param_norms.py)
        self.param_norms = ParamNorms()
        # memory every fold from dense codes reuses (coded.Scratch)
        self.scratch = coded.Scratch()
        # (island, last reason, seconds): newly quarantined, for the caller to log
        self.quarantined: list[tuple[str, str, float]] = []
        # island -> (epoch, seq): stream messages up to seq are settled and were acknowledged as
        # such
        self.cursors: dict[str, tuple[int, int]] = {}
        # a merger shard's fragments (None: every one); others are rejected
        self.owned = None if all(held) else frozenset(i for i, mine in enumerate(held) if mine)
        if log is not None and log.next_index == 0:
            log.append(*records.genesis_record(config.to_dict(), model, self.fragments, params))

    @property
    def pending(self) -> list[list[Pending]]:
        """Per fragment, the admitted deltas waiting for a fold, in arrival order."""
        return self.queues.pending

    @property
    def history(self) -> list[dict[str, ArrivalStats]]:
        """Per fragment, island -> its arrival history (the round policy's)."""
        return self.queues.history

    @classmethod
    def from_genesis(cls, record: dict, log: Log | None = None) -> MergerCore:
        return cls(
            MergerConfig.from_dict(record["config"]),
            record["model"],
            record["fragments"],
            records.params_from_genesis(record),
            log,
        )

    # ---- live path -----------------------------------------------------------------------------
    def submit(self, assembled: Assembled, now: float) -> DeltaResult | None:
        """Admit (log + queue) a reassembled delta.  Returns its result if it is settled already
        (rejected now, or a duplicate of a settled delta); None when it waits for a fold."""
        head = assembled.header
        key = (head.sender, head.epoch, head.delta_id)
        settled = (
            key in self.settled
            or self.queues.holds(key)
            or head.fragment >= len(self.fragments)
            or (self.owned is not None and head.fragment not in self.owned)
            # decided before its tensors are looked at
            or self.quarantine.held(head.sender, now) > 0
        )
        candidate = records.delta_candidate(assembled, tensors=not settled)
        return self.offer(
            candidate, now, lambda staleness: records.delta_record(assembled, staleness)
        )

    def offer(self, candidate: Candidate, now: float, record=None) -> DeltaResult | None:
        """`submit` for a delta already decoded: the merger's whole decision about one delta
        (duplicate, quarantine, admission, outlier history, queueing for the round policy), which
        the simulator (sim/) drives with tiny tensors.  `record(staleness)`: the log record of an
        admitted delta (None: nothing is logged)."""
        if self.log is not None and record is None:
            raise ValueError(
                "a merger with a log needs each admitted delta's log record: replay folds from the"
                " log alone"
            )
        key = (candidate.island, candidate.epoch, candidate.delta_id)
        if key in self.settled:
            return self.settled[key]
        if self.queues.holds(key):
            return None
        if (refusal := self._refusal(candidate, now)) is not None:
            return self._reject(key, candidate.fragment, *refusal)
        history = self.norms[candidate.fragment]
        verdict = admit(
            candidate,
            version=self.version(candidate.fragment),
            layout=self.layouts[candidate.fragment],
            model=self.model,
            max_staleness=self.config.merge.max_staleness,
            norm_limit=history.limit(candidate.island, self.config.merge.outlier_factor),
        )
        if self.quarantine.judge(candidate.island, verdict.reason, now):
            self.quarantined.append((candidate.island, verdict.reason, self.quarantine.seconds))
        if not verdict.admitted:
            return self._reject(
                key, candidate.fragment, f"{verdict.reason}: {verdict.detail}"[:256], verdict.reason
            )
        history.record(candidate.island, verdict.norm)
        wal_index = (
            self.log.append(*record(verdict.staleness), frozen=True)
            if self.log is not None and record is not None
            else None
        )
        contribution = contribution_of(candidate, verdict.staleness)
        self.queues.add(Pending(contribution, candidate.fragment, now, wal_index))
        return None

    def _refusal(self, candidate: Candidate, now: float) -> tuple[str, str | None] | None:
        """Why a delta is refused before its tensors are looked at, (reason, label): an unknown
        fragment, another shard's, a quarantined island's; None: none of these."""
        if candidate.fragment >= len(self.fragments):
            return "unknown_fragment", None
        if self.owned is not None and candidate.fragment not in self.owned:
            return f"fragment {candidate.fragment} belongs to another merger shard", "other_shard"
        if (left := self.quarantine.held(candidate.island, now)) > 0:
            reason = (
                f"quarantined: {candidate.island} is refused for {left:.0f} s more after repeated"
                " hostile deltas"
            )
            return reason, "quarantined"
        return None

    def due(
        self, now: float, busy: Collection[int] = (), live: int = 1
    ) -> tuple[list[int], float | None]:
        """Fragments to fold now, and the earliest time a waiting fragment must be decided again
        (RoundQueues.due: `busy` fragments are not looked at; with `live` islands heard from lately,
        a fresh merger's first folds wait for another's nonzero delta: outliers.holds)."""
        held = self._unjudged if outliers.holds(self.config, live) else None
        return self.queues.due(now, busy, held)

    def arrival_intervals(self, now: float | None = None) -> list[float | None]:
        """Every island's EMA interval between its deltas of one fragment, over every fragment,
        but for islands silent for more than two of theirs at `now` (RoundQueues.intervals)."""
        return self.queues.intervals(now)

    def version(self, fragment: int) -> int:
        """The fragment's version: its latest fold, counting one started and still computing."""
        return max(self.states[fragment].version, self._started.get(fragment, 0))

    def start_fold(self, fragment: int) -> StartedFold:
        """Take every pending delta of `fragment` as a round: from now on the fragment is at the
        round's version (admission counts staleness against it), the fold is logged and its deltas
        settled.  The parameters come from `compute_fold` (possibly on another thread) and
        `install`.
        """
        members = self.queues.take(fragment)
        version = self._started[fragment] = self.version(fragment) + 1
        if self.log is not None:
            self.log.append(
                records.fold_record(
                    fragment, version, [(c.island, c.epoch, c.delta_id) for c in members]
                )
            )
        share = take_share(self.last_contributions[fragment], members, version, self.config.merge)
        return StartedFold(
            fragment,
            version,
            members,
            self._settle_folded(fragment, members, version),
            share,
            *self._guard(fragment, members),
        )

    def compute_fold(self, started: StartedFold) -> tuple[PendingStep, FoldReport]:
        """A started round up to its outer step, from the fragment's current state, which `install`
        takes (any thread; the fragment's previous round must be installed)."""
        state, report = fold(
            self.states[started.fragment],
            started.members,
            self.config.merge,
            self._step,
            started.share,
            started.caps,
            started.limits,
            in_place=True,
            scratch=self.scratch,
        )
        if report.version != started.version:
            raise ReplayError(
                f"fold of fragment {started.fragment} produced version {report.version}, expected"
                f" {started.version}"
            )
        return state, report

    def install(
        self, fragment: int, state: FragmentState | PendingStep, report: FoldReport
    ) -> FragmentState:
        """Make a computed round the fragment's state (what checkpoints and catch-up requests see),
        a pending outer step taken in place on the state it replaces (`fold.taken`), and note what
        each island's part moved it (the guard's history).  Whatever reads the state it replaces
        (a norm computed ahead, a step reading the fold's scratch) is done first."""
        self.param_norms.settle(fragment)
        self.scratch.settle()
        state = self.states[fragment] = taken(self.states[fragment], state, fragment)
        self.scratch.read_by(state)
        for island, movement in report.movements:
            self.moves[fragment].record(island, movement)
        self.param_norms.installed(fragment, state.params, self.moves[fragment], report.movements)
        return state

    def finish_fold(self, started: StartedFold) -> FoldReport:
        """Compute a started round and install it."""
        state, report = self.compute_fold(started)
        self.install(started.fragment, state, report)
        return report

    def fold(self, fragment: int) -> tuple[FoldReport, list[DeltaResult]]:
        """Fold every pending delta of `fragment` now; log the fold; return the report and
        results."""
        started = self.start_fold(fragment)
        return self.finish_fold(started), started.results

    # ---- replay and recovery -----------------------------------------------------------------
    def apply_record(self, record: dict, index: int, requeue: bool = False) -> FoldReport | None:
        """Re-apply one logged record (delta: queue it as logged; fold: fold exactly its members).
        `requeue`: a delta a checkpoint holds as pending, whose norm its history already has."""
        if record["type"] == records.CURSORS:
            self.cursors.update({island: (epoch, seq) for island, epoch, seq in record["cursors"]})
            return None
        if record["type"] == records.TERM:
            return None
        if record["type"] == records.DELTA:
            contribution = records.contribution_from_record(record)
            if not requeue:
                # as admission did
                self.norms[record["fragment"]].record(
                    contribution.island, delta_norm(contribution.tensors)
                )
            self.queues.add(
                Pending(contribution, record["fragment"], 0.0, index), observe_arrival=False
            )
            return None
        if record["type"] != records.FOLD:
            raise ReplayError(f"log record {index} has unexpected type {record['type']!r}")
        fragment, wanted = record["fragment"], [tuple(m) for m in record["members"]]
        members, missing = self.queues.take_logged(fragment, wanted)
        if missing:
            raise ReplayError(
                f"log record {index}: fold of fragment {fragment} names deltas not in the log:"
                f" {missing[:3]}"
            )
        report = self._apply_fold(fragment, members)
        if report.version != record["version"]:
            raise ReplayError(
                f"log record {index}: fold produced version {report.version}, log says"
                f" {record['version']}"
            )
        self._settle_folded(fragment, members, report.version)
        return report

    def record_cursors(self, cursors: dict[str, tuple[int, int]]) -> bool:
        """Log cursors (before they are published: a restarted merger resumes from them, and
        senders keep everything after them).  Returns whether anything changed."""
        changed = {island: c for island, c in cursors.items() if self.cursors.get(island) != c}
        if not changed:
            return False
        if self.log is not None:
            self.log.append(records.cursors_record(changed))
        self.cursors.update(changed)
        return True

    def warm_up(self, codec: Codec = Codec("int4"), stopping=lambda: False) -> None:
        """Compile the loops of folds from int codes and every fragment's outer step, ahead of the
        first deltas (merger/fold/warmup.py; `codec`: the islands' default).  Results are thrown
        away; safe on another thread; `stopping()` true: return before the next compilation."""
        layouts = [layout for layout in self.layouts if layout]
        warm_up_folds(self.optimizer, layouts, codec, stopping)

    def digest(self) -> str:
        return records.params_digest(self.states)

    # ---- internals ---------------------------------------------------------------------------
    def _apply_fold(self, fragment: int, members: list[Contribution]) -> FoldReport:
        version = self.states[fragment].version + 1
        share = take_share(self.last_contributions[fragment], members, version, self.config.merge)
        state, report = fold(
            self.states[fragment],
            members,
            self.config.merge,
            self._step,
            share,
            *self._guard(fragment, members),
            in_place=True,
            scratch=self.scratch,
        )
        self.install(fragment, state, report)
        return report

    def _guard(self, fragment: int, members: list[Contribution]) -> tuple[dict | None, dict | None]:
        """The guard's cap on each member island's part of a fold (outliers.fold_caps) and the most
        each delta of a member without a reference counts (outliers.delta_limits); None: off."""
        islands, merge = {c.island for c in members}, self.config.merge
        norm = self.param_norms.bounds(fragment, self.states)
        return (
            fold_caps(self.moves[fragment], norm, islands, merge.clip_factor),
            delta_limits(self.norms[fragment], self.moves[fragment], islands, merge.cold_factor),
        )

    def _unjudged(self, fragment: int, islands: set[str]) -> bool:
        return outliers.unjudged(self.norms[fragment], self.moves[fragment], islands)

    def _settle_folded(
        self, fragment: int, members: list[Contribution], version: int
    ) -> list[DeltaResult]:
        results = [
            DeltaResult(c.island, c.epoch, c.delta_id, fragment, "folded", version, "")
            for c in members
        ]
        for result in results:
            self._remember((result.island, result.epoch, result.delta_id), result)
        return results

    def _reject(
        self, key: DeltaKey, fragment: int, reason: str, label: str | None = None
    ) -> DeltaResult:
        self.rejected[label or reason] += 1
        version = self.version(fragment) if fragment < len(self.states) else 0
        result = DeltaResult(key[0], key[1], key[2], fragment, "rejected", version, reason)
        self._remember(key, result)
        return result

    def _remember(self, key: DeltaKey, result: DeltaResult) -> None:
        self.settled[key] = result
        while len(self.settled) > self.remember:
            self.settled.popitem(last=False)
