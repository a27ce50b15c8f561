"""The merger as a real process on loopback: kill -9 at several points (one with a torn log
record), restart, and end with exactly the parameters of an uninterrupted run; replay agrees."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.cluster.ports import free_ports
from dloco.merger import checkpoint
from dloco.merger.recovery import checkpoint_dir, wal_dir
from dloco.protocol import downlink
from tests.merger_helpers import delta_chunks, initial_params

DELTAS = 12
ACK_TIMEOUT_S = 30.0


def free_port() -> int:
    return free_ports(1)[0]


class Island:
    """Test-side island speaking the stream protocol: contiguous seqs, heartbeats, resends on
    request (from an unbounded record of what it sent), and repeats a delta until it is settled."""

    def __init__(self, tmp: Path) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.delta_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.snapshot_port, self.control_port = free_ports(2)
        self.versions = [0, 0]
        self.epoch, self.seq, self.sent, self.by_delta = 1, 0, {}, {}
        self.sub = self.dealer = None

    def connect(self) -> None:
        for socket in (self.sub, self.dealer):
            if socket is not None:
                socket.close(linger=0)
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"ack")
        self.sub.connect(f"tcp://127.0.0.1:{self.snapshot_port}")
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, b"a")
        self.dealer.connect(f"tcp://127.0.0.1:{self.control_port}")

    def frames_of(self, chunks) -> list[list]:
        frames = []
        for chunk in chunks:
            self.seq += 1
            self.sent[self.seq] = protocol.encode(
                dataclasses.replace(chunk, seq=self.seq, epoch=self.epoch)
            )
            frames.append(self.sent[self.seq])
        return frames

    def send_until_settled(
        self, delta_id: int, frames, deadline_s: float = ACK_TIMEOUT_S
    ) -> protocol.DeltaResult:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for f in frames:
                self.pub.send_multipart(f)
            self.pub.send_multipart(
                protocol.encode(protocol.Heartbeat(sender="a", epoch=self.epoch, seq=self.seq))
            )
            until = time.monotonic() + 0.3
            while (left := until - time.monotonic()) > 0:
                events = dict(zmq.Poller.poll(self._poller(), int(left * 1000) + 1))
                if self.dealer in events:
                    request = protocol.decode(self.dealer.recv_multipart())
                    for first, last in request.ranges:
                        for seq in range(first, last + 1):
                            self.dealer.send_multipart(self.sent[seq])
                if self.sub in events:
                    ack = protocol.decode(self.sub.recv_multipart())
                    for result in ack.results:
                        if result.island == "a" and result.delta_id == delta_id:
                            if result.status == "folded":
                                self.versions[result.fragment] = result.version
                            return result
        raise TimeoutError(f"delta {delta_id} was not settled within {deadline_s} s")

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        return poller

    def chunks(self, delta_id: int):
        fragment = delta_id % 2
        self.by_delta[delta_id] = self.frames_of(
            delta_chunks(
                PARTS[fragment], "a", delta_id, fragment, self.versions[fragment], seed=delta_id
            )
        )
        return self.by_delta[delta_id]

    def sent_frames_of(self, delta_id: int):
        return self.by_delta[delta_id]

    def close(self) -> None:
        self.context.destroy(linger=0)


PARAMS = initial_params()
PARTS = protocol.partition({p: a.shape for p, a in PARAMS.items()}, 2)


def start_merger(run_dir: Path, island: Island, init: Path | None, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "dloco",
        "merger",
        "--run-dir",
        str(run_dir),
        "--fragments",
        "2",
        "--delta-endpoint",
        f"tcp://127.0.0.1:{island.delta_port}",
        "--snapshot-endpoint",
        f"@tcp://127.0.0.1:{island.snapshot_port}",
        "--control-endpoint",
        f"@tcp://127.0.0.1:{island.control_port}",
        "--checkpoint-every",
        "3",
        "--fsync",
        "always",
        "--max-staleness",
        "3",
        "--insecure",
        *extra,
    ]
    if init is not None:
        args += ["--init-npz", str(init)]
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    island.connect()
    return process


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def final_digest(run_dir: Path) -> str:
    return checkpoint.latest(checkpoint_dir(run_dir))["digest"]


# kill -9 and restart of a merger process, several times: with the other failover checks
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


class SnapshotWatcher:
    """Test-side receiver of a diff-sending merger: follows PROTOCOL.md §3.3 with the protocol's own
    functions (bus and catch-up replies reassembled apart; a diff that does not apply: ask)."""

    def __init__(self, island: Island) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"snapshot/")
        # before connecting: the event is not missed
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(f"tcp://127.0.0.1:{island.snapshot_port}")
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, b"watcher")
        self.dealer.connect(f"tcp://127.0.0.1:{island.control_port}")
        self.reassemblers = {self.sub: protocol.Reassembler(), self.dealer: protocol.Reassembler()}
        self.held: dict[int, downlink.Served] = {}
        # (bus | reply, fragment, version, outcome)
        self.seen: list[tuple[str, int, int, str]] = []
        # bus snapshots: (fragment, version, base_version)
        self.bases: list[tuple[int, int, int | None]] = []

    def wait_connected(self, timeout_s: float = 60.0) -> None:
        """Until the SUB has connected to the merger's PUB (its subscription then goes out at once).
        The catch-up reply on the DEALER does not show it: the two sockets reconnect on their own
        timers, and a PUB drops what it publishes before a subscriber is there."""
        assert self.monitor.poll(int(timeout_s * 1000)), "the watcher's SUB never connected"
        self.monitor.recv_multipart()

    def ask(self, fragments=()) -> None:
        self.dealer.send_multipart(
            protocol.encode(
                protocol.SnapshotRequest(
                    sender="watcher", epoch=1, seq=0, fragments=tuple(fragments)
                )
            )
        )

    def pump(self, until, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"timed out; seen {self.seen[-6:]}"
            for socket in dict(zmq.Poller.poll(self._poller(), 100)):
                chunk = protocol.decode(socket.recv_multipart())
                done = self.reassemblers[socket].add(chunk, time.monotonic())
                if done is None:
                    continue
                head = done.header
                held, outcome = downlink.receive(
                    self.held.get(head.fragment),
                    head.version,
                    head.base_version,
                    head.digest,
                    done.tensors,
                )
                self.seen.append(
                    ("bus" if socket is self.sub else "reply", head.fragment, head.version, outcome)
                )
                if socket is self.sub:
                    self.bases.append((head.fragment, head.version, head.base_version))
                if outcome in downlink.ADOPT:
                    self.held[head.fragment] = held
                elif outcome in downlink.ASK_AGAIN:
                    self.ask([head.fragment])

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        return poller

    def holds(self, versions) -> bool:
        return all(f in self.held and self.held[f].version >= v for f, v in enumerate(versions))

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.mark.timeout(180)
def test_diff_snapshots_track_the_served_value_through_a_restart(
    tmp_path, init_npz, processes, islands
):
    """int4 diffs, every 3rd version in full: a receiver that applies them holds exactly what a
    catch-up reply (fp32) says the merger serves; after kill -9 and a restart (whose start-up full
    snapshots replace a diff-built value at the same version, or are missed and a mismatch makes the
    receiver ask) it again holds exactly what the restarted merger serves."""
    islands.append(island := Island(tmp_path))
    flags = ("--snapshot-diff-codec", "int4", "--snapshot-full-every", "3")
    watcher = SnapshotWatcher(island)
    processes.append(start_merger(tmp_path / "m", island, init_npz, *flags))
    try:
        watcher.ask()
        watcher.pump(lambda: watcher.holds([0, 0]))
        watcher.wait_connected()
        # fragments alternate: fragment 1 to version 4, fragment 0 to 3
        for delta_id in range(1, 8):
            assert island.send_until_settled(delta_id, island.chunks(delta_id)).status == "folded"
        watcher.pump(lambda: watcher.holds([3, 4]))
        bus = [
            (f, v, outcome) for source, f, v, outcome in watcher.seen if source == "bus" and v > 0
        ]
        assert sorted(bus) == sorted(
            [(f, v, "full" if v == 3 else "diff") for f in (0, 1) for v in (1, 2, 3)]
            + [(1, 4, "diff")]
        )
        assert_catch_up_matches(watcher, [3, 4])

        processes[-1].kill()
        processes[-1].wait(timeout=10)
        processes.append(start_merger(tmp_path / "m", island, None, *flags))
        mark, failed, versions, done = len(watcher.seen), [], [3, 4], threading.Event()

        # a SUB re-subscribes after a reconnect only when its thread touches it: keep pumping
        def follow():
            try:
                watcher.pump(lambda: done.is_set() and watcher.holds(versions), timeout_s=150)
            except AssertionError as error:
                failed.append(error)

        def diff_applied_since_restart(fragment: int) -> bool:
            return ("bus", fragment, "diff") in {
                (s, f, outcome) for s, f, _, outcome in watcher.seen[mark:]
            }

        follower = threading.Thread(target=follow)
        follower.start()
        try:
            # Until the SUB has reconnected (which takes as long as the machine's load makes it) the
            # restarted merger's snapshots are missed and the next one is a gap or a mismatch: fold
            # until each fragment has taken a diff again, bounded by a count of folds.
            for delta_id in range(8, 48):
                assert (
                    island.send_until_settled(delta_id, island.chunks(delta_id)).status == "folded"
                )
                versions[delta_id % 2] += 1
                if diff_applied_since_restart(0) and diff_applied_since_restart(1):
                    break
        finally:
            done.set()
            follower.join()
        assert not failed, failed
        assert diff_applied_since_restart(0) and diff_applied_since_restart(1), watcher.seen[mark:]
        assert "missing" not in [outcome for *_, outcome in watcher.seen[mark:]], watcher.seen[
            mark:
        ]
        assert_catch_up_matches(watcher, versions)
    finally:
        watcher.close()


@pytest.mark.timeout(120)
def test_held_snapshots_carry_every_fold_and_the_last_one_goes_out(
    tmp_path, init_npz, processes, islands
):
    """--snapshot-every-round 3: after a fragment's first snapshot the next ones wait three of the
    island's intervals, so the bus carries fewer snapshots than folds; each diff applies (no gap,
    no mismatch), the last fold reaches the bus by the clock alone (no delta follows it), and what
    the receiver built equals the merger's catch-up reply bit for bit."""
    islands.append(island := Island(tmp_path))
    watcher = SnapshotWatcher(island)
    processes.append(
        start_merger(
            tmp_path / "m",
            island,
            init_npz,
            "--snapshot-diff-codec",
            "int4",
            "--snapshot-every-round",
            "3",
        )
    )
    try:
        watcher.ask()
        watcher.pump(lambda: watcher.holds([0, 0]))
        watcher.wait_connected()
        # fragment 1 to version 4, fragment 0 to 3
        for delta_id in range(1, 8):
            assert island.send_until_settled(delta_id, island.chunks(delta_id)).status == "folded"
        watcher.pump(lambda: watcher.holds([3, 4]), timeout_s=30)
        bus = [
            (f, v, outcome) for source, f, v, outcome in watcher.seen if source == "bus" and v > 0
        ]
        # folds were held and went out together
        assert len(bus) < 7, bus
        assert {outcome for *_, outcome in bus} == {"diff"}, bus
        assert (0, 3, "diff") in bus and (1, 4, "diff") in bus
        # a diff over several folds
        assert any(base is not None and base < version - 1 for _, version, base in watcher.bases), (
            watcher.bases
        )
        assert_catch_up_matches(watcher, [3, 4])
        stop(processes[-1])
        assert "merger/snapshot_held" in (tmp_path / "m.log").read_text()
    finally:
        watcher.close()


def assert_catch_up_matches(watcher: SnapshotWatcher, versions: list[int]) -> None:
    """What the watcher built from the bus equals, bit for bit, a fresh catch-up reply."""
    built, mark = watcher.held, len(watcher.seen)
    watcher.held = {}
    watcher.ask()
    watcher.pump(lambda: watcher.holds(versions))
    assert [(source, outcome) for source, *_, outcome in watcher.seen[mark:]] == [
        ("reply", "full")
    ] * len(versions)
    for fragment, version in enumerate(versions):
        assert watcher.held[fragment].version == built[fragment].version == version
        assert watcher.held[fragment].digest == built[fragment].digest
        for path, value in built[fragment].tensors.items():
            np.testing.assert_array_equal(watcher.held[fragment].tensors[path], value)
