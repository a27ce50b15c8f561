"""Structured logs for every process: structlog JSON lines on stdout (console rendering in a tty),
bound with the process's role and identity.

When stdout is a regular file (`dloco up` points each process's stdout and stderr at
logs/NAME.log), the process rotates it itself: past DLOCO_LOG_MAX_BYTES (default 64 MiB) the file
becomes NAME.log.1 (NAME.log.1 becomes .2, and so on; past DLOCO_LOG_KEEP, default 4, the oldest
is deleted) and a fresh NAME.log takes stdout, and stderr when it was the same file.  So a
process's logs never take more than (keep + 1) x max bytes of disk, whatever its peers send it;
readers take the segments oldest first (analysis/runinfo.py: `log_segments`).  A pipe or a
terminal (docker's log driver, a shell) is left alone.  DLOCO_LOG_MAX_BYTES=0 turns rotation off.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading

import structlog

MAX_BYTES_ENV, KEEP_ENV = "DLOCO_LOG_MAX_BYTES", "DLOCO_LOG_KEEP"
DEFAULT_MAX_BYTES, DEFAULT_KEEP = 64 << 20, 4


class LogConfigError(ValueError):
    """DLOCO_LOG_MAX_BYTES or DLOCO_LOG_KEEP is not a whole number in range."""


def rotated_name(path: str, index: int) -> str:
    """The name of the index-th older segment of `path` (0: the file being written)."""
    return path if index == 0 else f"{path}.{index}"


class StdoutRotation:
    """Rotates this process's stdout file past `max_bytes` (see the module's text).  `wrote(n)` is
    told what the logger wrote; every `max_bytes // 64` bytes of it (at least 4 KiB) the file's
    real size is read, so that other writers (a traceback on stderr, a summary printed at the end)
    count too."""

    def __init__(self, path: str, max_bytes: int, keep: int) -> None:
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self.check_every = max(4096, max_bytes // 64)
        self.since_check = 0
        self.rotations = 0
        self.lock = threading.Lock()

    @classmethod
    def of_stdout(cls, environ: dict | None = None) -> StdoutRotation | None:
        """The rotation of this process's stdout, or None: stdout is not a regular file with a
        name, or rotation is turned off."""
        max_bytes, keep = rotation_settings(os.environ if environ is None else environ)
        if max_bytes == 0:
            return None
        try:
            if not stat.S_ISREG(os.fstat(1).st_mode):
                return None
            path = os.readlink("/proc/self/fd/1")
        # no /proc (not Linux), or stdout closed
        except OSError:
            return None
        if not os.path.isabs(path) or path.endswith(" (deleted)"):
            return None
        return cls(path, max_bytes, keep)

    def wrote(self, nbytes: int) -> None:
        self.since_check += nbytes
        if self.since_check < self.check_every:
            return
        with self.lock:
            self.since_check = 0
            try:
                if os.fstat(1).st_size >= self.max_bytes:
                    self.rotate()
            # a full disk or a removed folder: keep writing where we are
            except OSError as error:
                print(
                    f"log rotation failed, continuing in {self.path}: {error}",
                    file=sys.stderr,
                    flush=True,
                )

    def rotate(self) -> None:
        """NAME.log -> NAME.log.1 (older ones shift, the oldest past `keep` goes), and fd 1 (and
        fd 2 when it is the same file) onto a fresh NAME.log."""
        sys.stdout.flush()
        sys.stderr.flush()
        same = _same_file(1, 2)
        # the segments there are, up to keep
        older = 0
        while older < self.keep and os.path.exists(rotated_name(self.path, older + 1)):
            older += 1
        # at keep, the oldest is replaced
        for index in range(min(older, self.keep - 1), -1, -1):
            os.replace(rotated_name(self.path, index), rotated_name(self.path, index + 1))
        fresh = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(fresh, 1)
            if same:
                os.dup2(fresh, 2)
        finally:
            os.close(fresh)
        self.rotations += 1


def _same_file(a: int, b: int) -> bool:
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def rotation_settings(environ) -> tuple[int, int]:
    """(max bytes, segments kept) from the environment; max 0 means no rotation."""
    values = []
    for name, default, low in ((MAX_BYTES_ENV, DEFAULT_MAX_BYTES, 0), (KEEP_ENV, DEFAULT_KEEP, 1)):
        text = environ.get(name, "")
        try:
            value = int(text) if text.strip() else default
        except ValueError:
            raise LogConfigError(f"{name} must be a whole number, got {text!r}") from None
        if value < low:
            raise LogConfigError(f"{name} must be >= {low}, got {value}")
        values.append(value)
    return values[0], values[1]


_rotation: StdoutRotation | None = None
_rotation_checked = False


class _RotatingPrintLogger(structlog.PrintLogger):
    """structlog's PrintLogger on stdout, telling the rotation what it wrote."""

    def msg(self, message: str) -> None:
        super().msg(message)
        if _rotation is not None:
            _rotation.wrote(len(message) + 1)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def configure_logging(
    role: str, level: str = "info", **context: str
) -> structlog.stdlib.BoundLogger:
    global _rotation, _rotation_checked
    # once per process, however many times it configures its logs
    if not _rotation_checked:
        try:
            _rotation, _rotation_checked = StdoutRotation.of_stdout(), True
        except LogConfigError as error:
            print(f"dloco {role}: {error}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    renderer = (
        structlog.dev.ConsoleRenderer()
        if sys.stdout.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=lambda *args: _RotatingPrintLogger(),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, **context)
    return structlog.get_logger()
