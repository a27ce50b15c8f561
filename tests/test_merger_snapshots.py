"""A diff-sending merger process on loopback: a receiver that follows PROTOCOL.md §3.3 holds
exactly what the merger serves, through a kill -9 and restart, and with snapshots held for
rounds."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.island.snapshots import ASK_AGAIN_S
from dloco.protocol import downlink
from tests.merger_process_helpers import Island, start_merger, stop


class SnapshotWatcher:
    """Test-side receiver of a diff-sending merger: follows PROTOCOL.md §3.3 with the protocol's
    own functions (bus and catch-up replies reassembled apart; a diff that does not apply: ask)."""

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

    def join(self, fragments: int) -> None:
        """Ask for every fragment and take each reply before anything folds: a reply still in
        flight then could carry a version the bus's next diff is for, which would arrive old (the
        start-up full snapshots on the bus may already hold every fragment)."""
        mark = len(self.seen)
        self.ask()
        self.pump(lambda: self.replied_since(mark) >= set(range(fragments)), ask_again=fragments)

    def replied_since(self, mark: int) -> set[int]:
        return {f for source, f, *_ in self.seen[mark:] if source == "reply"}

    def pump(self, until, timeout_s: float = 20.0, ask_again: int = 0) -> None:
        """Take what arrives until `until()`.  `ask_again`: the first fragments, asked for again
        every ASK_AGAIN_S while unanswered, as an island does (the merger refuses replies beyond
        a peer's budget, and drops them when the peer's queue is full)."""
        deadline = time.monotonic() + timeout_s
        mark, asked = len(self.seen), time.monotonic()
        while not until():
            assert time.monotonic() < deadline, f"timed out; seen {self.seen[-6:]}"
            if ask_again and time.monotonic() - asked > ASK_AGAIN_S:
                self.ask(sorted(set(range(ask_again)) - self.replied_since(mark)))
                asked = time.monotonic()
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
                    head.served,
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


# Over 60 lines: one scenario in its order: diffs followed, kill -9 and a restart, diffs followed
# again, each phase checked against a catch-up reply.
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
        watcher.join(2)
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
@pytest.mark.parametrize("served", ["fp32", "bf16"])
def test_held_snapshots_carry_every_fold_and_the_last_one_goes_out(
    tmp_path, init_npz, processes, islands, served
):
    """--snapshot-every-round 3: after a fragment's first snapshot the next ones wait three of the
    island's intervals, so the bus carries fewer snapshots than folds; each diff applies (no gap,
    no mismatch), the last fold reaches the bus by the clock alone (no delta follows it), and what
    the receiver built equals the merger's catch-up reply bit for bit (bf16: held in bfloat16 at
    both ends)."""
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
            "--served-dtype",
            served,
        )
    )
    try:
        watcher.join(2)
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
        held = {str(v.dtype) for s in watcher.held.values() for v in s.tensors.values()}
        assert held == {"float32" if served == "fp32" else "bfloat16"}
        stop(processes[-1])
        assert "merger/snapshot_held" in (tmp_path / "m.log").read_text()
    finally:
        watcher.close()


def assert_catch_up_matches(watcher: SnapshotWatcher, versions: list[int]) -> None:
    """What the watcher built from the bus equals, bit for bit, a fresh catch-up reply."""
    built, mark = watcher.held, len(watcher.seen)
    # as a receiver that holds nothing: a reply the watcher took before (the same fragment and
    # version) would be a duplicate to its reassembler
    watcher.held, watcher.reassemblers[watcher.dealer] = {}, protocol.Reassembler()
    watcher.ask()
    watcher.pump(lambda: watcher.holds(versions), ask_again=len(versions))
    # replies only, each fragment's value taken whole (a reply to an earlier request, if late, may
    # come first, or old)
    since = watcher.seen[mark:]
    assert {source for source, *_ in since} == {"reply"}, since
    assert {f for _, f, _, outcome in since if outcome == "full"} == set(range(len(versions)))
    assert {outcome for *_, outcome in since} <= {"full", "old"}, since
    for fragment, version in enumerate(versions):
        assert watcher.held[fragment].version == built[fragment].version == version
        assert watcher.held[fragment].digest == built[fragment].digest
        for path, value in built[fragment].tensors.items():
            np.testing.assert_array_equal(watcher.held[fragment].tensors[path], value)
