"""Per-message log lines at most once per interval per key, with the count left out ("N more
since").

A peer can send messages far faster than a log should grow: one line per refused heartbeat or
`hello` let one island key write tens of megabytes of merger log onto the write-ahead log's disk.
`Throttle` decides (pure: the caller passes the clock); `ThrottledLog` puts it in front of a
structlog logger, keyed by the line's event and the fields that name who and why (the peer and the
reason), so distinct peers and reasons are each seen, and none can flood.
"""

from __future__ import annotations

import collections
import time


class Throttle:
    """At most one admitted event per `interval_s` per key; the keys held are bounded (the least
    recently admitted goes first), so a flood of distinct keys cannot grow the table."""

    def __init__(self, interval_s: float = 1.0, max_keys: int = 4096) -> None:
        if interval_s <= 0 or max_keys < 1:
            raise ValueError(
                f"a throttle needs interval_s > 0 and max_keys >= 1, got {interval_s}, {max_keys}"
            )
        self.interval_s, self.max_keys = interval_s, max_keys
        # key -> (admitted at, left out since)
        self._last: collections.OrderedDict[object, tuple[float, int]] = collections.OrderedDict()

    def admit(self, key: object, now: float) -> int | None:
        """None: leave this one out.  Otherwise how many were left out since the last admitted
        one."""
        if key in self._last:
            at, skipped = self._last[key]
            if now - at < self.interval_s:
                self._last[key] = (at, skipped + 1)
                return None
            del self._last[key]
        else:
            skipped = 0
        self._last[key] = (now, 0)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return skipped

    def take_left_out(self) -> list[tuple[object, int]]:
        """(key, count) of every key with events left out since its last admitted one; counts
        reset."""
        out = [(key, skipped) for key, (_, skipped) in self._last.items() if skipped]
        for key, _ in out:
            self._last[key] = (self._last[key][0], 0)
        return out


class ThrottledLog:
    """`log.warning(event, **fields)` at most once per interval per (event, fields named by `by`);
    an emitted line carries `left_out=N` when N lines were left out since the last one."""

    def __init__(
        self,
        log,
        by: tuple[str, ...] = ("peer", "island", "sender", "reason", "socket"),
        interval_s: float = 1.0,
        clock=time.monotonic,
    ) -> None:
        self.log, self.by, self.clock = log, by, clock
        self.throttle = Throttle(interval_s)

    def _emit(self, level: str, event: str, fields: dict) -> None:
        key = (event, *(fields.get(name) for name in self.by))
        left_out = self.throttle.admit(key, self.clock())
        if left_out is not None:
            getattr(self.log, level)(
                event, **fields, **({"left_out": left_out} if left_out else {})
            )

    def flush(self) -> None:
        """One line per key with lines left out since its last one (a process stopping says them
        all), marked `flushed`: it stands for those only."""
        for (event, *named), left_out in self.throttle.take_left_out():
            self.log.info(
                event,
                **{name: value for name, value in zip(self.by, named) if value is not None},
                left_out=left_out,
                flushed=True,
            )

    def info(self, event: str, **fields) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields) -> None:
        self._emit("warning", event, fields)
