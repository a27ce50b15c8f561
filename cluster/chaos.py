"""Chaos: kill -9 and restart processes of a running cluster at given times, and what that did to
the others.

A schedule is a list of events `ACTION:TARGET@SECONDS` — comma-separated after `dloco up --chaos`,
or `[[chaos]]` tables (`at_s`, `action`, `target`) in the cluster file — with seconds counted from
the moment the processes are started.  ACTION is `kill` (SIGKILL, no warning, no cleanup) or
`restart` (the same command again); TARGET is a region, `merger` or `broker`.

`effects` is pure: from the executed events, the islands' step times and the merger's fold times it
derives one row per event (step rates of the other islands before and after, folds before and
after, time to rejoin and to the next fold).  The launcher logs; the report prints the rows.
"""

from __future__ import annotations

import dataclasses

from protocol.errors import ConfigError, require

ACTIONS = ("kill", "restart")
WINDOW_S = 15.0  # seconds before / after an event over which step rates and folds are compared


@dataclasses.dataclass(frozen=True)
class ChaosEvent:
    at_s: float
    action: str
    target: str

    def __post_init__(self) -> None:
        require(self.action in ACTIONS, f"chaos action must be one of {ACTIONS}, got {self.action!r}")
        require(self.at_s >= 0, f"chaos time must be >= 0 seconds, got {self.at_s}")
        require(bool(self.target), "chaos event without a target")

    def __str__(self) -> str:
        return f"{self.action}:{self.target}@{self.at_s:g}"


def parse(text: str) -> tuple[ChaosEvent, ...]:
    """`kill:us-east@60,restart:us-east@90` → events in time order."""
    events = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            head, at = item.rsplit("@", 1)
            action, target = head.split(":", 1)
            seconds = float(at)
        except ValueError:
            raise ConfigError(f"chaos event {item!r}: expected ACTION:TARGET@SECONDS, e.g. kill:merger@60") from None
        events.append(ChaosEvent(seconds, action.strip(), target.strip()))
    return tuple(sorted(events, key=lambda e: e.at_s))


def check(schedule: tuple[ChaosEvent, ...], processes: list[str]) -> None:
    """Every target exists; a process is killed only while running and restarted only after a kill."""
    down: set[str] = set()
    for event in sorted(schedule, key=lambda e: e.at_s):
        require(event.target in processes, f"chaos event {event}: unknown process {event.target!r}; known: {', '.join(processes)}")
        if event.action == "kill":
            require(event.target not in down, f"chaos event {event}: {event.target} is already down")
            down.add(event.target)
        else:
            require(event.target in down, f"chaos event {event}: {event.target} was not killed before")
            down.discard(event.target)


def _count(times: list[float], start: float, end: float) -> int:
    return sum(start <= t < end for t in times)


def effects(executed: list[dict], steps: dict[str, list[float]], joins: dict[str, list[float]],
            folds: list[tuple[float, tuple[str, ...]]], window_s: float = WINDOW_S) -> list[dict]:
    """One row per executed event ({"wall", "action", "target"}), all times in wall-clock seconds.

    steps: per island, the wall time of every training step; joins: per island, when a process of it
    joined (got the merger's model); folds: (wall time, contributors) of every fold.
    The "after" window ends early at the next event, so two faults are not mixed up.  A kill that is
    followed by a restart of the same process also gets `during_absence`: each other island's steps
    over the whole absence / its steps over as long a stretch just before the kill (None without any)."""
    rows = []
    ordered = sorted(executed, key=lambda e: e["wall"])
    for index, event in enumerate(ordered):
        t = event["wall"]
        after_end = min(t + window_s, ordered[index + 1]["wall"]) if index + 1 < len(ordered) else t + window_s
        before_start = max(t - window_s, ordered[index - 1]["wall"]) if index > 0 else t - window_s
        rates = {}
        for island, times in steps.items():
            if island == event["target"] or after_end <= t or t <= before_start:
                continue
            before = _count(times, before_start, t) / (t - before_start)
            after = _count(times, t, after_end) / (after_end - t)
            rates[island] = {"before": before, "after": after, "ratio": after / before if before else None}
        row = {**event, "others": rates, "window_s": (t - before_start, after_end - t),
               "folds_before": sum(before_start <= w < t for w, _ in folds), "folds_after": sum(t <= w < after_end for w, _ in folds),
               "contributors_after": sorted({c for w, cs in folds if t <= w < after_end for c in cs})}
        back = next((e["wall"] for e in ordered[index + 1:] if e["target"] == event["target"] and e["action"] == "restart"), None)
        if event["action"] == "kill" and back is not None:  # the whole absence against as long a stretch just before it
            length = back - t
            row["absence_s"] = length
            row["during_absence"] = {island: _count(times, t, back) / _count(times, t - length, t) if _count(times, t - length, t) else None
                                     for island, times in steps.items() if island != event["target"]}
        if event["action"] == "restart":
            if event["target"] in steps:  # an island: when did it rejoin, and when was its first delta folded?
                rejoined = [w for w in joins.get(event["target"], []) if w >= t]
                folded = [w for w, cs in folds if w >= t and event["target"] in cs]
                row["rejoined_s"] = rejoined[0] - t if rejoined else None
                row["first_fold_s"] = folded[0] - t if folded else None
            else:
                later = [w for w, _ in folds if w >= t]
                row["first_fold_s"] = later[0] - t if later else None
        rows.append(row)
    return rows
