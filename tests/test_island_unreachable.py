"""An island started where the hub cannot be reached (a region host whose firewall or address is
wrong): a real island process pointed at ports nothing listens on says, once the heartbeat timeout
has passed, which endpoints it could not reach, and at its join timeout exits non-zero naming
them.  Nothing is asserted about how long it took."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.merger_process_helpers import TINY, free_port


@pytest.mark.timeout(240)
def test_an_island_that_cannot_reach_the_hub_names_each_endpoint_and_exits_non_zero(tmp_path):
    ports = [free_port() for _ in range(3)]
    endpoints = [f"tcp://127.0.0.1:{port}" for port in ports]
    island = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "island",
            *["--name", "far", *TINY, "--fragments", "2"],
            *["--delta-endpoint", endpoints[0], "--snapshot-endpoint", endpoints[1]],
            *["--control-endpoint", endpoints[2], "--join-timeout", "8", "--insecure"],
            "--metrics-out",
            str(tmp_path / "far.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert island.returncode == 2, island.stderr[-2000:]
    error = island.stderr.strip().splitlines()[-1]
    assert error.startswith("dloco island: could not reach ") and "hub running" in error, error
    for endpoint, socket in zip(endpoints, ("delta-bus", "snapshot-bus", "merger")):
        assert f"{endpoint} ({socket})" in error, error
    warnings = [
        event
        for line in island.stdout.splitlines()
        if line.startswith("{") and (event := json.loads(line)).get("event") == "hub_unreachable"
    ]
    assert len(warnings) == 1 and len(warnings[0]["endpoints"]) == 3, island.stdout[-2000:]
