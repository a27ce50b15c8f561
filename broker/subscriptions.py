"""What subscribers may make a bus's XPUB hold: pure accounting, the broker acts on it.

ZeroMQ's XPUB keeps every topic a subscriber sends until that connection closes, with no limit per
peer and no way to drop one connection's topics.  So the broker charges each subscription to the
peer whose key sent it (ZAP's User-Id) and to the bus:

- a peer's budget is a bucket of PEER_BYTES, refilled at that much per REFILL_S: an honest island
  subscribes to a handful of topics of at most 16 bytes per connection (about 450 bytes with
  SUBSCRIPTION_COST each), so it may reconnect dozens of times in a row;
- the bus's budget is TOTAL_BYTES of subscriptions since its XPUB was last opened.

A subscription past its peer's budget bans that peer (ZAP refuses its key for BAN_S) and has the
broker open the bus's XPUB afresh, which frees every topic it held; past the bus's budget (many
keys, each within its own), the XPUB is opened afresh too.  Subscribers reconnect and subscribe
again on their own (ZeroMQ's SUB does both); what was in flight to them is lost and recovered as
any loss is (resends, catch-up).  So what an XPUB holds stays within TOTAL_BYTES plus one peer's
budget, whatever the subscribers send.
"""

from __future__ import annotations

import dataclasses

# a subscription's bytes besides its topic: what one costs however short (the message, the trie)
SUBSCRIPTION_COST = 64
PEER_BYTES = 16 << 10
REFILL_S = 600.0
TOTAL_BYTES = 256 << 10
BAN_S = 60.0


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
