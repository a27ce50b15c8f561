"""One merger per run directory: an exclusive `fcntl` lock on `merger.lock`, taken before the log is
opened (a second merger would truncate what it takes for a torn tail, fold the same deltas again and
write checkpoints beside the first one's).  The kernel drops the lock when its holder exits, kill -9
included, so a stale lock file never blocks a restart; the file keeps the holder's PID for the
message."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dloco.protocol.errors import ConfigError, DlocoError

LOCK_NAME = "merger.lock"


class RunDirInUse(DlocoError):
    """Another live process holds the run directory's lock."""


class RunDirLock:
    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(self.fd)
            raise RunDirInUse(
                f"{run_dir} is in use by another merger (pid {holder}, lock {self.path}); "
                "stop it first, or give this one another --run-dir"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            # closing the descriptor drops the flock
            os.close(self.fd)
            self.fd = -1


SHARD_NAME = "shard"


def check_shard(run_dir: Path, shard: int, shards: int) -> None:
    """A run directory belongs to one shard (`I/N` in its file `shard`, written on first use): a
    merger started on it as another shard would fold fragments its log has never seen.  While its
    log holds no record (a standby that refused its primary) it belongs to none yet."""
    path, mine = run_dir / SHARD_NAME, f"{shard}/{shards}"
    logged = any(segment.stat().st_size for segment in (run_dir / "wal").glob("*.seg"))
    if path.exists() and logged:
        theirs = path.read_text().strip()
        if theirs != mine:
            raise ConfigError(
                f"{run_dir} is the run directory of merger shard {theirs}, not {mine}: give this"
                " shard its own --run-dir"
            )
    # a log from before shards were recorded: an unsharded merger's
    elif shards > 1 and logged:
        raise ConfigError(
            f"{run_dir} holds the log of an unsharded merger, not of shard {mine}: give this shard"
            " its own --run-dir"
        )
    else:
        path.write_text(mine + "\n")
