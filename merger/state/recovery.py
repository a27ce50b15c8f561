"""Rebuild a `MergerCore` from its run directory: newest valid checkpoint + log tail.

Used both to restart after a crash (`recover`) and by `dloco replay` (`replay`, from genesis
only, checking checkpoints on the way).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dloco.merger.fold.merge import FoldReport
from dloco.merger.log import records
from dloco.merger.log.rundir import RunDirLock, check_shard
from dloco.merger.log.segments import read_records
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state import checkpoint
from dloco.merger.state.core import Log, MergerCore, ReplayError


def wal_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "wal"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


@dataclasses.dataclass
class Opened:
    """A merger's durable state, ready to serve: its run directory's lock, its write-ahead log, the
    core as the log left it (or new), and the epoch it serves under."""

    lock: RunDirLock
    wal: WriteAheadLog
    core: MergerCore
    epoch: int


def open_run(config, core_factory: Callable[[WriteAheadLog], MergerCore], log) -> Opened:
    """Lock `config.run_dir` (RunDirInUse when another merger runs there), open its log, and rebuild
    the core from it, or make a new one with `core_factory` (which writes the genesis record) when
    the log is empty.  A new epoch: this start's time.  `config`: merger.settings.ServiceConfig."""
    lock = RunDirLock(config.run_dir)
    check_shard(config.run_dir, config.shard, config.shards)
    wal = WriteAheadLog(wal_dir(config.run_dir), fsync=config.fsync)
    if wal.truncated_bytes or wal.discarded:
        log.warning(
            "wal_torn_tail_truncated", bytes=wal.truncated_bytes, segments_set_aside=wal.discarded
        )
    if wal.next_index > 0:
        core = recover(config.run_dir, log=wal)
        log.info(
            "recovered",
            next_index=wal.next_index,
            versions=[s.version for s in core.states],
            digest=core.digest(),
        )
    else:
        core = core_factory(wal)
        log.info("genesis", fragments=len(core.fragments), digest=core.digest())
    return Opened(lock, wal, core, time.time_ns())


def genesis_record(run_dir: Path) -> dict:
    """The first record of the log in `run_dir` (the merger's --run-dir)."""
    if not wal_dir(run_dir).is_dir():
        raise ReplayError(f"no write-ahead log at {wal_dir(run_dir)}")
    for index, record in read_records(wal_dir(run_dir)):
        if index != 0 or record.get("type") != records.GENESIS:
            raise ReplayError(f"{wal_dir(run_dir)}: the first log record is not a genesis record")
        return record
    raise ReplayError(f"{wal_dir(run_dir)}: the log is empty")


def initial_states(run_dir: str | Path) -> list:
    """Each fragment's state as the run's log starts it (its genesis record; a shard's holds its
    own fragments only)."""
    return MergerCore.from_genesis(genesis_record(Path(run_dir))).states


def recover(run_dir: str | Path, log: Log | None = None) -> MergerCore:
    """The state the merger had after its last logged record.  `log` is attached afterwards."""
    run_dir = Path(run_dir)
    core = MergerCore.from_genesis(genesis_record(run_dir))
    saved = checkpoint.latest(checkpoint_dir(run_dir))
    next_index, pending = 1, set()
    if saved is not None:
        checkpoint.import_state(core, saved)
        if core.digest() != saved["digest"]:
            raise ReplayError(
                f"checkpoint at record {saved['next_index']} does not reproduce its own digest"
            )
        next_index, pending = saved["next_index"], set(saved["pending"])
    # from the record before the checkpoint's position: the log must reach it
    end = 0
    for index, record in read_records(wal_dir(run_dir), min(pending | {next_index - 1})):
        end = index + 1
        if index >= next_index or index in pending:
            core.apply_record(record, index, requeue=index < next_index)
    # a checkpoint is written after a sync: those records were durable, and are gone
    if end < next_index:
        raise ReplayError(
            f"checkpoint at record {next_index} lies beyond the end of the write-ahead log (its"
            f" last record is {end - 1}): records the checkpoint covers are missing"
        )
    core.log = log
    return core


def software_mismatch(run_dir: str | Path) -> str | None:
    """Why replaying this log may not reproduce its bytes (records.software_mismatch)."""
    return records.software_mismatch(genesis_record(Path(run_dir)))


def replay(
    run_dir: str | Path,
    on_fold: Callable[[int, dict, FoldReport, MergerCore], None],
    strict: bool = True,
) -> Iterator[tuple[int, str, str]]:
    """Replay the whole log from genesis.  Calls on_fold after every fold record; yields
    (next_index, checkpoint digest, replayed digest) at every checkpoint position."""
    run_dir = Path(run_dir)
    core = MergerCore.from_genesis(genesis_record(run_dir))
    expected = {}
    for path in checkpoint.all_checkpoints(checkpoint_dir(run_dir)):
        content = checkpoint.read(path)
        if content is None:
            raise ReplayError(f"checkpoint {path.name} is unreadable (checksum or length)")
        expected[content["next_index"]] = content["digest"]
    index = 0
    for index, record in read_records(wal_dir(run_dir), 1, allow_torn_tail=not strict):
        if index in expected:
            yield index, expected.pop(index), core.digest()
        report = core.apply_record(record, index)
        if report is not None:
            on_fold(index, record, report, core)
    for position, digest in sorted(expected.items()):
        if position == index + 1:
            yield position, digest, core.digest()
        else:
            raise ReplayError(
                f"checkpoint at record {position} lies beyond the end of the log (last record"
                f" {index})"
            )
