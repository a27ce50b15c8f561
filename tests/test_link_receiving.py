"""What a real NetworkLink does with what it receives: acks that settle deltas without a fold,
counted per fragment, and diff snapshots applied in order, asking for what cannot be applied."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.cluster.ports import free_ports
from dloco.island.config import SyncConfig
from dloco.island.network import NetworkLink
from dloco.protocol import downlink
from tests.merger_process_helpers import free_port
from tests.test_downlink import F32, snapshot_frames


@pytest.mark.timeout(60)
def test_a_delta_settled_without_a_fold_is_counted_per_fragment():
    """A blocking island waits for the fold of what it sent; a rejection must end that wait."""
    link = NetworkLink(
        "isl",
        "m",
        SyncConfig(fragments=2, interval=2),
        *(f"tcp://127.0.0.1:{p}" for p in free_ports(3)),
    )
    try:
        # _on_frames is the receiver thread's: it may run once that thread has its links
        _wait(lambda: getattr(link, "_mergers", None) is not None)

        def ack(seq, *results):
            message = protocol.Ack(
                sender="merger",
                epoch=1,
                seq=seq,
                cursors=(),
                results=tuple(
                    protocol.DeltaResult(
                        "isl", link.epoch, d, f, status, 3, "" if status == "folded" else "stale"
                    )
                    for d, f, status in results
                ),
            )
            # as the receiver thread would
            link._on_frames(
                [memoryview(f) for f in protocol.encode(message)], protocol.Reassembler()
            )

        ack(1, (1, 0, "folded"), (2, 1, "rejected"))
        # delta 2 again: counted once
        ack(2, (2, 1, "rejected"), (3, 1, "rejected"), (4, 0, "rejected"))
        assert (
            link.unfolded == {1: 2, 0: 1}
            and link.results["folded"] == 1
            and link.results["rejected"] == 3
        )
    finally:
        link.close()


# Over 60 lines: one scenario in its order: the start-up request, a diff before its base, the base,
# a mismatch, asking again, the catch-up reply beside a half bus snapshot, an old epoch's.
@pytest.mark.timeout(60)
def test_an_island_applies_diffs_in_order_and_asks_for_what_it_cannot_apply():
    """A real NetworkLink; the test binds the snapshot bus (XPUB) and a ROUTER standing in for the
    merger's.  A diff that came before its base waits for it; a diff that does not apply is not
    adopted and the island asks for the fragment's value, again every `ask_again_s` until it holds
    one that new; the catch-up reply (fp32) completes even while a bus snapshot of the same version
    (bf16) sits half-assembled; a delayed snapshot of the merger's previous incarnation is ignored.
    """
    context = zmq.Context()
    bus, router = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)
    snapshot, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    bus.bind(snapshot)
    router.bind(control)
    link = NetworkLink(
        "isl",
        "m",
        SyncConfig(fragments=1, interval=1),
        f"tcp://127.0.0.1:{free_port()}",
        snapshot,
        control,
    )
    link.downlink.ask_again_s = 2.0
    try:
        # the start-up request: all
        assert router.poll(5000) and protocol.decode(router.recv_multipart()[1:]).fragments == ()
        subscribed = set()
        while subscribed != {b"\x01snapshot/", b"\x01ack"}:
            assert bus.poll(5000), "the island never subscribed"
            subscribed.add(bus.recv())
        # past the start-up request's cover
        time.sleep(link.downlink.ask_again_s + 0.05)

        fp32, bf16, w = (
            protocol.Codec("fp32"),
            protocol.Codec("bf16"),
            lambda value: {"w": np.full(64, value, F32)},
        )
        v3, plans3 = downlink.full(w(1.0), 3, fp32, 64)
        v4, plans4 = downlink.diff(w(2.0), v3, 4, fp32, 64)
        v5, plans5 = downlink.diff(w(3.0), v4, 5, fp32, 64)
        v6, plans6 = downlink.diff(w(4.0), v5, 6, fp32, 64)

        def send(
            plans, version, base=None, digest=None, seq=1, codec=fp32, epoch=1, chunks=slice(None)
        ):
            for frames in snapshot_frames(
                plans, version, codec, base=base, digest=digest, seq=seq, epoch=epoch
            )[chunks]:
                bus.send_multipart(frames)

        send(plans3, 3, digest=v3.digest)
        # before its base
        send(plans5, 5, base=4, digest=v5.digest, seq=10)
        assert [r.fragments for r in _requests(router, 1)] == [(0,)]
        # the base: both apply now
        send(plans4, 4, base=3, digest=v4.digest, seq=20)
        # a digest that does not match: refused
        send(plans6, 6, base=5, digest=v6.digest ^ 1, seq=30)
        _wait(lambda: link.downlink_results["mismatch"] == 1)
        # no second ask within 2 s
        assert dict(link.downlink_results) == {
            "full": 1,
            "gap": 1,
            "diff": 2,
            "mismatch": 1,
            "asked": 1,
        }
        asked = time.monotonic()
        # asked again with nothing new arriving
        assert [r.fragments for r in _requests(router, 1)] == [(0,)]
        assert time.monotonic() - asked > 1.0

        answer, answer_plans = downlink.full(w(5.0), 6, bf16, 64)
        # a bus snapshot's last chunk only
        send(answer_plans, 6, digest=answer.digest, seq=40, codec=bf16, chunks=slice(-1, None))
        exact, exact_plans = downlink.full(answer.tensors, 6, fp32, 64)
        # the reply: fp32, same version
        for frames in snapshot_frames(exact_plans, 6, fp32, digest=exact.digest, seq=40):
            router.send_multipart([b"isl", *frames])
        _wait(lambda: link.downlink_results["full"] == 2)
        # the previous merger's, delayed
        send(plans3, 7, digest=v3.digest, seq=1, epoch=0)
        _wait(lambda: link.downlink_results["old_epoch"] == 1)
        got = link.snapshots()
        assert [(f, v) for f, v, _ in got] == [(0, 3), (0, 4), (0, 5), (0, 6)]
        for (_, _, tensors), value in zip(got, (1.0, 2.0, 3.0, 5.0)):
            np.testing.assert_array_equal(tensors["w"], np.full(64, value, F32))
        time.sleep(link.downlink.ask_again_s + 0.2)
        # it holds version 6: no more asking
        assert link.downlink_results["asked"] == 2 and not router.poll(0)
    finally:
        link.close()
        bus.close(linger=0)
        router.close(linger=0)
        context.term()


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _requests(router: zmq.Socket, count: int) -> list[protocol.SnapshotRequest]:
    out = []
    while len(out) < count:
        assert router.poll(5000), "no snapshot request arrived"
        out.append(protocol.decode(router.recv_multipart()[1:]))
    return out
