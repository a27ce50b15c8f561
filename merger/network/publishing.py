"""How the merger process puts fragments on the snapshot bus and answers catch-up requests: full
snapshots or diffs (merger/network/snapshot_form.py, protocol/downlink.py), now or held until the
islands' mean round has passed (round_policy.snapshot_due).

`Stamp` is the header of everything the merger sends (its name, epoch and stream seq);
`SnapshotPublisher` owns what the islands were served of each fragment, when each was last
published, which are held back and each peer's catch-up budget.  The service owns the sockets and
hands the publisher the two it writes to."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import zmq

from dloco import protocol
from dloco.merger.network.snapshot_form import DIFF, FULL, snapshot_form
from dloco.merger.state.round_policy import CatchUpBudget, snapshot_due
from dloco.protocol import downlink


@dataclasses.dataclass
class Stamp:
    """The header of the merger's messages: its name, its epoch (its start time, or its term's after
    a takeover) and the seq of its last message on the snapshot bus."""

    sender: str
    epoch: int
    seq: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


class SnapshotPublisher:
    def __init__(self, core, config, stamp: Stamp, bus, control, count: Callable[[str], None]):
        """`config`: the service's (merger.settings.ServiceConfig); `bus`: the snapshot PUB socket;
        `control`: the ROUTER catch-up replies go out on; `count`: the service's counter."""
        self.core, self.config, self.stamp = core, config, stamp
        self.bus, self.control, self.count = bus, control, count
        # with diff snapshots: what islands hold of each fragment
        self.served: dict[int, downlink.Served] = {}
        # fragment -> monotonic time of its last snapshot on the bus
        self.published_at: dict[int, float] = {}
        # fragments with folds not yet on the bus (config.snapshot_every_round)
        self.unpublished: set[int] = set()
        # per peer
        self.catch_up_budgets: dict[bytes, CatchUpBudget] = {}

    def frames(self, fragment: int, on_bus: bool = True, state=None) -> list:
        """Frames of a snapshot of `fragment` (the current one unless `state` is given).
        Point-to-point replies (on_bus False) are not part of the bus stream: they carry the last
        stream seq instead of a new one.

        With a diff codec, `snapshot_form` chooses: a full snapshot, on the bus the change since the
        served value (protocol/downlink.py), or point to point the served value itself, exact (fp32,
        or the full snapshots' codec while the value is representable in it)."""
        state = self.core.states[fragment] if state is None else state

        # host copies: not needed for a diff merger's catch-up reply
        def params():
            return {p: np.asarray(v) for p, v in state.params.items()}

        full_codec = protocol.Codec(self.config.snapshots.snapshot_codec)
        version, base, digest, served_dtype = state.version, None, None, None
        if self.config.snapshots.snapshot_diff_codec == "none":
            limit = self.config.max_chunk_bytes
            codec, plans = full_codec, protocol.split_fragment(params(), full_codec, limit)
        else:
            served, base, codec, plans = self._served_form(fragment, state.version, params, on_bus)
            version, digest = served.version, served.digest
            served_dtype = self.config.snapshots.served
        return [
            protocol.encode(
                protocol.SnapshotChunk(
                    sender=self.stamp.sender,
                    epoch=self.stamp.epoch,
                    seq=self.stamp.next_seq() if on_bus else self.stamp.seq,
                    fragment=fragment,
                    version=version,
                    chunk_index=index,
                    chunk_count=len(plans),
                    model=self.core.model,
                    codec=codec,
                    slices=plan.slices,
                    payloads=plan.payloads,
                    base_version=base,
                    digest=digest,
                    served=served_dtype,
                )
            )
            for index, plan in enumerate(plans)
        ]

    def _served_form(self, fragment: int, version: int, params, on_bus: bool) -> tuple:
        """With a diff codec: the served value after this snapshot, its base version (a diff's;
        else None), codec and chunk plans, as `snapshot_form` chooses (counted by form)."""
        full_codec, limit = (
            protocol.Codec(self.config.snapshots.snapshot_codec),
            self.config.max_chunk_bytes,
        )
        served, base = self.served.get(fragment), None
        form = snapshot_form(
            version,
            None if served is None else served.version,
            on_bus,
            self.config.snapshots.snapshot_full_every,
        )
        if form == FULL:
            codec = full_codec
            served, plans = downlink.full(
                params(), version, full_codec, limit, self.config.snapshots.served
            )
        elif form == DIFF:
            base, codec = (
                served.version,
                protocol.Codec(self.config.snapshots.snapshot_diff_codec),
            )
            served, plans = downlink.diff(params(), served, version, codec, limit)
        # exact: fp32, or the full snapshots' codec while S is representable in it (joins at the
        # start)
        else:
            codec, plans = downlink.reply(served, full_codec, limit)
        self.served[fragment] = served
        self.count("merger/snapshot_catch_up" if not on_bus else f"merger/snapshot_{form}")
        return served, base, codec, plans

    def publish(self, fragment: int, state=None) -> None:
        for frames in self.frames(fragment, state=state):
            self.bus.send_multipart(frames, copy=False)
        self.published_at[fragment] = time.monotonic()
        self.unpublished.discard(fragment)

    def offer(self, fragment: int, state) -> None:
        """A fold's snapshot goes on the bus now, or is held until the islands' mean round has
        passed since the fragment's last one (round_policy.snapshot_due; the round as seen on any
        fragment, so holding starts in the first round of later fragments): then one snapshot
        carries every fold in between.  Islands adopt what arrives, so fewer snapshots cost
        freshness only, and with diff snapshots the islands together receive what they send instead
        of N times it.
        """
        now = time.monotonic()
        if (
            snapshot_due(
                self.published_at.get(fragment),
                self.core.arrival_intervals(now),
                self.config.snapshots.snapshot_every_round,
            )
            <= now
        ):
            self.publish(fragment, state)
        else:
            self.unpublished.add(fragment)
            self.count("merger/snapshot_held")

    def publish_due(self, now: float) -> float | None:
        """Publish the held-back snapshots that are due (the fragment as folded by now); return when
        the next one is."""
        wake, intervals = None, self.core.arrival_intervals(now)
        for fragment in sorted(self.unpublished):
            due = snapshot_due(
                self.published_at.get(fragment),
                intervals,
                self.config.snapshots.snapshot_every_round,
            )
            if due <= now:
                self.publish(fragment)
            else:
                wake = due if wake is None else min(wake, due)
        return wake

    def answer_catch_up(self, identity: bytes, fragments) -> None:
        """Each fragment's value, point to point, never blocking: a peer that does not read (its
        queue full) loses the reply and asks again.  Each peer has a budget of replies
        (round_policy. CatchUpBudget: the whole model twice, refilled at the whole model a second);
        a request beyond it is refused (counted), so no peer keeps the loop encoding whole
        fragments."""
        budget = self.catch_up_budgets.setdefault(identity, CatchUpBudget(len(self.core.fragments)))
        owned = self.core.owned
        for fragment in fragments:
            if fragment >= len(self.core.fragments):
                continue
            if owned is not None and fragment not in owned:
                self.count("merger/catch_up_other_shard")
                continue
            if not budget.take(time.monotonic()):
                self.count("merger/rejected/catch_up_rate")
                continue
            try:
                for frames_out in self.frames(fragment, on_bus=False):
                    self.control.send_multipart([identity, *frames_out], zmq.NOBLOCK, copy=False)
            # Again: its queue is full; EHOSTUNREACH: it has gone meanwhile
            except zmq.ZMQError:
                self.count("merger/catch_up_dropped")
