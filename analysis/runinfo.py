"""Reading a run directory: island metrics (JSON lines), the merger's fold log lines, and the task
its islands trained (task.json).  A running cluster's progress, read as its files grow:
analysis/progress.py."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dloco.protocol.errors import DlocoError

# in a run directory: what its islands trained (RunTask)
RUN_TASK = "task.json"


class RunDirError(DlocoError):
    """A folder is not a run directory, or a run directory lacks what was asked of it."""


@dataclasses.dataclass(frozen=True)
class RunTask:
    """What a run's islands trained, recorded by `dloco up` / `dloco prepare` as RUN_DIR/task.json,
    so that its model can be built again (`dloco sample`, `dloco export`) without the cluster file:
    the task plug-in's spec and options as an island receives them, the seed the parameters start
    from, and the batch and island count the task's data split depends on."""

    # island/task.py: PATH.py:FUNCTION or MODULE:FUNCTION
    task: str
    # the task function's options (the built-in LM's size, corpus, tokens, ...)
    options: Mapping[str, Any]
    seed: int
    batch: int
    islands: int

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / RUN_TASK
        path.write_text(
            json.dumps(
                dataclasses.asdict(self) | {"options": dict(self.options)}, indent=2, sort_keys=True
            )
            + "\n"
        )
        return path

    @classmethod
    def read(cls, run_dir: Path) -> RunTask:
        """RUN_DIR/task.json; RunDirError naming the file when it is missing or not one."""
        path = Path(run_dir) / RUN_TASK
        try:
            fields = json.loads(path.read_text())
        except FileNotFoundError:
            raise RunDirError(
                f"{run_dir} has no {RUN_TASK} (a run directory made before runs recorded their"
                " task?): give --config the cluster file it ran"
            ) from None
        except (OSError, json.JSONDecodeError) as error:
            raise RunDirError(f"cannot read {path}: {error}") from None
        kinds = {"task": str, "options": dict, "seed": int, "batch": int, "islands": int}
        if (
            not isinstance(fields, dict)
            or set(fields) != set(kinds)
            or not all(type(fields[k]) is kind for k, kind in kinds.items())
        ):
            raise RunDirError(
                f"{path} must be an object with"
                f" {', '.join(f'{k} ({kind.__name__})' for k, kind in kinds.items())}, got"
                f" {json.dumps(fields)[:200]}"
            )
        return cls(**fields)


def log_segments(path: Path) -> list[Path]:
    """A log file and the older segments its process rotated out of it (telemetry/logs.py:
    NAME.log.1 is the newest of those), oldest first; the file itself last, whether or not it
    exists.
    """
    path, older = Path(path), []
    while (segment := path.with_name(f"{path.name}.{len(older) + 1}")).exists():
        older.append(segment)
    return [*reversed(older), path]


def _json_lines(data: bytes) -> list:
    events = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            events.append(json.loads(line))
        # a line being written, or a process's non-JSON output (a traceback)
        except json.JSONDecodeError:
            continue
    return events


def read_events(path: Path) -> list[dict]:
    """Every complete JSON line of a log or metrics file, its rotated segments first (a line being
    written is skipped)."""
    events = []
    for segment in log_segments(path):
        try:
            events.extend(_json_lines(segment.read_bytes()))
        # not written yet, or rotated away while being read
        except FileNotFoundError:
            continue
    return events


class JsonTail:
    """A JSON-lines file read incrementally: `new()` returns the objects of the complete lines added
    since the last call.  It follows the file across rotations (telemetry/logs.py): when the path
    names a new file, the rest of the one being read is taken from NAME.1, then the new one from
    its start.  The first call reads the rotated segments already there, oldest first."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial, self.inode = Path(path), 0, b"", None

    def new(self) -> list[dict]:
        try:
            inode = self.path.stat().st_ino
        # not written yet, or between a rotation's rename and its new file
        except OSError:
            return []
        chunks = []
        # the first look: the segments rotated out before it, oldest first
        if self.inode is None:
            chunks = [_read_from(segment, 0) for segment in log_segments(self.path)[:-1]]
        # rotated since the last call: the rest of the file being read is NAME.1
        elif inode != self.inode:
            rotated = self.path.with_name(f"{self.path.name}.1")
            try:
                if rotated.stat().st_ino == self.inode:
                    chunks.append(self.partial + _read_from(rotated, self.offset))
            # rotated twice since: its rest is further back, or deleted
            except OSError:
                pass
            self.offset, self.partial = 0, b""
        self.inode = inode
        data = self.partial + _read_from(self.path, self.offset)
        self.offset += len(data) - len(self.partial)
        complete = data.rfind(b"\n") + 1
        self.partial = data[complete:]
        chunks.append(data[:complete])
        return [e for e in _json_lines(b"\n".join(chunks)) if isinstance(e, dict)]


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read()
    except OSError:
        return b""


def read_metrics(path: Path) -> list[dict]:
    """An island's metrics in the order written, with the evaluations it made after training
    (`deferred`: island --eval-trace) put back on the steps they measured, as `eval_loss` and
    `eval_deferred`. A step is found by its step number and wall time (a restarted island counts
    steps from 1 again).
    """
    events = read_events(path)
    steps = {(e.get("step"), e.get("wall")): e for e in events if not e.get("deferred")}
    for event in events:
        if (
            event.get("deferred")
            and (step := steps.get((event.get("step"), event.get("wall")))) is not None
        ):
            step.update(eval_loss=event["eval_loss"], eval_deferred=True)
    return [e for e in events if not e.get("deferred")]


def lives(events: list[dict]) -> list[list[dict]]:
    """An island's step events split where it (re)started: each start writes a step-0 evaluation."""
    split: list[list[dict]] = []
    for event in events:
        if event.get("step") == 0 or not split:
            split.append([])
        split[-1].append(event)
    return split


def last_step(split: list[list[dict]]) -> dict:
    """An island's last step event (its last life's: step, rate, utilisation) with tokens and bytes
    summed over its lives (a restarted island counts from 0 again)."""
    ends = [life[-1] for life in split if life]
    return (
        {
            **ends[-1],
            **{
                k: sum(e.get(k, 0) for e in ends)
                for k in ("tokens", "bytes_sent", "bytes_received", "bytes_received_values")
            },
        }
        if ends
        else {}
    )


def last_events(path: Path, tail_bytes: int = 16384) -> list[dict]:
    """The complete JSON lines among the last `tail_bytes` of a file (cheap for a live view)."""
    if not path.exists():
        return []
    with open(path, "rb") as handle:
        start = max(0, path.stat().st_size - tail_bytes)
        handle.seek(start)
        lines = handle.read().decode("utf-8", "replace").splitlines()
    if start > 0:
        # the first line was cut by the seek
        lines = lines[1:]
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


# with a standby, either may be the primary: folds are in both
MERGER_LOGS = ("merger.log", "standby.log")


def merger_logs(run_dir: Path) -> list[str]:
    """The merger logs of a run: MERGER_LOGS, and merger.I.log and standby.I.log of every further
    merger shard that has one so far (shard 0 is merger.log)."""
    shards = sorted(
        (
            p.name
            for p in (Path(run_dir) / "logs").glob("*.*.log")
            if re.fullmatch(r"(merger|standby)\.[1-9][0-9]*\.log", p.name)
        ),
        key=lambda name: (int(name.split(".")[1]), name),
    )
    return [*MERGER_LOGS, *shards]


def shard_run_dirs(run_dir: Path) -> list[Path]:
    """Every merger shard's run directory, index I at position I: merger_run_dir's (shard 0, or
    its standby after a takeover), then merger.1/, merger.2/, ... (`[merger] shards`).
    RunDirError when one is missing (fragment f is shard f % N's: a gap would shift them)."""
    found = {
        int(match.group(1))
        for path in Path(run_dir).glob("merger.*")
        if path.is_dir() and (match := re.fullmatch(r"merger\.([1-9][0-9]*)", path.name))
    }
    missing = [index for index in range(1, max(found, default=0) + 1) if index not in found]
    if missing:
        raise RunDirError(
            f"{run_dir}: merger shard run directories {', '.join(f'merger.{i}' for i in missing)}"
            f" are missing (the run had at least {max(found) + 1} shards)"
        )
    return [merger_run_dir(run_dir, index) for index in range(max(found, default=0) + 1)]


ROLE_EVENTS = {
    "following": "standby",
    "stepped_down": "standby",
    "no_primary": "primary",
    "taking_over": "primary",
}


def merger_folds(run_dir: Path) -> list[dict]:
    """Every fold logged by a primary (the merger, or the standby once it took over), in time
    order."""
    folds = [
        e
        for name in merger_logs(run_dir)
        for e in read_events(run_dir / "logs" / name)
        if e.get("event") == "fold"
    ]
    return sorted(folds, key=lambda e: e.get("timestamp", ""))


def merger_run_dir(run_dir: Path, shard: int = 0) -> Path:
    """The merger's run directory with the longest log: merger/, or standby/ after a takeover (by
    their newest checkpoint; each writes one at its log's end when it stops); merger.I/ or
    standby.I/ for shard I."""

    def newest(directory: Path) -> int:
        return max(
            (int(p.stem) for p in (directory / "checkpoints").glob("*.ckpt") if p.stem.isdigit()),
            default=-1,
        )

    suffix = f".{shard}" if shard else ""
    return max((run_dir / f"merger{suffix}", run_dir / f"standby{suffix}"), key=newest)


def merger_role(log: Path) -> str | None:
    """ "primary" or "standby" by a merger's log's last role event (None: it has a peer in
    neither)."""
    role = None
    for event in read_events(log):
        role = ROLE_EVENTS.get(event.get("event"), role)
    return role


def wall(event: dict) -> float:
    """A log line's ISO timestamp as seconds since the epoch."""
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def step_times(
    run_dir: Path, regions: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per island, the wall time of every training step and of every join (step 0), all lives."""
    steps, joins = {}, {}
    for region in regions:
        events = [e for e in read_metrics(run_dir / "metrics" / f"{region}.jsonl") if "wall" in e]
        steps[region] = [e["wall"] for e in events if e.get("step", 0) > 0]
        joins[region] = [e["wall"] for e in events if e.get("step") == 0]
    return steps, joins


def chaos_effects(run_dir: Path, regions: list[str]) -> list[dict]:
    """What each executed chaos event did to the rest of the cluster (analysis.chaoseffects)."""
    from dloco.analysis.chaoseffects import effects

    executed = read_events(run_dir / "chaos.jsonl")
    if not executed:
        return []
    steps, joins = step_times(run_dir, regions)
    folds = [(wall(e), tuple(e["contributors"])) for e in merger_folds(run_dir)]
    return effects(executed, steps, joins, folds)
