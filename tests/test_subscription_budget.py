"""Subscriptions within budgets (bus/subscriptions.py): the accounting by hand, and a CURVE broker,
and a merger binding its own sockets, as real processes whose snapshot socket one island key floods
with distinct topics: the key is banned, the socket opened afresh (what it held freed), and an
honest subscriber fed again."""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq

from dloco.bus.keys import Identity, create_keys, make_client, write_allow_list
from dloco.bus.subscriptions import SUBSCRIPTION_COST, SubscriptionBudget, Verdict
from tests.test_broker import BrokerProcess, heartbeat, received
from tests.test_trust import ISLANDS, bound_merger, client
from tests.test_untrusted_input import rss_mib


def test_a_peer_is_charged_per_subscription_refilled_over_time_and_the_bus_in_total():
    """Budgets of 1,000 bytes a peer (refilled over 100 s) and 3,000 for the bus; a 36-byte topic
    costs 36 + 64 = 100."""
    assert SUBSCRIPTION_COST == 64
    budget = SubscriptionBudget(peer_bytes=1000, refill_s=100.0, total_bytes=3000)
    # ten fit exactly: 1,000 - 10 x 100 = 0
    assert [budget.charge("a", 36, 0.0) for _ in range(10)] == [Verdict()] * 10
    assert budget.charge("a", 36, 0.0) == Verdict(peer_over=True)
    # 50 s later a has -100 + 500 = 400 left: one more leaves 300
    assert budget.charge("a", 36, 50.0) == Verdict()
    assert budget.left["a"] == (300.0, 50.0)
    # b has its own budget; the bus is at 1,200 + b's
    assert [budget.charge("b", 36, 50.0) for _ in range(10)] == [Verdict()] * 10
    assert budget.total == 2200
    for _ in range(8):
        verdict = budget.charge("c", 36, 50.0)
    assert budget.total == 3000 and verdict == Verdict()
    assert budget.charge("c", 36, 50.0) == Verdict(bus_over=True) and Verdict(bus_over=True).reopen
    # opened afresh: nothing held; what is left of each budget stays, an overdraft counts as none
    budget.charge("a", 936, 50.0)
    budget.reopened()
    assert budget.total == 0 and budget.left["a"] == (0.0, 50.0)
    assert budget.left["b"] == (0.0, 50.0) and budget.left["c"] == (100.0, 50.0)


# a broker process under a flood of subscriptions: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_key_flooding_subscriptions_is_banned_and_what_it_made_the_broker_hold_is_freed(tmp_path):
    """Before: 20,000 distinct 500-byte topics grew the broker by 466 MB, never given back.  Now
    island-0's 10,000 random 200-byte topics (without the budget: the broker grew by ~97 MB) take
    it past its budget (16 KiB): it is banned, the snapshot bus's XPUB opened afresh, the broker
    grows by a few MB, and island-1, subscribed beside it, is fed again once it has reconnected."""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["broker", "merger", "island-0", "island-1"])
    write_allow_list(keys, allow, {"merger": ["merger"], "island": ["island-0", "island-1"]})
    broker = BrokerProcess(tmp_path, "--keys", str(keys), "--allow", str(allow))
    context = zmq.Context()

    def socket(kind: int, name: str, endpoint: int) -> zmq.Socket:
        made = context.socket(kind)
        made.setsockopt(zmq.LINGER, 0)
        make_client(made, Identity.load(keys, name, server="broker"))
        made.connect(broker.endpoint(endpoint))
        return made

    try:
        publisher = socket(zmq.PUB, "merger", 2)
        honest = socket(zmq.SUB, "island-1", 3)
        honest.setsockopt(zmq.SUBSCRIBE, b"")
        assert received(publisher, honest, frames=heartbeat("merger"), wait_s=30.0) >= 20
        # measured once the broker forwards (on a busy machine its start-up may still be growing it)
        before = rss_mib(broker.process.pid)
        flood = context.socket(zmq.SUB)
        flood.setsockopt(zmq.LINGER, 0)
        # else ZeroMQ keeps only the first 1,000 subscriptions in its queue
        flood.setsockopt(zmq.SNDHWM, 0)
        make_client(flood, Identity.load(keys, "island-0", server="broker"))
        flood.connect(broker.endpoint(3))
        for _ in range(10_000):
            flood.setsockopt(zmq.SUBSCRIBE, os.urandom(100).hex().encode())
        deadline = time.monotonic() + 60
        while not broker.events("subscriptions_reopened"):
            assert time.monotonic() < deadline, broker.events("broker_stats")[-1:]
            time.sleep(0.2)
        # reconnected and subscribed again on its own
        assert received(publisher, honest, frames=heartbeat("merger"), wait_s=60.0) >= 20
        # the flood's own reconnections are refused while it is banned
        while (broker.events("broker_stats") or [{}])[-1].get("auth_refused", 0) < 1:
            assert time.monotonic() < deadline + 60, broker.events("broker_stats")[-1:]
            time.sleep(0.2)
        grown = rss_mib(broker.process.pid) - before
    finally:
        context.destroy(linger=0)
        code = broker.stop()
    assert code == 0
    reopened = broker.events("subscriptions_reopened")
    assert reopened[0]["peer"] == "island-0" and reopened[0]["why"] == "peer budget"
    stopped = broker.events("broker_stopped")[-1]
    assert stopped["refused"]["snapshot/subscription_budget"] >= 1
    assert stopped["reopened"]["snapshot"] == len(reopened)
    assert grown < 30, grown


# a merger process under a flood of subscriptions: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_merger_that_binds_its_snapshot_socket_budgets_subscriptions_too(tmp_path):
    """No broker: island-0 floods the merger's own snapshot socket with 10,000 random topics.  The
    merger bans the key, opens the socket afresh (logged, counted), and island-1's subscription to
    acks is fed again.  (Its memory is not measured here: its fold kernels compile meanwhile.)"""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["merger", *ISLANDS])
    write_allow_list(keys, allow, {"island": ISLANDS})
    merger, log, (delta, snapshot, _) = bound_merger(tmp_path, keys, allow)
    context = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{snapshot}"
    honest_key = Identity.load(keys, "island-1", server="merger")

    def acked(wait_s: float = 60.0) -> bool:
        """An ack reaches island-1: with a stream of its own (its heartbeats), its settled cursor
        goes out every second, fold or not."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            beats.send_multipart(heartbeat("island-1"))
            if honest.poll(200):
                return True
        return False

    try:
        beats = client(context, zmq.PUB, honest_key, f"tcp://127.0.0.1:{delta}")
        honest = context.socket(zmq.SUB)
        honest.setsockopt(zmq.LINGER, 0)
        honest.setsockopt(zmq.SUBSCRIBE, b"ack")
        make_client(honest, honest_key)
        honest.connect(endpoint)
        assert acked(), log.read_text()[-2000:]
        flood = context.socket(zmq.SUB)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.SNDHWM, 0)
        make_client(flood, Identity.load(keys, "island-0", server="merger"))
        flood.connect(endpoint)
        for _ in range(10_000):
            flood.setsockopt(zmq.SUBSCRIBE, os.urandom(100).hex().encode())
        deadline = time.monotonic() + 60
        while '"subscriptions_reopened"' not in log.read_text():
            assert time.monotonic() < deadline and merger.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        while honest.poll(0):
            honest.recv_multipart()
        # reconnected and subscribed again on its own
        assert acked()
    finally:
        context.destroy(linger=0)
        merger.terminate()
        code = merger.wait(timeout=60)
    assert code == 0
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    reopened = [e for e in events if e.get("event") == "subscriptions_reopened"]
    assert reopened[0]["peer"] == "island-0" and reopened[0]["why"] == "peer budget"
    counters = next(e for e in events if e.get("event") == "stopped")["counters"]
    assert counters["merger/subscriptions_reopened"] == len(reopened)
