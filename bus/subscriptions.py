"""What subscribers may make a bound XPUB hold: the accounting (`SubscriptionBudget`, pure) and a
socket that acts on it (`BudgetedXPUB`: the broker's buses, a merger's own snapshot socket).

ZeroMQ's XPUB keeps every topic a subscriber sends until that connection closes, with no limit per
peer and no way to drop one connection's topics.  The topics the protocol's subscribers use
(protocol.subscribable) are a bounded set of short strings, so what they hold is bounded; each
other subscription is charged, with CURVE, to the peer whose key sent it (ZAP's User-Id) and to
the socket:

- a peer's budget is a bucket of PEER_BYTES, refilled at that much per REFILL_S (an honest peer is
  never charged);
- the socket's budget is TOTAL_BYTES of subscriptions since it was last opened.

A subscription past its peer's budget bans that peer (ZAP refuses its key for BAN_S) and opens the
XPUB afresh (closed, which frees every topic it held, and bound again); past the socket's budget
(many keys, each within its own), it is opened afresh too.  Subscribers reconnect and subscribe
again on their own (ZeroMQ's SUB does both); what was in flight to them is lost and recovered as
any loss is (resends, catch-up).  So what an XPUB holds beyond the protocol's own topics stays
within TOTAL_BYTES plus one peer's budget, whatever the subscribers send.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import zmq

from dloco.bus import libc
from dloco.bus.security import Security
from dloco.protocol import subscribable
from dloco.protocol.limits import MAX_SUBSCRIPTION_BYTES

# a subscription's bytes besides its topic: what one costs however short (the message, the trie)
SUBSCRIPTION_COST = 64
PEER_BYTES = 16 << 10
REFILL_S = 600.0
TOTAL_BYTES = 256 << 10
BAN_S = 60.0
# binding a reopened XPUB where the closed one listened: tries, 50 ms apart
REBIND_TRIES = 40


@dataclasses.dataclass(frozen=True)
class Verdict:
    # the peer went past its budget: ban it, and open the bus's XPUB afresh
    peer_over: bool = False
    # the bus went past its budget: open its XPUB afresh
    bus_over: bool = False

    @property
    def reopen(self) -> bool:
        return self.peer_over or self.bus_over


class SubscriptionBudget:
    """One bus's subscription budgets; `now` is the caller's clock."""

    def __init__(
        self,
        peer_bytes: int = PEER_BYTES,
        refill_s: float = REFILL_S,
        total_bytes: int = TOTAL_BYTES,
    ) -> None:
        self.peer_bytes, self.refill_s, self.total_bytes = peer_bytes, refill_s, total_bytes
        # peer -> (bytes left, when last charged)
        self.left: dict[str, tuple[float, float]] = {}
        # since the XPUB was last opened
        self.total = 0

    def charge(self, peer: str, topic_bytes: int, now: float) -> Verdict:
        """Charge one subscription of a `topic_bytes` topic to `peer` and to the bus."""
        cost = topic_bytes + SUBSCRIPTION_COST
        left, then = self.left.get(peer, (float(self.peer_bytes), now))
        left = min(self.peer_bytes, left + (now - then) * self.peer_bytes / self.refill_s) - cost
        self.left[peer] = (left, now)
        self.total += cost
        return Verdict(peer_over=left < 0, bus_over=self.total > self.total_bytes)

    def reopened(self) -> None:
        """The XPUB was opened afresh: it holds nothing; peers keep what is left of their budgets
        (a peer that went past its own starts again when its ban ends)."""
        self.total = 0
        self.left = {peer: (max(0.0, left), then) for peer, (left, then) in self.left.items()}


class BudgetedXPUB:
    """A bound XPUB (VERBOSE: every subscription reaches its owner, who must read them) whose
    subscriptions are charged to their peers; `make()` makes and binds one, `context` holds the
    CURVE servers' ZAP (where a ban goes).  Its owner polls `socket`: `before_close(old)` and
    `after_open(new)` let it follow a reopening."""

    def __init__(
        self, make: Callable[[], zmq.Socket], context: zmq.Context, log, name: str
    ) -> None:
        self.make, self.context, self.log, self.name = make, context, log, name
        self.socket = make()
        self.budget = SubscriptionBudget()
        # peers banned, times opened afresh
        self.banned = self.reopened = 0
        self.before_close: Callable[[zmq.Socket], None] = lambda old: None
        self.after_open: Callable[[zmq.Socket], None] = lambda new: None

    def send_multipart(self, frames, *args, **kwargs):
        return self.socket.send_multipart(frames, *args, **kwargs)

    def charge(self, frames: list[zmq.Frame]) -> bool:
        """Charge a message read from `socket`, if a subscription to a topic the protocol's
        subscribers never use, to its peer; True: it went past a budget and the socket was opened
        afresh (the one it was read from is closed)."""
        head = bytes(frames[0].buffer[: 1 + MAX_SUBSCRIPTION_BYTES + 1])
        if head[:1] != b"\x01" or (len(frames) == 1 and subscribable(head[1:])):
            return False
        peer = frames[0].get("User-Id") or ""
        verdict = self.budget.charge(peer, len(frames[0]) - 1, time.monotonic())
        if verdict.reopen:
            self._reopen(peer, verdict)
        return verdict.reopen

    def _reopen(self, peer: str, verdict: Verdict) -> None:
        if verdict.peer_over:
            Security.ban(self.context, peer, BAN_S)
            self.banned += 1
        self.log.warning(
            "subscriptions_reopened",
            socket=self.name,
            peer=peer,
            banned_s=BAN_S if verdict.peer_over else 0,
            why="peer budget" if verdict.peer_over else "socket budget",
            held_bytes=self.budget.total,
        )
        self.before_close(self.socket)
        self.socket.close(linger=0)
        for attempt in range(REBIND_TRIES):
            try:
                self.socket = self.make()
                break
            # the closed socket's listener is still being torn down
            except zmq.ZMQError:
                if attempt == REBIND_TRIES - 1:
                    raise
                time.sleep(0.05)
        self.budget.reopened()
        self.reopened += 1
        self.after_open(self.socket)


def give_back_freed() -> bool:
    """glibc's `malloc_trim(0)`: hand the kernel every whole free page of the heaps.  A closed
    socket's subscriptions are freed among memory still in use, and a heap returns memory only from
    its top, so without this they stay resident as holes.  ZeroMQ frees a closed socket on its
    reaper thread, later: an owner calls this a few times after a reopening.  True where glibc has
    it."""
    trim = libc.function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
