"""The cluster's trained tokens as one merger knows them (PROTOCOL.md §6.1), which islands decay
their inner schedule by when a run has a token budget.

Each island life (sender, epoch) says in its heartbeats how many tokens it has trained; the
merger keeps the largest claim of each life and sums them over every life it has heard of, so an
island that restarted still counts what its earlier lives trained.

A claim is believed only as far as the life's deltas back it: at most the tokens of its
most-covered fragment (every delta carries the tokens trained since that fragment's previous
send, so that sum is what the island had trained at its last send of the fragment) plus its
largest single delta (one round not yet sent).  A key that claims 2^60 tokens therefore moves the
count by about one round of its real work, and a life that has sent no delta counts nothing.

Delta token counts are themselves claims.  In a fragment where other islands have sent deltas, an
island's deltas count at most CLAIM_RATIO times the largest other island's mean tokens per delta
there, each (judged when `total` is read, so deltas sent before another island arrived are judged
too).  So one key cannot inflate the count past a few islands' real work, while islands that differ
in batch or interval (the shipped profile's: 2x) count in full.  An island alone in a fragment
counts what it claims.

Pure: values in, values out; the service feeds it and reads `total` into every ack.
"""

from __future__ import annotations

import collections
import dataclasses

# an island's deltas in a fragment count at most this times the largest other island's mean tokens
# per delta there
CLAIM_RATIO = 4.0


@dataclasses.dataclass
class _Life:
    # the largest `tokens` of this life's heartbeats
    claimed: int = 0
    per_fragment: dict[int, int] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(int)
    )
    # deltas per fragment
    deltas: dict[int, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
    # the largest single delta's tokens
    largest: int = 0

    def counted(self, limits: dict[int, float | None]) -> int:
        """What the life's deltas back: its most-covered fragment, each fragment's sum at most its
        deltas times their `limits` (None: none); and of its heartbeats' claim, at most that plus
        one round in hand (its largest delta, within the largest limit)."""
        sent = 0.0
        for fragment, tokens in self.per_fragment.items():
            limit = limits.get(fragment)
            sent = max(
                sent, tokens if limit is None else min(tokens, self.deltas[fragment] * limit)
            )
        if not sent:
            return 0
        known = [limit for limit in limits.values() if limit is not None]
        in_hand = min(self.largest, max(known)) if known else self.largest
        return int(max(sent, min(self.claimed, sent + in_hand)))


class TrainedTokens:
    """Per island life: what its heartbeats claim and what its deltas back; `total` sums them."""

    def __init__(self) -> None:
        self.lives: dict[tuple[str, int], _Life] = {}

    def _life(self, sender: str, epoch: int) -> _Life:
        return self.lives.setdefault((sender, epoch), _Life())

    def delta(self, sender: str, epoch: int, fragment: int, tokens: int) -> None:
        """A whole delta arrived (folded or rejected: its tokens were trained either way)."""
        life = self._life(sender, epoch)
        life.per_fragment[fragment] += tokens
        life.deltas[fragment] += 1
        life.largest = max(life.largest, tokens)

    def heartbeat(self, sender: str, epoch: int, tokens: int) -> None:
        """A claim; a life is known from its first delta on (before it, a claim would count
        nothing, and heartbeats alone cannot grow the table)."""
        if (life := self.lives.get((sender, epoch))) is not None:
            life.claimed = max(life.claimed, tokens)

    @property
    def total(self) -> int:
        return sum(self.by_life().values())

    def by_life(self) -> dict[tuple[str, int], int]:
        """What each life (sender, epoch) counts."""
        # per fragment, the two largest (mean tokens per delta, sender) over senders: the largest
        # other island's, for any sender, is one of them
        top: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
        for (sender, _), life in self.lives.items():
            for fragment, tokens in life.per_fragment.items():
                mean = tokens / life.deltas[fragment]
                ranked = [entry for entry in top[fragment] if entry[1] != sender]
                best = max([mean, *(m for m, s in top[fragment] if s == sender)])
                top[fragment] = sorted([*ranked, (best, sender)], reverse=True)[:2]
        counted = {}
        for (sender, epoch), life in self.lives.items():
            limits = {}
            for fragment in life.per_fragment:
                others = [mean for mean, other in top[fragment] if other != sender]
                limits[fragment] = CLAIM_RATIO * others[0] if others else None
            counted[sender, epoch] = life.counted(limits)
        return counted
