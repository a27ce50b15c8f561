"""A standby per merger shard, as real processes on loopback: a broker, shard 0 alone, shard 1 with
a hot standby, and an island's two streams (one per shard) from the test.  Shard 1's primary is
killed with its disk; its standby takes over its fragments only, and shard 0 folds on untouched.
Bounded by work (deltas settled, events logged), never by a wall-clock figure."""

from __future__ import annotations

import shutil
import time

import pytest

from dloco.benchmarks.failover import StreamIsland
from dloco.cluster.ports import free_ports
from dloco.merger.log.segments import read_records
from dloco.merger.roles import EXIT_REFUSED
from dloco.merger.state.recovery import genesis_record, wal_dir
from tests.merger_helpers import delta_chunks
from tests.test_broker import BrokerProcess
from tests.test_standby import (
    PARTS,
    WAIT_S,
    Merger,
    logged_deltas,
    merger_command,
    replay_verify,
    settle,
)


def _chunks(fragment: int):
    def chunks(delta_id: int, versions: dict[int, int]):
        return delta_chunks(
            PARTS[fragment], "a", delta_id, fragment, versions.get(fragment, 0), seed=delta_id
        )

    return chunks


class ShardedPair:
    """Shard 0/2 alone; shard 1/2 as A (the primary at start) and B (its standby); the island "a"
    with a stream to each shard (stream 1 dials both A and B, as "A,B" does)."""

    def __init__(self, tmp, init_npz) -> None:
        self.broker = BrokerProcess(tmp, "--insecure")
        control = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
        ends = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
        common = merger_command(self.broker, "sync")

        def shard(name: str, index: int, control_at: str, *more: str) -> Merger:
            run_dir = tmp / name
            flags = ["--run-dir", str(run_dir), "--control-endpoint", f"@{control_at}"]
            # shard 0 has no standby: no --replication
            base = common if index else common[: common.index("--replication")]
            return Merger(run_dir, [*base, "--shard", f"{index}/2", *flags, *more])

        init = ("--init-npz", str(init_npz))
        self.zero = shard("zero", 0, control[0], *init)
        self.a = shard(
            "a", 1, control[1], *init, "--replication-endpoint", f"@{ends[0]}", "--peer", ends[1]
        )
        self.b = shard(
            "b", 1, control[2], "--replication-endpoint", f"@{ends[1]}", "--standby-of", ends[0]
        )
        self.mergers = (self.zero, self.a, self.b)
        for merger in self.mergers:
            merger.start()
        out, back = self.broker.endpoint(0), self.broker.endpoint(3)
        self.streams = [
            StreamIsland(out, back, [control[0]], _chunks(0), stream=0),
            StreamIsland(out, back, control[1:], _chunks(1), stream=1),
        ]

    def close(self) -> None:
        for island in self.streams:
            island.close()
        for merger in self.mergers:
            merger.kill()
        self.broker.stop()


@pytest.fixture
def sharded(tmp_path, init_npz):
    made = ShardedPair(tmp_path, init_npz)
    yield made
    made.close()


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_shards_standby_takes_over_its_fragments_and_the_other_shard_folds_on(sharded):
    p = sharded
    zero, one = p.streams
    settle(zero, range(1, 4))
    settle(one, range(1, 4))
    acknowledged, old_epoch = set(one.settled), one.settled[3][0]
    p.b.wait_for("following")
    # the standby logs what its primary logs: shard 1's fragment, no other
    assert [path for path, _ in genesis_record(p.b.run_dir)["tensors"]] == sorted(PARTS[1])
    p.a.process.kill()
    p.a.process.wait(timeout=10)
    shutil.rmtree(p.a.run_dir)

    settle(one, range(4, 7))
    took = p.b.wait_for("taking_over")
    assert took["epoch"] > old_epoch
    assert one.settled[6][0] == took["epoch"]
    assert acknowledged <= logged_deltas(p.b.run_dir)
    # shard 0 never noticed
    settle(zero, range(4, 7))
    assert {epoch for epoch, _ in zero.settled.values()} == {zero.settled[1][0]}

    # the old primary, same command, empty disk: it follows its successor
    p.a.start()
    p.a.wait_for("following")
    settle(one, range(7, 9))
    for merger in (p.b, p.a, p.zero):
        assert merger.stop() == 0
    assert logged_deltas(p.a.run_dir) == logged_deltas(p.b.run_dir) == set(range(1, 9))
    assert logged_deltas(p.zero.run_dir) == set(range(1, 7))
    for merger in (p.b, p.a, p.zero):
        result = replay_verify(merger.run_dir)
        assert result.returncode == 0, result.stderr
        assert "MISMATCH" not in result.stdout


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_standby_started_as_another_shard_refuses_its_primary(tmp_path, init_npz):
    """Shard 1's primary, a standby given --shard 0/2: it stops, naming both, before it keeps a
    record (EXIT_REFUSED); started again with --shard 1/2 on the same run directory, it follows."""
    broker = BrokerProcess(tmp_path, "--insecure")
    control, ends = free_ports(2), [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    common = merger_command(broker, "sync")
    primary = Merger(
        tmp_path / "a",
        [
            *common,
            *("--shard", "1/2", "--run-dir", str(tmp_path / "a"), "--init-npz", str(init_npz)),
            *("--control-endpoint", f"@tcp://127.0.0.1:{control[0]}"),
            *("--replication-endpoint", f"@{ends[0]}", "--peer", ends[1]),
        ],
    )
    standby = Merger(
        tmp_path / "b",
        [
            *common,
            *("--shard", "0/2", "--run-dir", str(tmp_path / "b")),
            *("--control-endpoint", f"@tcp://127.0.0.1:{control[1]}"),
            *("--replication-endpoint", f"@{ends[1]}", "--standby-of", ends[0]),
        ],
    )
    try:
        primary.start()
        standby.start()
        assert standby.process.wait(timeout=WAIT_S) == EXIT_REFUSED
        (stopped,) = standby.events("standby_stopped")
        assert "holds fragments [1] of 2" in stopped["error"]
        assert "shard 0/2, folds [0]" in stopped["error"]
        # nothing of the other shard's log was kept
        assert not list(read_records(wal_dir(standby.run_dir)))
        assert primary.process.poll() is None
        # given its primary's --shard, the same run directory follows it
        standby.args[standby.args.index("0/2")] = "1/2"
        standby.start()
        standby.wait_for("following")
        deadline = time.monotonic() + WAIT_S
        while not list(read_records(wal_dir(standby.run_dir))):
            assert time.monotonic() < deadline, "the standby kept no record of its primary's log"
            assert standby.process.poll() is None, standby.process.returncode
            time.sleep(0.05)
    finally:
        for merger in (primary, standby):
            merger.kill()
        broker.stop()
