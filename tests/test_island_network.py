"""The island on the network: a real merger and two real islands on loopback exchange and fold; an
island stopped while starting exits cleanly. (Emulated links: tests/test_link_shaping.py; what a
link receives: tests/test_link_receiving.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from dloco.cluster.ports import free_ports
from tests.merger_process_helpers import TINY, start_bound_merger, start_connected_island


# a merger process and two training islands: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "downlink",
    [
        # every fold goes down as an int4 diff (protocol/downlink.py)
        ("--snapshot-diff-codec", "int4"),
        # int8 full snapshots (the cluster profile's), diffs held to one per fragment per round
        (
            "--snapshot-diff-codec",
            "int4",
            "--snapshot-codec",
            "int8",
            "--snapshot-every-round",
            "1",
            "--max-staleness",
            "8",
        ),
    ],
    ids=["every-fold", "held-int8-join"],
)
def test_merger_and_two_islands_exchange_and_fold(tmp_path, downlink):
    init = tmp_path / "init.npz"
    subprocess.run(
        [sys.executable, "-m", "dloco", "island", "--write-init", str(init), *TINY],
        check=True,
        capture_output=True,
        timeout=120,
    )
    ports = free_ports(3)
    # Each island trains its 120 steps in a few seconds: the first folds' wait for a second island
    # (round.cold_wait_s) could outlast one island's whole run while the other is still starting.
    merger = start_bound_merger(tmp_path, init, ports, *downlink, "--cold-wait", "0")
    islands = []
    try:
        run = ["--max-steps", "120", "--eval-every", "60", "--interval", "10"]
        # island 0 flushes its unsent steps on leaving
        islands.append(start_connected_island(tmp_path, 0, ports, *run, "--flush-on-leave"))
        islands.append(start_connected_island(tmp_path, 1, ports, *run))
        summaries = [
            json.loads(p.communicate(timeout=180)[0].decode().strip().splitlines()[-1])
            for p in islands
        ]
    finally:
        for p in [*islands, merger]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    for summary in summaries:
        assert (
            summary["deltas_sent"] >= 10
            and summary["acks"].get("folded", 0) == summary["deltas_sent"]
        ), summary
        # every diff applied to exactly the value the merger served: a different byte anywhere is a
        # mismatch
        assert (
            summary["snapshots"].get("diff", 0) >= 10
            and summary["snapshots"].get("mismatch", 0) == 0
        ), summary
    folds = [json.loads(line) for line in open(tmp_path / "merger.log") if '"fold"' in line]
    assert {name for fold in folds for name in fold["contributors"]} == {"isl-0", "isl-1"}
    # stopping after step 120, fragment 0 (sent at 5, 15, ..., 115) has 5 unsent steps: with
    # --flush-on-leave (isl-0) they are sent on leaving, and folded; without (isl-1, the default)
    # they stay with the island
    assert summaries[0]["flushed"] == 1 and "flushed" not in summaries[1]
    last = {
        name: steps
        for fold in folds
        if fold["fragment"] == 0
        for name, steps in zip(fold["contributors"], fold["steps"])
    }
    # each island's last delta of fragment 0 (its first, at step 5, has 5 steps too)
    assert last == {"isl-0": 5, "isl-1": 10}
    versions = [
        json.loads(line)["snapshot_version"]
        for line in open(tmp_path / "isl-0.jsonl")
        if '"snapshot_version"' in line
    ]
    # the island adopted fresh global snapshots while training
    assert max(max(v) for v in versions) >= 2


@pytest.mark.timeout(120)
def test_a_stop_while_starting_exits_cleanly(tmp_path):
    """SIGTERM 3 s in (importing JAX, building the model, or waiting for a merger that never
    answers): exit 0, promptly.  (Within the interpreter's own first ~0.3 s no handler exists
    yet.)"""
    ports = free_ports(3)
    island = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "island",
            "--insecure",
            *TINY,
            "--join-timeout",
            "100",
            *[
                arg
                for i, flag in enumerate(
                    ("--delta-endpoint", "--snapshot-endpoint", "--control-endpoint")
                )
                for arg in (flag, f"tcp://127.0.0.1:{ports[i]}")
            ],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(3.0)
    island.terminate()
    assert island.wait(timeout=60) == 0, island.stderr.read()[-2000:]
