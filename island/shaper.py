"""Emulated WAN link: a token bucket (rate) plus a fixed one-way latency, per direction.

`LinkShaper.schedule(nbytes, now)` returns when a message of `nbytes` handed over at `now` has
fully arrived at the other end: it starts when the link is free (FIFO), takes nbytes / rate
seconds on the wire, and lands `latency` later.  Transmission of the next message overlaps the
previous one's latency, as on a real pipe.  Pure arithmetic with the clock passed in, so it is
tested without sleeping; the I/O threads sleep until the times it returns.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LinkShaper:
    # None: unlimited
    rate_bytes_s: float | None
    # one way (rtt / 2)
    latency_s: float = 0.0
    # when the wire finishes sending what was scheduled so far
    _free_at: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bytes_s is not None and self.rate_bytes_s <= 0:
            raise ValueError(f"link rate must be > 0 bytes/s, got {self.rate_bytes_s}")
        if self.latency_s < 0:
            raise ValueError(f"link latency must be >= 0 s, got {self.latency_s}")

    @classmethod
    def from_mbps(cls, mbps: float | None, rtt_ms: float = 0.0) -> LinkShaper:
        return cls(None if not mbps else mbps * 1e6 / 8, rtt_ms / 2000.0)

    @property
    def free_at(self) -> float:
        """When the wire finishes sending what was scheduled so far."""
        return self._free_at

    def schedule(self, nbytes: int, now: float) -> tuple[float, float]:
        """(time the last byte leaves, time it arrives) for a message handed over at `now`."""
        start = max(now, self._free_at)
        sent = start + (nbytes / self.rate_bytes_s if self.rate_bytes_s else 0.0)
        self._free_at = sent
        return sent, sent + self.latency_s
