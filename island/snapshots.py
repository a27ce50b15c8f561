"""The downlink: the merger's snapshots, applied to the value held and queued for the training loop.

A full snapshot replaces the value the island holds of a fragment; a diff applies to it
(protocol/downlink.py).  A diff whose base is newer than the value held waits for that base; a
diff that does not apply makes the island ask the merger for the fragment's value (a catch-up
reply, point to point), again every `ask_again_s` until a value at least that new is held.
Every adopted value is queued with the time the downlink shaper says it has arrived; the loop
takes only those that have.  Snapshots from an earlier incarnation of a merger are ignored.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from dloco import protocol
from dloco.protocol import downlink


def reassembly_budget(model_bytes: int) -> int:
    """Bytes of values an island's snapshot reassembly may stage: up to the whole model in fp32
    (every fragment's catch-up reply at join), beyond the reassembler's default 256 MiB for a large
    model.
    """
    return max(protocol.Reassembler().max_bytes, model_bytes + (64 << 20))


def snapshot_reassembler(model_bytes: int) -> protocol.Reassembler:
    """How an island reassembles snapshots: streamed (each chunk decoded into the fragment's staging
    values as it comes, its frames let go), the chunks' overheads within the reassembler's default
    budget, the values within `reassembly_budget`: a fragment of any size the island's memory holds.
    """
    return protocol.Reassembler(stream=True, max_staged_bytes=reassembly_budget(model_bytes))


# a fragment whose diff could not be applied is asked for at most this often
ASK_AGAIN_S = 1.0


@dataclasses.dataclass(frozen=True)
class Arrival:
    # monotonic time at which the downlink shaper says it has fully arrived
    arrives: float
    fragment: int
    version: int
    tensors: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class EarlyDiff:
    """A diff that came before its base."""

    head: protocol.SnapshotChunk
    tensors: dict[str, np.ndarray]
    arrives: float


class Downlink:
    """Fed by the receiver thread (`on_snapshot`, `ask_for_values`); the loop takes `ready`
    values.  `lock` guards only the queue between them."""

    def __init__(self, name: str, epoch: int, merger_epochs: dict[str, int] | None = None) -> None:
        self.name, self.epoch = name, epoch
        self.lock = threading.Lock()
        self.arrived: collections.deque[Arrival] = collections.deque()
        # fragment -> the merger's value as received: diffs apply to it
        self.served: dict[int, downlink.Served] = {}
        # fragment -> a diff whose base is newer than the value held
        self.awaiting_base: dict[int, EarlyDiff] = {}
        # fragment -> newest version seen in a diff that could not be applied
        self.wanted: dict[int, int] = {}
        # fragment -> when its value was last asked for
        self.asked: dict[int, float] = {}
        # when every fragment was (at start)
        self.asked_all = -ASK_AGAIN_S
        self.ask_again_s = ASK_AGAIN_S
        # newest incarnation of each sender
        self.merger_epochs: dict[str, int] = {} if merger_epochs is None else merger_epochs
        # full, diff, old_epoch, gap, mismatch, asked, ...
        self.results: collections.Counter[str] = collections.Counter()
        # per merger (shard), the epochs whose snapshots were adopted, in order
        self.adopted_epochs: dict[str, list[int]] = {}

    def ready(self, now: float) -> list[tuple[int, int, dict[str, np.ndarray]]]:
        """(fragment, version, tensors) of the values that have arrived by `now`, oldest first."""
        taken = []
        with self.lock:
            while self.arrived and self.arrived[0].arrives <= now:
                arrival = self.arrived.popleft()
                taken.append((arrival.fragment, arrival.version, arrival.tensors))
        return taken

    def ask_for_all(self, now: float) -> protocol.SnapshotRequest:
        """The request at start: every fragment's value (Clone pattern)."""
        self.asked_all = now
        return protocol.SnapshotRequest(sender=self.name, epoch=self.epoch, seq=0, fragments=())

    def on_snapshot(
        self, head: protocol.SnapshotChunk, tensors: dict[str, np.ndarray], arrives: float
    ) -> None:
        """Hold and queue a newer value of the fragment; a diff that does not apply to the value
        held is kept (the next full value may be its base) and the fragment's value is asked for."""
        # a restarted merger's predecessor, delayed
        if head.epoch < self.merger_epochs.get(head.sender, 0):
            self.results["old_epoch"] += 1
            return
        self.merger_epochs[head.sender] = max(head.epoch, self.merger_epochs.get(head.sender, 0))
        fragment = head.fragment
        held, outcome = downlink.receive(
            self.served.get(fragment),
            head.version,
            head.base_version,
            head.digest,
            tensors,
            head.served,
        )
        self.results[outcome] += 1
        if outcome in downlink.ASK_AGAIN:
            self.wanted[fragment] = max(self.wanted.get(fragment, 0), head.version)
            if head.base_version is not None and (held is None or head.base_version > held.version):
                self.awaiting_base[fragment] = EarlyDiff(head, tensors, arrives)
        if outcome not in downlink.ADOPT:
            return
        self.served[fragment] = held
        adopted = self.adopted_epochs.setdefault(head.sender, [])
        if not adopted or adopted[-1] != head.epoch:
            adopted.append(head.epoch)
        with self.lock:
            self.arrived.append(Arrival(arrives, fragment, head.version, held.tensors))
        early = self.awaiting_base.get(fragment)
        # it can apply now, or never will
        if early is not None and early.head.base_version <= held.version:
            del self.awaiting_base[fragment]
            # its base has just arrived
            if early.head.base_version == held.version:
                self.on_snapshot(early.head, early.tensors, early.arrives)

    def ask_for_values(
        self, now: float, seq_of: Callable[[int], int], send: Callable[[list, int], bool]
    ) -> None:
        """Ask the merger for the value of every fragment a diff could not be applied to, until a
        value at least that new is held; at most once per `ask_again_s` per fragment.  `seq_of(f)`
        is the island's last seq of the stream fragment f's deltas go on; `send(frames, f)` goes
        point to point to the merger (shard) of f and never blocks (False: ask next time)."""
        for fragment, wanted in list(self.wanted.items()):
            held = self.served.get(fragment)
            if held is not None and held.version >= wanted:
                del self.wanted[fragment]
                continue
            if now - self.asked.get(fragment, self.asked_all) < self.ask_again_s:
                continue
            request = protocol.SnapshotRequest(
                sender=self.name, epoch=self.epoch, seq=seq_of(fragment), fragments=(fragment,)
            )
            if send(protocol.encode(request), fragment):
                self.asked[fragment] = now
                self.results["asked"] += 1
