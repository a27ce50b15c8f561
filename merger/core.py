"""The merger's state machine: admit, log, decide, fold.  No sockets and no clock reads.

`MergerCore` owns the global model (one `FragmentState` per fragment) and applies the pure core
(`admission`, `round_policy`, `fold`).  It writes every admitted delta to the write-ahead log
*before* it can be folded, and a fold record naming the round's members after each fold, so the
log alone determines the model: replay and crash recovery feed the same records back through
`apply_record`.  Time is passed in by the caller.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from dloco.merger import coded, rda, records
from dloco.merger.admission import Candidate, admit, delta_norm
from dloco.merger.config import MergerConfig
from dloco.merger.fold import (
    Contribution,
    FoldReport,
    FragmentState,
    canonical,
    counters,
    fold,
    init_state,
    per_island,
)
from dloco.merger.fold import plain as fold_plain
from dloco.merger.outer import make_step, outer_optimizer
from dloco.merger.outliers import COLD_LIMIT, NormHistory, Quarantine
from dloco.merger.round_policy import ArrivalStats, decide, observe
from dloco.merger.weighting import capped, fold_share, raw_weights, recent_others
from dloco.protocol import (
    Assembled,
    Codec,
    CodedTensor,
    DeltaResult,
    DlocoError,
    model_fingerprint,
    partition,
)

# (island, epoch, delta_id)
DeltaKey = tuple[str, int, int]


class ReplayError(DlocoError):
    """The log does not describe a consistent history (a fold names an unknown delta, versions
    skip)."""


class Log(Protocol):
    next_index: int

    def append(self, record: dict, blobs: Sequence[tuple[Any, int | None]] = ()) -> int: ...


@dataclasses.dataclass(frozen=True)
class StartedFold:
    fragment: int
    version: int
    members: list[Contribution]
    results: list[DeltaResult]
    # of a whole round (weighting.fold_share)
    share: float = 1.0
    # island -> the most its part may move the fragment (fold.guard)
    caps: dict[str, float] | None = None


@dataclasses.dataclass(frozen=True)
class Pending:
    contribution: Contribution
    fragment: int
    arrived: float
    wal_index: int | None


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
        self.layouts = [
            {path: tuple(np.shape(params[path])) for path in paths} for paths in self.fragments
        ]
        self.states = [
            init_state({path: params[path] for path in paths}, self.optimizer)
            for paths in self.fragments
        ]
        self.pending: list[list[Pending]] = [[] for _ in self.fragments]
        # of every delta in `pending`
        self._pending_keys: set[DeltaKey] = set()
        # fragment -> version of its latest started fold
        self._started: dict[int, int] = {}
        self.history: list[dict[str, ArrivalStats]] = [{} for _ in self.fragments]
        # per fragment, (predicted next arrival, island) sorted: the round policy looks only at
        # islands predicted near `now`, not at every island's history (thousands of islands)
        self._predicted: list[list[tuple[float, str]]] = [[] for _ in self.fragments]
        # per fragment, island -> (version of the fold that took its latest delta, that delta's raw
        # weight): who makes up a whole round, for merge.share_window (checkpointed; replay rebuilds
        # it)
        self.last_contributions: list[dict[str, tuple[int, float]]] = [{} for _ in self.fragments]
        self.settled: collections.OrderedDict[DeltaKey, DeltaResult] = collections.OrderedDict()
        self.rejected: collections.Counter[str] = collections.Counter()
        # per fragment (merger/outliers.py; checkpointed, rebuilt by replay): recent admitted delta
        # norms, the outlier check's reference; and what each island's part of a fold moved it, the
        # guard's
        self.norms = [NormHistory() for _ in self.fragments]
        self.moves = [NormHistory() for _ in self.fragments]
        self.quarantine = Quarantine()
        # (island, last reason, seconds): newly quarantined, for the caller to log
        self.quarantined: list[tuple[str, str, float]] = []
        # island -> (epoch, seq): stream messages up to seq are settled and were acknowledged as
        # such
        self.cursors: dict[str, tuple[int, int]] = {}
        # a merger shard's fragments (None: every one); others are rejected
        self.owned: frozenset[int] | None = None
        if log is not None and log.next_index == 0:
            log.append(*records.genesis_record(config.to_dict(), model, self.fragments, params))

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
            or self._is_pending(key)
            or head.fragment >= len(self.fragments)
            or (self.owned is not None and head.fragment not in self.owned)
            # decided before its tensors are looked at
            or self.quarantine.held(head.sender, now) > 0
        )
        candidate = Candidate(
            head.sender,
            head.epoch,
            head.delta_id,
            head.fragment,
            head.base_version,
            head.steps,
            head.tokens,
            head.model,
            {} if settled else records.delta_tensors(assembled),
        )
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
        if self._is_pending(key):
            return None
        if candidate.fragment >= len(self.fragments):
            return self._reject(key, candidate.fragment, "unknown_fragment")
        if self.owned is not None and candidate.fragment not in self.owned:
            return self._reject(
                key,
                candidate.fragment,
                f"fragment {candidate.fragment} belongs to another merger shard",
                "other_shard",
            )
        if (left := self.quarantine.held(candidate.island, now)) > 0:
            return self._reject(
                key,
                candidate.fragment,
                f"quarantined: {candidate.island} is refused for {left:.0f} s more after repeated"
                " hostile deltas",
                "quarantined",
            )
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
            self.log.append(*record(verdict.staleness))
            if self.log is not None and record is not None
            else None
        )
        contribution = Contribution(
            candidate.island,
            candidate.epoch,
            candidate.delta_id,
            verdict.staleness,
            candidate.tokens,
            candidate.steps,
            candidate.tensors,
        )
        self._enqueue(Pending(contribution, candidate.fragment, now, wal_index))
        return None

    def _is_pending(self, key: DeltaKey) -> bool:
        return key in self._pending_keys

    def due(self, now: float, busy: Collection[int] = ()) -> tuple[list[int], float | None]:
        """Fragments to fold now, and the earliest time a waiting fragment must be decided again.
        Fragments in `busy` (a fold of theirs still computing: their deltas wait for the next round,
        decided when it is done) are not looked at: with many islands their queues are long."""
        ready, wake = [], None
        for fragment, queue in enumerate(self.pending):
            if not queue or fragment in busy:
                continue
            decision = decide(
                now,
                [(p.contribution.island, p.arrived) for p in queue],
                self._predicted_near(fragment, now),
                self.config.round,
            )
            if decision.fold:
                ready.append(fragment)
            elif decision.wait_until is not None:
                wake = decision.wait_until if wake is None else min(wake, decision.wait_until)
        return ready, wake

    def arrival_intervals(self, now: float | None = None) -> list[float | None]:
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

    def version(self, fragment: int) -> int:
        """The fragment's version: its latest fold, counting one started and still computing."""
        return max(self.states[fragment].version, self._started.get(fragment, 0))

    def start_fold(self, fragment: int) -> StartedFold:
        """Take every pending delta of `fragment` as a round: from now on the fragment is at the
        round's version (admission counts staleness against it), the fold is logged and its deltas
        settled.  The parameters come from `compute_fold` (possibly on another thread) and
        `install`.
        """
        queue, self.pending[fragment] = self.pending[fragment], []
        members = [p.contribution for p in queue]
        self._pending_keys -= {_key(c) for c in members}
        version = self._started[fragment] = self.version(fragment) + 1
        if self.log is not None:
            self.log.append(
                records.fold_record(
                    fragment, version, [(c.island, c.epoch, c.delta_id) for c in members]
                )
            )
        share = self._take_share(fragment, members, version)
        return StartedFold(
            fragment,
            version,
            members,
            self._settle_folded(fragment, members, version),
            share,
            self._caps(fragment, members),
        )

    def compute_fold(self, started: StartedFold) -> tuple[FragmentState, FoldReport]:
        """The state after a started round, from the fragment's current state, without installing it
        (any thread; the fragment's previous round must be installed)."""
        state, report = fold(
            self.states[started.fragment],
            started.members,
            self.config.merge,
            self._step,
            started.share,
            started.caps,
        )
        if report.version != started.version:
            raise ReplayError(
                f"fold of fragment {started.fragment} produced version {report.version}, expected"
                f" {started.version}"
            )
        return state, report

    def install(self, fragment: int, state: FragmentState, report: FoldReport) -> None:
        """Make a computed round the fragment's state (what checkpoints and catch-up requests see)
        and note what each island's part moved it (the guard's history)."""
        self.states[fragment] = state
        for island, movement in report.movements:
            self.moves[fragment].record(island, movement)

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
            self._enqueue(
                Pending(contribution, record["fragment"], 0.0, index), observe_arrival=False
            )
            return None
        if record["type"] != records.FOLD:
            raise ReplayError(f"log record {index} has unexpected type {record['type']!r}")
        fragment, wanted = record["fragment"], [tuple(m) for m in record["members"]]
        queue = self.pending[fragment]
        by_key = {
            (p.contribution.island, p.contribution.epoch, p.contribution.delta_id): p for p in queue
        }
        missing = [key for key in wanted if key not in by_key]
        if missing:
            raise ReplayError(
                f"log record {index}: fold of fragment {fragment} names deltas not in the log:"
                f" {missing[:3]}"
            )
        self.pending[fragment] = [p for key, p in by_key.items() if key not in set(wanted)]
        members = [by_key[key].contribution for key in wanted]
        self._pending_keys -= set(wanted)
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
            self.log.append(
                {
                    "type": records.CURSORS,
                    "cursors": [[i, e, s] for i, (e, s) in sorted(changed.items())],
                }
            )
        self.cursors.update(changed)
        return True

    def warm_up(self, codec: Codec = Codec("int4"), stopping=lambda: False) -> None:
        """Compile the kernels of folds from int codes (merger/coded.py) for every fragment's size,
        and every fragment's outer step, ahead of the first deltas (`codec`: the islands' default).
        Results are thrown away; safe on another thread; `stopping()` true: return before the next
        compilation."""
        coded.warm_up(
            [sum(int(np.prod(shape)) for shape in layout.values()) for layout in self.layouts],
            codec.block,
            codec.bits,
            stopping,
        )
        for fragment, state in enumerate(list(self.states)):
            if stopping():
                return
            zero = {
                path: CodedTensor(
                    codec,
                    shape,
                    np.zeros(
                        (-(-int(np.prod(shape)) // codec.block), codec.record_nbytes), np.uint8
                    ),
                )
                for path, shape in self.layouts[fragment].items()
            }
            plain = {path: fold_plain(path, self.config.merge) for path in zero}
            new, *_ = coded.merge_and_step(
                self.optimizer, state.params, state.opt_state, [zero], [0.0], plain
            )
            jax.block_until_ready(new)

    def digest(self) -> str:
        return records.params_digest(self.states)

    # ---- internals ---------------------------------------------------------------------------
    def _enqueue(self, pending: Pending, observe_arrival: bool = True) -> None:
        self.pending[pending.fragment].append(pending)
        self._pending_keys.add(_key(pending.contribution))
        if observe_arrival:
            island = pending.contribution.island
            history, predicted = self.history[pending.fragment], self._predicted[pending.fragment]
            old = history.get(island)
            new = history[island] = observe(old, pending.arrived, self.config.round.ema_alpha)
            if old is not None and old.interval is not None:
                del predicted[bisect.bisect_left(predicted, (old.last + old.interval, island))]
            if new.interval is not None:
                bisect.insort(predicted, (new.last + new.interval, island))

    def _predicted_near(self, fragment: int, now: float) -> dict[str, ArrivalStats]:
        """The arrival history of the islands whose next delta is predicted within (now -
        grace_slack, now + grace_cap]: the only ones `decide` can wait for (its deadline is at most
        now + grace_cap, and it drops predictions older than the slack), so its decision is the one
        over every island.
        """
        predicted, config, history = (
            self._predicted[fragment],
            self.config.round,
            self.history[fragment],
        )
        lo = bisect.bisect_left(predicted, (now - config.grace_slack_s,))
        hi = bisect.bisect_right(predicted, (now + config.grace_cap_s, "\U0010ffff"))
        return {island: history[island] for _, island in predicted[lo:hi]}

    def _apply_fold(self, fragment: int, members: list[Contribution]) -> FoldReport:
        share = self._take_share(fragment, members, self.states[fragment].version + 1)
        state, report = fold(
            self.states[fragment],
            members,
            self.config.merge,
            self._step,
            share,
            self._caps(fragment, members),
        )
        self.install(fragment, state, report)
        return report

    def _caps(self, fragment: int, members: list[Contribution]) -> dict[str, float] | None:
        """The guard's cap on each member island's part of a fold (merger/outliers.py): clip_factor
        times the largest of the other islands' median movements; without one, COLD_LIMIT times the
        fragment's norm.  None: the guard is off."""
        factor = self.config.merge.clip_factor
        if factor <= 0:
            return None
        caps, cold = {}, None
        for island in {c.island for c in members}:
            reference = self.moves[fragment].reference(island, "max")
            if reference is None:
                if cold is None:
                    cold = COLD_LIMIT * rda.fragment_norm(
                        {p: np.asarray(v) for p, v in self.states[fragment].params.items()}
                    )
                reference, factor_here = cold, 1.0
            else:
                factor_here = factor
            # a zero reference (a fragment at zero, or that nobody moves) caps nothing
            if reference > 0:
                caps[island] = factor_here * reference
        return caps

    def _take_share(self, fragment: int, members: list[Contribution], version: int) -> float:
        """The share of a round a fold of `members` makes `version` with; note their
        contributions."""
        window = self.config.merge.share_window
        if window == 0:
            return 1.0
        # an island's deltas weigh as one, as the fold weighs them
        groups = per_island(canonical(members))
        contributions = self.last_contributions[fragment]
        others = recent_others(
            contributions, {group[0].island for group in groups}, version, window
        )
        raw = capped(
            raw_weights([counters(group) for group in groups], self.config.merge.staleness_power),
            others,
            # noted capped: one island's claims do not shrink the others' shares
            self.config.merge.max_weight_ratio,
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


def _key(contribution: Contribution) -> DeltaKey:
    return contribution.island, contribution.epoch, contribution.delta_id


def initial_core(config: MergerConfig, params: dict[str, np.ndarray], fragments: int):
    """A factory for a fresh core: partition by bytes, fingerprint, genesis logged on creation."""
    shapes = {path: tuple(a.shape) for path, a in params.items()}
    parts = partition(shapes, fragments)
    model = model_fingerprint(params)
    return lambda wal: MergerCore(config, model, parts, params, log=wal)
