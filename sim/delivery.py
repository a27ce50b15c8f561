"""What reaches the islands in the simulator: their downlinks as FIFO pipes, every island's at once
(`Downlinks`: LinkShaper's arithmetic over arrays), and per fragment each published version with
when it reached each island (`Published`), forgetting what every island that is up has seen.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from dloco.sim.scenario import Island

# published snapshots per fragment between prunings of those every island has seen
PRUNE_EVERY = 4096


class Downlinks:
    """Every island's downlink: a rate, a one-way latency of RTT / 2, the next message starting
    when the previous one's last byte left."""

    def __init__(self, islands: Sequence[Island]) -> None:
        n = len(islands)
        self.rate = np.array(
            [np.inf if i.link.down_bps is None else i.link.down_bps / 8 for i in islands]
        )
        self.latency = np.array([i.link.rtt_s / 2 for i in islands])
        self.free = np.zeros(n)
        # per island, bytes sent down to it
        self.bytes = np.zeros(n, np.int64)

    def send(self, mask: np.ndarray, nbytes: int, now: float) -> np.ndarray:
        """When `nbytes` handed over at `now` reaches each island in `mask` (inf for the others)."""
        sent = np.maximum(now, self.free) + nbytes / self.rate
        self.free = np.where(mask, sent, self.free)
        self.bytes += np.where(mask, nbytes, 0)
        return np.where(mask, sent + self.latency, np.inf)


class Published:
    """Per fragment, the published versions and when each reached each island (inf: never); per
    island and fragment the index of the newest one it has (arrivals are FIFO per island)."""

    def __init__(self, islands: int, fragments: int) -> None:
        self.entries: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(fragments)]
        self.seen = np.full((islands, fragments), -1, np.int64)

    def joined(self, island: int, fragment: int) -> None:
        """A joining island downloads the current value: every version published so far is its."""
        self.seen[island, fragment] = len(self.entries[fragment]) - 1

    def newest(self, island: int, fragment: int, now: float) -> int:
        """The newest published version of `fragment` that has reached `island` by `now` (0:
        none)."""
        published = self.entries[fragment]
        lo = self.seen[island, fragment] + 1
        hi = bisect.bisect_right(published, now, lo=lo, key=lambda entry: entry[1][island])
        self.seen[island, fragment] = hi - 1
        return published[hi - 1][0] if hi > 0 else 0

    def add(self, fragment: int, version: int, arrival: np.ndarray, receiving: np.ndarray) -> None:
        """`version` of `fragment`, reaching each island at `arrival`; `receiving`: the islands
        that are up."""
        published = self.entries[fragment]
        published.append((version, arrival))
        # what every island that is up has seen is looked up no more
        if len(published) % PRUNE_EVERY == 0:
            done = int(self.seen[receiving, fragment].min(initial=len(published) - 1))
            if done > 0:
                del published[:done]
                self.seen[:, fragment] = np.maximum(self.seen[:, fragment] - done, -1)
