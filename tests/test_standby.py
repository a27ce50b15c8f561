"""A hot-standby merger, as real processes on loopback: a broker, a primary and its standby, and a
test-side island speaking the stream protocol through the broker.  The primary is killed with its
disk, paused past its lease, or loses its standby; every test is bounded by work (deltas settled,
events logged), never by a wall-clock figure.  (A standby under `dloco up`:
tests/test_standby_cluster.py.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dloco import protocol
from dloco.benchmarks.failover import StreamIsland
from dloco.cluster.ports import free_ports
from dloco.merger.log import records
from dloco.merger.log.segments import read_records
from dloco.merger.state.recovery import wal_dir
from tests.merger_helpers import delta_chunks, initial_params
from tests.test_broker import BrokerProcess

# the default: a primary starved of CPU for longer than this on a busy machine would lose its lease
LEASE_S = 3.0
# a generous bound on any one wait: it only ends a broken test
WAIT_S = 90.0
PARAMS = initial_params()
PARTS = protocol.partition({p: a.shape for p, a in PARAMS.items()}, 2)


def _chunks(delta_id: int, versions: dict[int, int]) -> list[protocol.DeltaChunk]:
    fragment = delta_id % 2
    return delta_chunks(
        PARTS[fragment], "a", delta_id, fragment, versions.get(fragment, 0), seed=delta_id
    )


@dataclasses.dataclass
class Merger:
    run_dir: Path
    args: list[str]
    process: subprocess.Popen | None = None
    # this life's log file: logs/<name>.<life>.log
    life: int = 0

    def start(self) -> None:
        self.life += 1
        self.process = subprocess.Popen(
            self.args, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT
        )

    @property
    def log_path(self) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}.{self.life}.log"

    def events(self, name: str | None = None) -> list[dict]:
        """This life's log events (named `name`)."""
        lines = self.log_path.read_text().splitlines() if self.log_path.exists() else []
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if name is None or event.get("event") == name:
                out.append(event)
        return out

    def wait_for(self, name: str, count: int = 1, **fields) -> dict:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = [e for e in self.events(name) if all(e.get(k) == v for k, v in fields.items())]
            if len(found) >= count:
                return found[count - 1]
            assert self.process.poll() is None, (
                f"{self.run_dir.name} exited {self.process.returncode} waiting for {name}"
            )
            time.sleep(0.05)
        raise TimeoutError(f"{self.run_dir.name}: no {name} {fields} within {WAIT_S} s")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        """At a test's end: kill -9 this life, if it still runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def merger_command(broker: BrokerProcess, mode: str) -> list[str]:
    """The command line both mergers of a pair share: the broker's buses, a checkpoint every
    3 records, fsync always, a lease of LEASE_S and replication `mode`."""
    return [
        sys.executable,
        "-m",
        "dloco",
        "merger",
        "--fragments",
        "2",
        "--delta-endpoint",
        broker.endpoint(1),
        "--snapshot-endpoint",
        broker.endpoint(2),
        "--checkpoint-every",
        "3",
        "--fsync",
        "always",
        "--max-staleness",
        "3",
        "--insecure",
        "--lease",
        str(LEASE_S),
        "--replication",
        mode,
    ]


class Pair:
    """A broker, merger A (the primary at start) and B (its standby), each with its control socket
    and replication endpoint on loopback."""

    def __init__(self, tmp: Path, init_npz: Path, mode: str = "sync") -> None:
        self.broker = BrokerProcess(tmp, "--insecure")
        control, replication, (self.metrics_port,) = free_ports(2), free_ports(2), free_ports(1)
        self.control = [f"tcp://127.0.0.1:{port}" for port in control]
        common = merger_command(self.broker, mode)
        ends = [f"tcp://127.0.0.1:{port}" for port in replication]
        self.a = Merger(
            tmp / "a",
            [
                *common,
                "--run-dir",
                str(tmp / "a"),
                "--control-endpoint",
                f"@{self.control[0]}",
                "--replication-endpoint",
                f"@{ends[0]}",
                "--peer",
                ends[1],
                "--init-npz",
                str(init_npz),
                "--metrics-port",
                str(self.metrics_port),
            ],
        )
        self.b = Merger(
            tmp / "b",
            [
                *common,
                "--run-dir",
                str(tmp / "b"),
                "--control-endpoint",
                f"@{self.control[1]}",
                "--replication-endpoint",
                f"@{ends[1]}",
                "--standby-of",
                ends[0],
            ],
        )
        self.a.start()
        self.b.start()
        self.island = StreamIsland(
            self.broker.endpoint(0), self.broker.endpoint(3), self.control, _chunks
        )

    def close(self) -> None:
        self.island.close()
        for merger in (self.a, self.b):
            merger.kill()
        self.broker.stop()


@pytest.fixture
def pair(tmp_path, init_npz):
    made = []
    yield lambda mode="sync": made.append(Pair(tmp_path, init_npz, mode)) or made[-1]
    for p in made:
        p.close()


def settle(island: StreamIsland, deltas) -> None:
    for delta_id in deltas:
        assert island.send_until_settled(delta_id).status == "folded"


def logged_deltas(run_dir: Path) -> set[int]:
    return {
        r["delta_id"]
        for _, r in read_records(wal_dir(run_dir))
        if r["type"] == records.DELTA and r["island"] == "a"
    }


def replay_verify(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", "replay", str(run_dir), "--verify"],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_lost_primary_and_disk_the_standby_takes_over_with_every_acknowledged_delta(pair):
    p = pair()
    settle(p.island, range(1, 7))
    acknowledged = set(p.island.settled)
    old_epoch = p.island.settled[6][0]
    p.b.wait_for("following")
    p.a.process.kill()
    p.a.process.wait(timeout=10)
    shutil.rmtree(p.a.run_dir)

    settle(p.island, range(7, 10))
    took = p.b.wait_for("taking_over")
    assert took["epoch"] > old_epoch
    # settled by the new primary
    assert p.island.settled[9][0] == took["epoch"]
    # nothing acknowledged was lost with the primary's disk
    assert acknowledged <= logged_deltas(p.b.run_dir)

    # the old primary, same command, empty disk: it finds its successor and follows it
    p.a.start()
    p.a.wait_for("following")
    assert not p.a.events("genesis")
    p.b.wait_for("replication", state="sync")
    settle(p.island, range(10, 12))
    assert p.b.stop() == 0
    # a standby stopped by SIGTERM; a digest mismatch would have been exit 5
    assert p.a.stop() == 0
    assert logged_deltas(p.a.run_dir) == logged_deltas(p.b.run_dir) == set(range(1, 12))
    for merger in (p.b, p.a):
        result = replay_verify(merger.run_dir)
        assert result.returncode == 0, result.stderr
        assert "MISMATCH" not in result.stdout


def acks_in_epoch_order(island: StreamIsland) -> bool:
    """Once an epoch has been seen, no ack of an older one reached the island."""
    newest = 0
    for epoch, _ in island.acks:
        if epoch < newest:
            return False
        newest = epoch
    return True


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_primary_paused_past_its_lease_is_fenced_and_steps_down(pair):
    p = pair()
    settle(p.island, range(1, 5))
    p.a.wait_for("replication", state="sync")
    # a partition, as the standby sees it: no lease
    p.a.process.send_signal(signal.SIGSTOP)
    try:
        took = p.b.wait_for("taking_over")
        # the new primary settles what the island sends meanwhile
        settle(p.island, range(5, 7))
    finally:
        p.a.process.send_signal(signal.SIGCONT)
    p.a.wait_for("fenced")
    p.a.wait_for("stepped_down")
    # its first life's probe, then the follow after stepping down
    p.a.wait_for("following", count=2)
    p.b.wait_for("replication", state="sync")
    settle(p.island, range(7, 9))
    assert acks_in_epoch_order(p.island)
    assert all(p.island.settled[d][0] == took["epoch"] for d in range(5, 9))
    assert p.b.stop() == 0 and p.a.stop() == 0
    assert logged_deltas(p.a.run_dir) == logged_deltas(p.b.run_dir) == set(range(1, 9))
    for merger in (p.b, p.a):
        assert replay_verify(merger.run_dir).returncode == 0


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sigterm_ends_a_merger_in_every_role_as_soon_as_it_starts(pair):
    """SIGTERM the moment each role is reached, while its fold kernels may still be compiling in the
    background: the standby once it follows, the primary once it has its state.  Each logs its stop
    and exits 0 (a warm-up stops after the compilation under way: exiting during one aborts the
    process, and waiting for them all kept a merger for seconds)."""
    p = pair()
    p.b.wait_for("following")
    assert p.b.stop() == 0
    assert p.b.events("stopped")
    p.a.wait_for("genesis")
    assert p.a.stop() == 0
    assert p.a.events("stopped")


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_primary_whose_standby_dies_goes_on_alone_and_says_so(pair):
    p = pair()
    settle(p.island, range(1, 3))
    p.a.wait_for("replication", state="sync")
    p.b.process.kill()
    p.b.process.wait(timeout=10)
    settle(p.island, range(3, 7))
    p.a.wait_for("replication", state="alone")
    # the same primary all along
    assert len({epoch for epoch, _ in p.island.acks}) == 1
    metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    assert (
        'dloco_merger_replication{state="alone"} 1.0' in metrics
        and 'dloco_merger_role{role="primary"} 1.0' in metrics
    )
    # back: it follows from where its log ends and the primary is in sync again
    p.b.start()
    p.a.wait_for("replication", state="sync", count=2)
    assert p.island.send_until_settled(7).status == "folded"
    assert p.a.stop() == 0
    # its primary gone, the standby takes over: stop it too
    assert p.b.wait_for("taking_over")
    assert p.b.stop() == 0
    assert logged_deltas(p.b.run_dir) == logged_deltas(p.a.run_dir) == set(range(1, 8))
