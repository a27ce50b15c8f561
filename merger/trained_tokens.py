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
Delta token counts are themselves claims; the admission's share cap (merger/admission.py) bounds
what a fold gives them, not what they add here.

Pure: values in, values out; the service feeds it and reads `total` into every ack.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class _Life:
    # the largest `tokens` of this life's heartbeats
    claimed: int = 0
    per_fragment: dict[int, int] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(int)
    )
    # the largest single delta's tokens
    largest: int = 0

    def backed(self) -> int:
        """What the life's deltas back: its most-covered fragment plus one round in hand."""
        sent = max(self.per_fragment.values(), default=0)
        return sent + self.largest if sent else 0

    def counted(self) -> int:
        return max(max(self.per_fragment.values(), default=0), min(self.claimed, self.backed()))


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
        life.largest = max(life.largest, tokens)

    def heartbeat(self, sender: str, epoch: int, tokens: int) -> None:
        """A claim; a life is known from its first delta on (before it, a claim would count
        nothing, and heartbeats alone cannot grow the table)."""
        if (life := self.lives.get((sender, epoch))) is not None:
            life.claimed = max(life.claimed, tokens)

    @property
    def total(self) -> int:
        return sum(life.counted() for life in self.lives.values())
