"""An island's links to a merger and its standby ("A,B", island/mergers.py) on loopback: requests go
to whichever merger has bound its control socket, follow a takeover, wait while neither is up,
and the links' changes reach the island's link watcher.  A merger that goes while a multipart
reply is half read must not take the island down (libzmq aborts a ZMQ_IMMEDIATE DEALER then).
Bounded by messages, never by a wall-clock figure."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import zmq

from dloco.bus.monitor import LinkWatcher
from dloco.bus.security import Security
from dloco.cluster.ports import free_ports
from dloco.island.mergers import MergerLinks

# a generous bound on any one wait: it only ends a broken test
WAIT_S = 60.0


def _router(context: zmq.Context, port: int) -> zmq.Socket:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    return router


def _delivered(links: MergerLinks, router: zmq.Socket, body: bytes) -> bool:
    """Send `body` to shard 0 until it is taken, then: did `router` get it?"""
    deadline = time.monotonic() + WAIT_S
    while not links.send([body], 0):
        assert time.monotonic() < deadline, "no merger of the pair came up"
        time.sleep(0.01)
    if not router.poll(int(WAIT_S * 1000)):
        return False
    identity, got = router.recv_multipart()
    return identity == b"isl" and got == body


@pytest.mark.timeout(120)
def test_requests_go_to_the_merger_that_is_up_and_follow_a_takeover():
    context, reports = zmq.Context(), []
    watcher = LinkWatcher(lambda event, label, endpoint: reports.append((event, label)))
    a_port, b_port = free_ports(2)
    a = _router(context, a_port)
    links = MergerLinks(
        context,
        [f"tcp://127.0.0.1:{a_port},tcp://127.0.0.1:{b_port}"],
        Security(None, "isl"),
        "merger",
        "isl",
        links=watcher,
    )
    try:
        assert len(links.dealers) == 2 and links.count == 1
        assert _delivered(links, a, b"one")
        # the primary goes: nothing is taken until the standby binds
        a.close(linger=0)
        deadline = time.monotonic() + WAIT_S
        while links.send([b"lost"], 0):
            assert time.monotonic() < deadline, "sends still taken with no merger up"
            time.sleep(0.01)
        deferred = links.deferred
        assert not links.send([b"lost"], 0) and links.deferred == deferred + 1
        b = _router(context, b_port)
        # the first message the standby gets: nothing sent while neither merger was up
        assert _delivered(links, b, b"two")
        assert _delivered(links, b, b"three")
        links.refresh()
        assert [event for event, label in reports if label == "merger"] == [
            "link_up",
            "link_down",
            "link_up",
        ]
        b.close(linger=0)
    finally:
        links.close()
        watcher.stop()
        context.destroy(linger=0)


def _island(port: int, standby_port: int, ready, taken) -> None:
    """A child process: the links read multipart replies until their merger has gone."""
    context = zmq.Context()
    links = MergerLinks(
        context,
        [f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{standby_port}"],
        Security(None, "isl"),
        "merger",
        "isl",
    )
    while not links.send([b"hello"], 0):
        time.sleep(0.01)
    ready.set()
    dealer, pair, count = links.dealers[0], links.shards[0], 0
    # until its merger's link is down and nothing of what it sent is left
    while True:
        if dealer.poll(50):
            for _ in range(256):
                try:
                    dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                    count += 1
                except zmq.Again:
                    break
            continue
        links.refresh()
        if count and pair.up[0] is None:
            break
    taken.value = count
    links.close()
    context.destroy(linger=0)


@pytest.mark.timeout(180)
def test_a_merger_gone_mid_reply_does_not_abort_the_island():
    """Each trial: a ROUTER streams 20-frame messages to the island and closes mid-stream; the
    island process ends by itself (with ZMQ_IMMEDIATE, 19 of 30 such trials aborted)."""
    spawn = multiprocessing.get_context("spawn")
    for _ in range(6):
        port, standby_port = free_ports(2)
        ready, taken = spawn.Event(), spawn.Value("i", 0)
        island = spawn.Process(target=_island, args=(port, standby_port, ready, taken))
        context = zmq.Context()
        router = _router(context, port)
        try:
            island.start()
            assert router.poll(int(WAIT_S * 1000)), "the island never spoke"
            identity, _ = router.recv_multipart()
            assert ready.wait(WAIT_S)
            frames = [b"x" * 1000] * 20
            for _ in range(2000):
                try:
                    router.send_multipart([identity, *frames], zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
            router.close(linger=0)
            island.join(timeout=WAIT_S)
            assert island.exitcode == 0, f"the island ended with {island.exitcode}"
            assert taken.value > 0
        finally:
            if island.is_alive():
                island.kill()
            context.destroy(linger=0)
