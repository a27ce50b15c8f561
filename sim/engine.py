"""A decoupled run in virtual time: the real decision code against simulated clocks, links and
compute.

What is real (imported, not restated): the merger's `MergerCore` (admission and the staleness
bound, duplicates, the outlier history, the round policy's quorum and adaptive grace, token weights
and shares, versions) driven through `MergerCore.offer` with one-value tensors; the fold
pipeline's rule of one fold in flight per fragment; `round_policy.snapshot_due` holding snapshots;
the island's fragment schedule (`exchange.due_offset`: P staggered fragments every H steps), its
`Outbox` (a fragment's unsent deltas summed) and the uplink's `LinkShaper` (an island in virtual
time: sim/islands.py).

What is modelled: a step takes `step_s` (with `step_cv`, k steps take a normal k step_s, standard
deviation sqrt(k) step_cv step_s, seeded per island: real islands drift apart); a delta is its
codec's encoded size plus a chunk header; links are FIFO pipes (rate, one-way latency = RTT / 2; the
next message starts when the previous one's last byte left), the merger's own link too when it has
one; a fold worker per merger shard folds `merger_bytes_s` of coded deltas per second plus a fixed
overhead; an island adopts (rebases onto) every snapshot that has arrived when it sends, so a
delta's base version is the newest one arrived by then.  A failed island loses its unsent work (what
it trained since its last send, its outbox, a delta half on the wire) and comes back after `down_s`,
joining again: a full snapshot of every fragment down, and `restart_s` to compile.  What counts: a
folded token, worth q(the steps its delta covered, sim/quality.py).  Bytes on the wire:
sim/wire.py; downlinks and published snapshots: sim/delivery.py.
"""

from __future__ import annotations

import collections
import heapq
import math

import numpy as np

from dloco.island.exchange import due_offset
from dloco.island.outbox import PendingDelta
from dloco.merger.fold.admission import Candidate
from dloco.merger.state.core import MergerCore
from dloco.merger.state.round_policy import snapshot_due
from dloco.protocol import model_fingerprint
from dloco.sim.delivery import Downlinks, Published
from dloco.sim.islands import SimIsland
from dloco.sim.results import SimResult
from dloco.sim.scenario import Scenario
from dloco.sim.wire import fragment_sizes, wire_sizes


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.sizes = fragment_sizes(scenario.params, scenario.fragments)
        self.snapshots = scenario.snapshots
        self.delta_bytes, self.snapshot_bytes, self.full_bytes, self.rejoin_bytes = wire_sizes(
            scenario
        )
        params = {f"fragment{p}": np.zeros(1, np.float32) for p in range(scenario.fragments)}
        self.core = MergerCore(
            scenario.math, model_fingerprint(params), [[path] for path in params], params
        )
        self.islands = [SimIsland(i, spec, scenario) for i, spec in enumerate(scenario.islands)]
        self.by_name = {island.spec.name: island for island in self.islands}
        n = len(self.islands)
        self.downlinks = Downlinks(scenario.islands)
        self.receiving = np.zeros(n, bool)
        self.published = Published(n, scenario.fragments)
        self.installed = [0] * scenario.fragments
        self.published_at: dict[int, float] = {}
        self.held: set[int] = set()
        self.folding: set[int] = set()
        # a fold worker per shard
        self.worker_free, self.fold_busy_s = [0.0] * scenario.merger_shards, 0.0
        # the merger's own link, each way
        self.link_in_free = self.link_out_free = 0.0
        self.pending_bytes = self.peak_pending_bytes = 0
        self.pending_tokens = 0.0
        self.intervals: list[list[int]] = [[] for _ in self.sizes]
        self.folds = [0] * scenario.fragments
        self.staleness: collections.Counter = collections.Counter()
        self.folded_tokens = 0
        self.queue: list = []
        self.counter = 0
        self.wake: float | None = None
        # when publish_due is next called
        self.publish_at = math.inf

    # ---- the event queue -------------------------------------------------------------------------
    def at(self, when: float, kind: str, *data) -> None:
        self.counter += 1
        heapq.heappush(self.queue, (when, self.counter, kind, data))

    def run(self) -> SimResult:
        for island in self.islands:
            self.at(island.spec.start_s, "join", island)
        for failure in self.s.failures:
            self.at(failure.at_s, "fail", self.by_name[failure.island], failure.down_s)
        events = 0
        while self.queue and self.queue[0][0] <= self.s.duration_s:
            now, _, kind, data = heapq.heappop(self.queue)
            events += 1
            getattr(self, f"_on_{kind}")(now, *data)
        # the steps of the last stretch, up to the end
        for island in self.islands:
            if island.alive:
                island.train_until(island.steps_by(self.s.duration_s), self.s.duration_s)
                unsent, useful = island.undecided(self.s, self.delta_bytes)
                island.run.undecided_tokens = (unsent + island.in_flight) / self.s.fragments
                island.run.undecided_useful = (useful + island.in_flight_useful) / self.s.fragments
            island.run.bytes_down = int(self.downlinks.bytes[island.index])
        backlog = [max(0.0, free - self.s.duration_s) for free in self.worker_free]
        return SimResult(
            self.s,
            [island.run for island in self.islands],
            self.folds,
            self.staleness,
            self.folded_tokens,
            self.fold_busy_s,
            self.peak_pending_bytes,
            events,
            self.intervals,
            self.pending_bytes,
            self.pending_tokens,
            backlog,
        )

    # ---- islands ---------------------------------------------------------------------------------
    def _on_join(self, now: float, island: SimIsland) -> None:
        """(Re)start: every fragment's current value down in full, then the first step."""
        island.alive, self.receiving[island.index] = True, True
        arrived, first = now, not island.run.failures
        mask = np.arange(len(self.islands)) == island.index
        for fragment, nbytes in enumerate(self.full_bytes if first else self.rejoin_bytes):
            if not (first and island.spec.holds_model):
                arrived = float(
                    self.downlinks.send(mask, nbytes, self._merger_out(nbytes, now))[island.index]
                )
            self.published.joined(island.index, fragment)
        island.joined_versions = list(self.installed)
        # a restart: the download, then compiling
        island.clock = arrived + (0.0 if first else self.s.restart_s)
        if first:
            island.run.startup_s = island.clock - now
        self._next_due(island)

    def _next_due(self, island: SimIsland) -> None:
        """The island's next step after which a fragment is due, as an event."""
        nxt, seconds = island.set_next_due(
            island.spec.interval or self.s.interval, self.s.fragments
        )
        self.at(island.clock + seconds, "due", island, island.epoch, nxt)

    def _on_due(self, now: float, island: SimIsland, epoch: int, step: int) -> None:
        if not island.alive or epoch != island.epoch:
            return
        island.train_until(step, now)
        h, p = island.spec.interval or self.s.interval, self.s.fragments
        for fragment in (f for f in range(p) if step % h == due_offset(f, p, h)):
            steps = island.unsent_steps[fragment]
            if steps <= 0:
                continue
            island.unsent_steps[fragment] = 0
            delta = PendingDelta(
                fragment,
                self._version_at(island, fragment, now),
                {},
                steps,
                steps * island.spec.tokens_per_step,
            )
            island.run.deltas_summed += island.outbox.put(delta)
        self._send_next(island, now)
        self._next_due(island)

    def _version_at(self, island: SimIsland, fragment: int, now: float) -> int:
        """The newest version of `fragment` that has reached `island` by `now` (it joined with
        one)."""
        newest = self.published.newest(island.index, fragment, now)
        return max(island.joined_versions[fragment], newest)

    def _send_next(self, island: SimIsland, now: float) -> None:
        if island.wire is not None or not island.outbox:
            return
        delta = island.outbox.take()
        nbytes = self.delta_bytes[delta.fragment]
        sent, arrives = island.uplink.schedule(nbytes, now)
        island.wire = (delta, sent)
        island.in_flight += delta.tokens
        island.in_flight_useful += delta.tokens * self.s.quality(delta.steps)
        island.run.bytes_up += nbytes
        self.at(sent, "sent", island, island.epoch)
        self.at(
            arrives,
            "arrive" if self.s.merger_link_bps is None else "at_merger_link",
            island,
            island.epoch,
            delta,
            sent,
        )

    def _on_sent(self, now: float, island: SimIsland, epoch: int) -> None:
        if epoch == island.epoch:
            island.wire = None
            self._send_next(island, now)

    def _on_fail(self, now: float, island: SimIsland, down_s: float) -> None:
        if not island.alive:
            return
        island.train_until(island.steps_by(now), now)
        run, p = island.run, self.s.fragments
        run.failures += 1
        # each fragment's work since its last send
        lost = sum(island.unsent_steps) * island.spec.tokens_per_step
        while (delta := island.outbox.take()) is not None:
            lost += delta.tokens
        # half on the wire: the merger never gets it whole
        if island.wire is not None and island.wire[1] > now:
            lost += island.wire[0].tokens
            island.in_flight -= island.wire[0].tokens
            island.in_flight_useful -= island.wire[0].tokens * self.s.quality(island.wire[0].steps)
        run.lost_tokens += lost / p
        island.died_at[island.epoch] = now
        island.alive, self.receiving[island.index] = False, False
        island.new_life(self.s)
        self.at(now + down_s, "join", island)

    # ---- the merger ------------------------------------------------------------------------------
    def _on_at_merger_link(
        self, now: float, island: SimIsland, epoch: int, delta: PendingDelta, sent: float
    ) -> None:
        """A delta reaches the merger's own link (FIFO, shared by every island's deltas)."""
        self.link_in_free = (
            max(now, self.link_in_free)
            + self.delta_bytes[delta.fragment] * 8 / self.s.merger_link_bps
        )
        self.at(self.link_in_free, "arrive", island, epoch, delta, sent)

    def _merger_out(self, nbytes: int, now: float) -> float:
        """When `nbytes` handed over at `now` have left the merger's own link (to the broker, which
        fans out)."""
        if self.s.merger_link_bps is None:
            return now
        self.link_out_free = max(now, self.link_out_free) + nbytes * 8 / self.s.merger_link_bps
        return self.link_out_free

    def _on_arrive(
        self, now: float, island: SimIsland, epoch: int, delta: PendingDelta, sent: float
    ) -> None:
        # its sender died before the last byte left (counted lost then)
        if sent > island.died_at.get(epoch, math.inf):
            return
        island.in_flight -= delta.tokens
        island.in_flight_useful -= delta.tokens * self.s.quality(delta.steps)
        island.delta_id += 1
        island.run.deltas_sent += 1
        candidate = Candidate(
            island.spec.name,
            epoch,
            island.delta_id,
            delta.fragment,
            delta.base_version,
            delta.steps,
            delta.tokens,
            self.core.model,
            {f"fragment{delta.fragment}": np.ones(1, np.float32)},
        )
        result = self.core.offer(candidate, now)
        if result is not None and result.status == "rejected":
            island.run.lost_tokens += delta.tokens / self.s.fragments
            island.run.rejected[result.reason.split(":")[0]] += 1
        elif result is None:
            self.pending_bytes += self.delta_bytes[delta.fragment]
            self.pending_tokens += delta.tokens / self.s.fragments
            self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
        if self.held:
            self._publish_held(now)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """FoldPipeline.dispatch: every fold the round policy calls for, one in flight per
        fragment."""
        ready, wake = self.core.due(now, self.folding)
        for fragment in ready:
            started = self.core.start_fold(fragment)
            nbytes = self.delta_bytes[fragment] * len(started.members)
            shard = fragment % self.s.merger_shards
            seconds = self.s.fold_overhead_s + nbytes / self.s.fold_bytes_s
            self.worker_free[shard] = max(now, self.worker_free[shard]) + seconds
            self.fold_busy_s += seconds
            self.folding.add(fragment)
            self.at(self.worker_free[shard], "folded", started, nbytes)
        if wake is not None and (self.wake is None or wake < self.wake or self.wake <= now):
            self.wake = wake
            self.at(wake, "wake")

    def _on_wake(self, now: float) -> None:
        self._dispatch(now)

    def _on_folded(self, now: float, started, nbytes: int) -> None:
        fragment = started.fragment
        self.folding.discard(fragment)
        self.installed[fragment] = started.version
        self.folds[fragment] += 1
        self.pending_bytes -= nbytes
        p = self.s.fragments
        for member in started.members:
            self.staleness[member.staleness] += 1
            self.folded_tokens += member.tokens
            self.pending_tokens -= member.tokens / p
            run = self.by_name[member.island].run
            run.folded_tokens += member.tokens / p
            run.useful_tokens += member.tokens / p * self.s.quality(member.steps)
            run.intervals.append(member.steps)
            self.intervals[fragment].append(member.steps)
        every = self.snapshots.snapshot_every_round
        # 0: -inf, now
        due = snapshot_due(
            self.published_at.get(fragment),
            self.core.arrival_intervals(now) if every > 0 else [],
            every,
        )
        if due <= now:
            self._publish(fragment, now)
        # SnapshotPublisher.offer: held, then published by publish_due
        else:
            self.held.add(fragment)
            self._publish_wake(due)
        self._dispatch(now)

    def _on_publish_due(self, now: float) -> None:
        # else superseded by an earlier call
        if now >= self.publish_at:
            self._publish_held(now)

    def _publish_held(self, now: float) -> None:
        """SnapshotPublisher.publish_due: the held snapshots that are due go out (an arrival may
        have shortened a round, so this runs on arrivals too)."""
        intervals, wake = _mean_round(self.core.arrival_intervals(now)), math.inf
        for fragment in sorted(self.held):
            due = snapshot_due(
                self.published_at.get(fragment), intervals, self.snapshots.snapshot_every_round
            )
            if due <= now:
                self._publish(fragment, now)
            else:
                wake = min(wake, due)
        self.publish_at = math.inf
        self._publish_wake(wake)

    def _publish_wake(self, when: float) -> None:
        if when < self.publish_at:
            self.publish_at = when
            self.at(when, "publish_due")

    def _publish(self, fragment: int, now: float) -> None:
        """A snapshot (a diff, or the whole fragment) to every island that is up, each over its
        downlink."""
        nbytes = self.snapshot_bytes[fragment]
        arrival = self.downlinks.send(self.receiving, nbytes, self._merger_out(nbytes, now))
        self.published.add(fragment, self.installed[fragment], arrival, self.receiving)
        self.published_at[fragment] = now
        self.held.discard(fragment)


def _mean_round(intervals: list[float | None]) -> list[float]:
    """What snapshot_due reads of the intervals (their mean), once for many fragments."""
    known = [interval for interval in intervals if interval is not None]
    return [math.fsum(known) / len(known)] if known else []


def simulate(scenario: Scenario) -> SimResult:
    return Simulation(scenario).run()
