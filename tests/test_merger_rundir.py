"""The merger's run directory: one merger at a time (a lock), and a full disk, as real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dloco.merger.state.recovery import wal_dir
from tests.merger_process_helpers import Island, free_port, start_merger, stop


# merger processes on one run directory: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_second_merger_on_a_run_dir_in_use_exits_at_once(tmp_path, init_npz, processes, islands):
    """A second merger on a live merger's run directory exits with code 2, naming the holder's PID,
    before it opens the log; the first keeps folding.  After kill -9 of the first, the lock is gone
    with it and a restart resumes from the log."""
    islands.append(island := Island(tmp_path))
    run = tmp_path / "run"
    processes.append(first := start_merger(run, island, init_npz))
    island.send_until_settled(1, island.chunks(1))
    wal_before = sorted((p.name, p.stat().st_size) for p in wal_dir(run).iterdir())
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "merger",
            "--run-dir",
            str(run),
            "--fragments",
            "2",
            "--insecure",
            "--delta-endpoint",
            "tcp://127.0.0.1:1",
            "--snapshot-endpoint",
            f"@tcp://127.0.0.1:{free_port()}",
            "--control-endpoint",
            f"@tcp://127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        second.returncode == 2 and f"in use by another merger (pid {first.pid}" in second.stderr
    ), second.stderr
    # it did not touch the log
    assert sorted((p.name, p.stat().st_size) for p in wal_dir(run).iterdir()) == wal_before
    assert island.send_until_settled(2, island.chunks(2)).status == "folded"
    first.kill()
    first.wait(timeout=10)
    processes.append(start_merger(run, island, None))
    assert island.send_until_settled(3, island.chunks(3)).status == "folded"
    stop(processes[-1])


# a merger process on a full disk: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_full_disk_stops_the_merger_cleanly_and_a_restart_resumes(
    tmp_path, init_npz, processes, islands
):
    """The run directory on a 128 KiB tmpfs: the merger folds until the disk is full, then stops
    with exit code 3, one error line and no temporary file; with space again it resumes from its
    log.
    """
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], capture_output=True
        ).returncode
    ):
        # CI sets DLOCO_REQUIRE_ROOT (.ci/run): there it must run
        if os.environ.get("DLOCO_REQUIRE_ROOT"):
            pytest.fail("mounting a small tmpfs needs root (DLOCO_REQUIRE_ROOT is set)")
        pytest.skip("mounting a small tmpfs needs root")
    try:
        islands.append(island := Island(tmp_path))
        # its log goes beside the mount, to tmp_path
        processes.append(merger := start_merger(disk, island, init_npz))
        delta_id = 0
        while merger.poll() is None:
            delta_id += 1
            assert delta_id < 2000, "the disk never filled"
            try:
                island.send_until_settled(delta_id, island.chunks(delta_id), deadline_s=10.0)
            except TimeoutError:
                # the merger stopped (the loop ends) or is about to
                pass
        assert merger.wait(timeout=60) == 3
        log = (tmp_path / "disk.log").read_text()
        assert (
            "Traceback" not in log
            and log.count('"storage_failed"') == 1
            and "No space left on device" in log
        ), log[-3000:]
        assert "dloco merger: stopped:" in log and not list(disk.rglob("*.tmp"))
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        processes.append(start_merger(disk, island, None))
        for more in range(delta_id + 1, delta_id + 4):
            assert island.send_until_settled(more, island.chunks(more)).status in (
                "folded",
                "rejected",
            )
        assert (
            island.send_until_settled(delta_id + 4, island.chunks(delta_id + 4)).status == "folded"
        )
        stop(processes[-1])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
