"""Broker, merger and an island as real processes, CURVE on every socket: training flows through
the broker and is folded; an island whose key is not allowed cannot even join."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dloco.bus.keys import create_keys, write_allow_list
from tests.merger_process_helpers import free_port
from tests.test_broker import BrokerProcess

TINY = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch",
    "8",
    "--seed",
    "0",
]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dloco", *args]


# a broker, a merger and two training islands over CURVE: -m e2e
# Over 60 lines: one secure run in its order: keys, broker, merger, an allowed island and a
# stranger, then what each process logged.
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_training_through_a_curve_broker(tmp_path):
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["broker", "merger", "island-0", "stranger"])
    write_allow_list(keys, allow, {"merger": ["merger"], "island": ["island-0"]})
    init = tmp_path / "init.npz"
    subprocess.run(
        cli("island", "--write-init", str(init), *TINY),
        check=True,
        capture_output=True,
        timeout=120,
    )
    broker = BrokerProcess(tmp_path, "--keys", str(keys), "--allow", str(allow))
    control = free_port()
    merger = subprocess.Popen(
        cli(
            "merger",
            "--run-dir",
            str(tmp_path / "m"),
            "--init-npz",
            str(init),
            "--fragments",
            "2",
            "--delta-endpoint",
            broker.endpoint(1),
            "--snapshot-endpoint",
            broker.endpoint(2),
            "--control-endpoint",
            f"@tcp://127.0.0.1:{control}",
            "--keys",
            str(keys),
            "--allow",
            str(allow),
        ),
        stdout=open(tmp_path / "merger.log", "wb"),
        stderr=subprocess.STDOUT,
    )

    def island(name: str, join_timeout: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            cli(
                "island",
                "--name",
                name,
                *TINY,
                "--max-steps",
                "40",
                "--eval-every",
                "40",
                "--fragments",
                "2",
                "--interval",
                "10",
                "--delta-endpoint",
                broker.endpoint(0),
                "--snapshot-endpoint",
                broker.endpoint(3),
                "--control-endpoint",
                f"tcp://127.0.0.1:{control}",
                "--keys",
                str(keys),
                "--join-timeout",
                join_timeout,
            ),
            capture_output=True,
            text=True,
            timeout=200,
        )

    try:
        good = island("island-0", "60")
        bad = island("stranger", "5")
    # stop everything first, judge afterwards: nothing may outlive the test
    finally:
        merger.terminate()
        merger_code = merger.wait(timeout=30)
        broker_code = broker.stop()
    assert merger_code == 0 and broker_code == 0
    assert good.returncode == 0, good.stderr[-2000:]
    summary = json.loads(good.stdout.strip().splitlines()[-1])
    assert summary["deltas_sent"] >= 6 and summary["acks"].get("folded", 0) >= 3, summary
    # it reached the hub (no "could not reach"), which refused its handshakes, and says so
    assert bad.returncode == 2 and "no snapshot of fragments" in bad.stderr, bad.stderr
    assert "refused its handshake" in bad.stderr and "allow-list" in bad.stderr, bad.stderr
    # the stranger was turned away at the broker
    assert broker.events("broker_stopped")[-1]["auth_refused"] >= 1
