"""Chaos: kill -9 and restart processes of a running cluster when the run reaches a point.

A schedule is a list of events `ACTION:TARGET@WHEN` — comma-separated after `dloco up --chaos`,
or `[[chaos]]` tables in the cluster file.  ACTION is `kill` (SIGKILL, no warning, no cleanup),
`lose-disk` (a merger's kill, and its run directory deleted) or `restart` (the same command
again); on a cluster with `[run] network = "netns"` (cluster/netns.py) also a fault of the
target's link: `partition` (nothing in or out, no reset), `partition-out` (it sends nothing),
`partition-in` (it receives nothing), `partition-from-PEER` (nothing between it and process PEER
only), `loss-P` (P % of its packets dropped each way) or `heal` (the target's faults removed);
TARGET is a region, `merger` or `broker` — with `[merger] standby = true`, `merger` is
whichever merger is the primary when the event fires and `standby` the other.  WHEN is a point of
the run, by work done or by the clock:
- `step=N`: once the target island has made N training steps (`[[chaos]]`: `at_step = N`);
- `REGION.step=N`: once island REGION has made N steps (`at_step = N`, `island = "REGION"`);
- `folds=N`: once the merger has made N folds (`at_folds = N`);
- `REGION.folds=N`: once the merger has folded N deltas of island REGION (`at_folds = N`,
  `island = "REGION"`): "heal a once a is folded again";
- `SECONDS` or `SECONDSs`: that many seconds after the processes started (`at_s = SECONDS`).
With a `+` (`step=+N`, `REGION.step=+N`, `folds=+N`, `REGION.folds=+N`, `+SECONDS`; `relative =
true`) the point is counted from the moment the event before it fired: "restart c once a has made 60
more steps". Steps and folds count every life of a process (a restarted island goes on counting).
Events fire in the order given (a schedule of absolute seconds alone is put in time order), each
once its point is reached and the one before it has fired.

`due` decides when an event fires; it is pure, and the launcher watches the run and fires.  What an
event did to the others is analysis.chaoseffects, read from the run directory afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path

from dloco.protocol.errors import ConfigError, require

ACTIONS = ("kill", "lose-disk", "restart")
# and loss-P
NETWORK_ACTIONS = ("partition", "partition-in", "partition-out", "heal")
_LOSS = re.compile(r"^loss-(\d+(?:\.\d+)?)$")
PAIR = "partition-from-"


def peer_of(action: str) -> str | None:
    """The other end of a `partition-from-PEER` (None for any other action)."""
    return (
        action.removeprefix(PAIR) if action.startswith(PAIR) and len(action) > len(PAIR) else None
    )


def is_network(action: str) -> bool:
    """A fault of a link, not of a process (cluster/netns.py)."""
    return (
        action in NETWORK_ACTIONS or _LOSS.match(action) is not None or peer_of(action) is not None
    )


# with a standby, chaos names the current primary `merger`, its standby `standby`
MERGERS = ("merger", "standby")


def is_merger(name: str) -> bool:
    """A merger process: `merger`, `standby`, or a merger shard `merger.I` (protocol/shards.py)."""
    return name.partition(".")[0] in MERGERS


_WHEN = re.compile(
    r"^(?:(?P<island>[A-Za-z0-9_-]+)\.)?(?:step=(?P<step>\+?\d+)|folds=(?P<folds>\+?\d+))$"
)


@dataclasses.dataclass(frozen=True)
class ChaosEvent:
    # seconds after the processes started, or None: a point of progress below
    at_s: float | None
    action: str
    target: str
    # once `island` has made this many training steps (every life)
    at_step: int | None = None
    # whose steps (the target's when None), or whose folded deltas (any island's when None)
    island: str | None = None
    # once the merger has made this many folds, or folded this many of `island`'s deltas
    at_folds: int | None = None
    # counted from when the event before it fired (the run's start for the first)
    relative: bool = False

    def __post_init__(self) -> None:
        require(
            self.action in ACTIONS or is_network(self.action),
            "chaos action must be one of"
            f" {(*ACTIONS, *NETWORK_ACTIONS, 'partition-from-PEER', 'loss-P')}, got"
            f" {self.action!r}",
        )
        loss = _LOSS.match(self.action)
        require(
            loss is None or 0 < float(loss[1]) < 100,
            f"chaos {self.action}: the loss must be between 0 and 100 %",
        )
        require(bool(self.target), "chaos event without a target")
        points = [p for p in (self.at_s, self.at_step, self.at_folds) if p is not None]
        require(
            len(points) == 1,
            f"chaos event {self.action}:{self.target} needs exactly one of a time, a step or a fold"
            " count",
        )
        require(
            self.at_s is None or self.at_s >= 0, f"chaos time must be >= 0 seconds, got {self.at_s}"
        )
        for name in ("at_step", "at_folds"):
            value = getattr(self, name)
            require(
                value is None or (type(value) is int and value >= 1),
                f"chaos {name} must be an int >= 1, got {value!r}",
            )
        require(
            self.island is None or self.at_s is None,
            "a chaos event's island names whose steps or folds count: it needs one",
        )
        require(
            type(self.relative) is bool,
            f"chaos relative must be true or false, got {self.relative!r}",
        )

    @property
    def stepper(self) -> str | None:
        """The island whose steps this event waits for (None: it waits for time or folds)."""
        return None if self.at_step is None else (self.island or self.target)

    def __str__(self) -> str:
        plus = "+" if self.relative else ""
        if self.at_s is not None:
            when = f"{plus}{self.at_s:g}"
        elif self.at_folds is not None:
            when = (
                f"{self.island}.folds={plus}{self.at_folds}"
                if self.island
                else f"folds={plus}{self.at_folds}"
            )
        else:
            when = (
                f"{self.island}.step={plus}{self.at_step}"
                if self.island not in (None, self.target)
                else f"step={plus}{self.at_step}"
            )
        return f"{self.action}:{self.target}@{when}"


def parse(text: str) -> tuple[ChaosEvent, ...]:
    """`kill:us-east@step=60,restart:us-east@us-west.step=200` → events in the order given
    (a schedule of seconds alone: in time order)."""
    events = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            head, when = item.rsplit("@", 1)
            action, target = (part.strip() for part in head.split(":", 1))
            when = when.strip()
            if (point := _WHEN.match(when)) is None:
                seconds = float(when.removesuffix("s"))
                if not math.isfinite(seconds):
                    raise ValueError(when)
                at = {"at_s": seconds, "relative": when.startswith("+")}
            elif point["folds"] is not None:
                at = {
                    "at_s": None,
                    "at_folds": int(point["folds"]),
                    "island": point["island"],
                    "relative": point["folds"].startswith("+"),
                }
            else:
                at = {
                    "at_s": None,
                    "at_step": int(point["step"]),
                    "island": point["island"],
                    "relative": point["step"].startswith("+"),
                }
        except ValueError:
            raise ConfigError(
                f"chaos event {item!r}: expected ACTION:TARGET@WHEN with WHEN one of SECONDS,"
                " step=N, REGION.step=N, folds=N, REGION.folds=N, e.g. kill:merger@folds=10"
            ) from None
        events.append(ChaosEvent(action=action, target=target, **at))
    return in_order(events)


_CHAOS_POINTS = {"at_s", "at_step", "at_folds"}


def from_table(path: Path, entry: dict) -> ChaosEvent:
    """A [[chaos]] table of the cluster file at `path`: action, target and one point (at_s, or
    at_step or at_folds with an optional island), `relative = true` to count it from the event
    before."""
    points = _CHAOS_POINTS & set(entry)
    allowed = {"action", "target", *_CHAOS_POINTS, "island", "relative"}
    require(
        {"action", "target"} <= set(entry)
        and len(points) == 1
        and set(entry) <= allowed
        and ("island" not in entry or "at_s" not in entry),
        f"{path}: a [[chaos]] entry needs action, target and one of at_s, at_step or at_folds (the"
        f" last two with an optional island) (and optionally relative), got {sorted(entry)}",
    )
    relative = entry.get("relative", False)
    (point,) = points
    value = entry[point]
    if point == "at_s":
        require(
            type(value) in (int, float),
            f"{path}: [[chaos]] at_s must be a number of seconds, got {value!r}",
        )
        return ChaosEvent(
            float(value), str(entry["action"]), str(entry["target"]), relative=relative
        )
    require(type(value) is int, f"{path}: [[chaos]] {point} must be an int, got {value!r}")
    return ChaosEvent(
        None,
        str(entry["action"]),
        str(entry["target"]),
        **{point: value},
        island=str(entry["island"]) if "island" in entry else None,
        relative=relative,
    )


def in_order(events: list[ChaosEvent]) -> tuple[ChaosEvent, ...]:
    """The firing order: as given, except that a schedule of absolute seconds alone is sorted by
    time."""
    return (
        tuple(sorted(events, key=lambda e: e.at_s))
        if all(e.at_s is not None and not e.relative for e in events)
        else tuple(events)
    )


def check(
    schedule: tuple[ChaosEvent, ...],
    processes: list[str],
    islands: list[str] | None = None,
    groups: Mapping[str, list[str]] | None = None,
) -> None:
    """Every target exists; in firing order, a process is killed only while running and restarted
    only after a kill; an event waits only for the steps of an island that is running then.
    `groups`: a process -> every process of its island (a multi-host island goes down and comes
    back as a whole: cluster/processes.py)."""
    islands = (
        [p for p in processes if not is_merger(p) and p != "broker"] if islands is None else islands
    )
    groups = groups or {}
    down: set[str] = set()
    for event in schedule:
        require(
            event.target in processes,
            f"chaos event {event}: unknown process {event.target!r}; known: {', '.join(processes)}",
        )
        if event.at_folds is not None and event.island is not None:
            require(
                event.island in islands,
                f"chaos event {event}: {event.island!r} sends no deltas; islands:"
                f" {', '.join(islands)}",
            )
        if event.stepper is not None:
            require(
                event.stepper in islands,
                f"chaos event {event}: {event.stepper!r} makes no training steps; islands:"
                f" {', '.join(islands)}",
            )
            require(
                event.stepper not in down,
                f"chaos event {event}: it waits for the steps of {event.stepper}, which is down"
                " then",
            )
        # a link's fault: the process keeps running
        if is_network(event.action):
            peer = peer_of(event.action)
            require(
                peer is None or (peer in processes and peer != event.target),
                f"chaos event {event}: unknown peer {peer!r}",
            )
            continue
        if event.action in ("kill", "lose-disk"):
            require(
                event.action == "kill" or is_merger(event.target),
                f"chaos event {event}: only a merger has a disk to lose",
            )
            require(
                event.target not in down, f"chaos event {event}: {event.target} is already down"
            )
            down.update(groups.get(event.target, [event.target]))
        else:
            require(
                event.target in down, f"chaos event {event}: {event.target} was not killed before"
            )
            down.difference_update(groups.get(event.target, [event.target]))


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a run is: seconds since the processes started, training steps per island (every life),
    the merger's folds (every life), and per island the folds that took one of its deltas."""

    elapsed_s: float
    steps: Mapping[str, int]
    folds: int
    folded: Mapping[str, int] = dataclasses.field(default_factory=dict)


def due(event: ChaosEvent, now: Progress, armed: Progress) -> bool:
    """Has the run reached `event`'s point?  `armed`: where the run was when the event before it
    fired (the start for the first event), from which a relative point counts."""
    base = armed if event.relative else Progress(0.0, {}, 0)
    if event.at_s is not None:
        return now.elapsed_s - base.elapsed_s >= event.at_s
    if event.at_folds is not None and event.island is not None:
        return now.folded.get(event.island, 0) - base.folded.get(event.island, 0) >= event.at_folds
    if event.at_folds is not None:
        return now.folds - base.folds >= event.at_folds
    return now.steps.get(event.stepper, 0) - base.steps.get(event.stepper, 0) >= event.at_step
