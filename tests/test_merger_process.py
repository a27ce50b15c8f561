"""The merger as a real process on loopback: kill -9 at several points (one with a torn log
record), restart, and end with exactly the parameters of an uninterrupted run; replay agrees. A
silent island is marked gone and back. (Diff snapshots: tests/test_merger_snapshots.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dloco import protocol
from dloco.merger.state import checkpoint
from dloco.merger.state.recovery import checkpoint_dir, wal_dir
from tests.merger_process_helpers import Island, start_merger, stop

DELTAS = 12


def final_digest(run_dir: Path) -> str:
    return checkpoint.latest(checkpoint_dir(run_dir))["digest"]


# kill -9 and restart of a merger process, several times: with the other failover checks
# Over 60 lines: one scenario in its order: an uninterrupted run, the same run killed twice (once
# with a torn record) and restarted, then its log replayed intact and corrupted.
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_kill_9_at_several_points_ends_where_an_uninterrupted_run_ends(
    tmp_path, init_npz, processes, islands
):
    def launch(run_dir, island, init):
        processes.append(start_merger(run_dir, island, init))
        return processes[-1]

    straight = tmp_path / "straight"
    islands.append(island := Island(tmp_path))
    process = launch(straight, island, init_npz)
    results = [island.send_until_settled(i, island.chunks(i)) for i in range(1, DELTAS + 1)]
    # a resent settled delta is acked again, not refolded
    assert island.send_until_settled(3, island.sent_frames_of(3)) == results[2]
    stop(process)
    assert {r.status for r in results} == {"folded"}

    crashed = tmp_path / "crashed"
    islands.append(island := Island(tmp_path))
    process = launch(crashed, island, init_npz)
    for i in range(1, 5):
        island.send_until_settled(i, island.chunks(i))
    # kill -9 between deltas
    process.kill()
    process.wait(timeout=10)
    segment = sorted(wal_dir(crashed).glob("*.seg"))[-1]
    with open(segment, "ab") as handle:
        # a record cut off mid-append
        handle.write(b"\x40\x00\x00\x00\x00\x00\x00\x00partial")
    process = launch(crashed, island, None)
    for i in range(5, 9):
        island.send_until_settled(i, island.chunks(i))
    pending = island.chunks(9)
    for _ in range(3):
        for frames in pending:
            island.pub.send_multipart(frames)
    time.sleep(0.05)
    # kill -9 while delta 9 may be mid-flight, mid-log or mid-fold
    process.kill()
    process.wait(timeout=10)
    process = launch(crashed, island, None)
    island.send_until_settled(9, pending)
    for i in range(10, DELTAS + 1):
        island.send_until_settled(i, island.chunks(i))
    stop(process)
    assert final_digest(crashed) == final_digest(straight)

    verify = subprocess.run(
        [sys.executable, "-m", "dloco", "replay", str(crashed), "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.count("fold") == DELTAS and "MISMATCH" not in verify.stdout
    assert final_digest(crashed) in verify.stdout

    segment = sorted(wal_dir(crashed).glob("*.seg"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 3] ^= 0x01
    segment.write_bytes(bytes(data))
    broken = subprocess.run(
        [sys.executable, "-m", "dloco", "replay", str(crashed), "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert broken.returncode == 1 and "log record" in broken.stderr and "corrupt" in broken.stderr


@pytest.mark.timeout(120)
def test_a_silent_island_is_marked_gone_and_back(tmp_path, init_npz, processes, islands):
    islands.append(island := Island(tmp_path))
    processes.append(start_merger(tmp_path / "run", island, init_npz, "--peer-timeout", "1"))
    log = tmp_path / "run.log"

    def heartbeat_until(event: str) -> None:
        deadline = time.monotonic() + 30
        while event not in log.read_text():
            assert time.monotonic() < deadline, f"no {event} in the merger's log"
            if event == "island_back":
                island.pub.send_multipart(
                    protocol.encode(protocol.Heartbeat(sender="a", epoch=1, seq=0))
                )
            time.sleep(0.1)

    # the merger has heard from island "a"
    island.send_until_settled(1, island.chunks(1))
    # then silence for more than 1 s
    heartbeat_until("island_gone")
    # and a heartbeat brings it back
    heartbeat_until("island_back")
    stop(processes[-1])
