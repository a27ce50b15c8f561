"""Log rotation (telemetry/logs.py) and the readers that follow it (analysis/runinfo.py): a
process's logs stay within (keep + 1) x max bytes, and nothing still on disk is lost to a reader."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dloco.analysis.runinfo import JsonTail, log_segments, read_events
from dloco.telemetry.logs import LogConfigError, rotation_settings


def test_json_lines_are_read_incrementally(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = JsonTail(path)
    # not there yet
    assert lines.new() == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert lines.new() == [{"step": 1}, {"step": 2}]
    with open(path, "a") as handle:
        handle.write('p": 3}\nnot json\n[1]\n')
    assert lines.new() == [{"step": 3}]
    assert lines.new() == []


def test_segments_are_read_oldest_first(tmp_path):
    path = tmp_path / "m.log"
    assert log_segments(path) == [path] and read_events(path) == []
    (tmp_path / "m.log.2").write_text('{"i": 1}\n')
    (tmp_path / "m.log.1").write_text('{"i": 2}\n{"i": 3}\n')
    assert log_segments(path) == [tmp_path / "m.log.2", tmp_path / "m.log.1", path]
    # the current file not written yet
    assert read_events(path) == [{"i": 1}, {"i": 2}, {"i": 3}]
    path.write_text('{"i": 4}\n{"i": ')
    assert [e["i"] for e in read_events(path)] == [1, 2, 3, 4]
    # past a gap: not a segment of this file
    (tmp_path / "m.log.4").write_text('{"i": 0}\n')
    assert log_segments(path)[0] == tmp_path / "m.log.2"


def test_a_tail_follows_its_file_across_rotations(tmp_path):
    path = tmp_path / "m.log"
    path.write_text('{"i": 1}\n')
    (tmp_path / "m.log.1").write_text('{"i": 0}\n')
    tail = JsonTail(path)
    # the first look takes what was rotated out before it
    assert tail.new() == [{"i": 0}, {"i": 1}]
    with open(path, "a") as handle:
        # half a line, then the writer finishes it and rotates
        handle.write('{"i": 2}\n{"i"')
    assert tail.new() == [{"i": 2}]
    with open(path, "a") as handle:
        handle.write(": 3}\n")
    os.replace(tmp_path / "m.log.1", tmp_path / "m.log.2")
    os.replace(path, tmp_path / "m.log.1")
    # between the rename and the new file
    assert tail.new() == []
    path.write_text('{"i": 4}\n')
    # the rest of the old file, then the new one
    assert tail.new() == [{"i": 3}, {"i": 4}]
    assert tail.new() == []


def test_rotation_settings_are_checked():
    assert rotation_settings({}) == (64 << 20, 4)
    assert rotation_settings({"DLOCO_LOG_MAX_BYTES": "0"}) == (0, 4)
    assert rotation_settings({"DLOCO_LOG_MAX_BYTES": "1000", "DLOCO_LOG_KEEP": "2"}) == (1000, 2)
    for bad in (
        {"DLOCO_LOG_MAX_BYTES": "64M"},
        {"DLOCO_LOG_MAX_BYTES": "-1"},
        {"DLOCO_LOG_KEEP": "0"},
    ):
        with pytest.raises(LogConfigError, match="DLOCO_LOG_"):
            rotation_settings(bad)


WRITER = """
import sys
from dloco.telemetry.logs import configure_logging
log = configure_logging("test", name="writer")
for i in range(int(sys.argv[1])):
    log.info("line", i=i, pad="x" * 80)
print("the last words, on stderr", file=sys.stderr)
"""
MAX_BYTES, KEEP = 20_000, 2


def _write(tmp_path, lines: int, **env: str) -> subprocess.CompletedProcess:
    with open(tmp_path / "writer.log", "ab") as log:
        return subprocess.run(
            [sys.executable, "-c", WRITER, str(lines)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=120,
            env={
                **os.environ,
                "DLOCO_LOG_MAX_BYTES": str(MAX_BYTES),
                "DLOCO_LOG_KEEP": str(KEEP),
                **env,
            },
        )


def test_a_process_rotates_its_own_log_file_and_keeps_it_bounded(tmp_path):
    # about 440 kB of lines: 22 times the limit
    assert _write(tmp_path, 3000).returncode == 0
    path = tmp_path / "writer.log"
    segments = log_segments(path)
    assert [p.name for p in segments] == ["writer.log.2", "writer.log.1", "writer.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "writer.log",
        "writer.log.1",
        "writer.log.2",
    ]
    # Each segment stops within one size check (max/64, at least 4 KiB) and a line of the limit.
    assert all(p.stat().st_size <= MAX_BYTES + 4096 + 200 for p in segments), [
        p.stat().st_size for p in segments
    ]
    kept = [e["i"] for e in read_events(path) if e.get("event") == "line"]
    assert (
        kept == list(range(kept[0], 3000)) and kept[0] > 0
        # the newest lines, none missing, in order
    )
    assert path.read_text().endswith(
        "the last words, on stderr\n"
        # stderr followed stdout to the new file
    )


def test_rotation_is_off_at_zero_and_bad_settings_are_refused(tmp_path):
    assert _write(tmp_path, 300, DLOCO_LOG_MAX_BYTES="0").returncode == 0
    assert log_segments(tmp_path / "writer.log") == [tmp_path / "writer.log"]
    bad = _write(tmp_path, 1, DLOCO_LOG_KEEP="many")
    assert (
        bad.returncode == 2
        and "DLOCO_LOG_KEEP must be a whole number" in (tmp_path / "writer.log").read_text()
    )
