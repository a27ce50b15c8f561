"""Trust no island: a broker and a merger as real processes on loopback, attacked as a malicious or
buggy island would, with its own valid key: roles, names and plaintext.  Each test names the attack
it replays.  (What a merger does with poisoned and flooding input:
tests/test_untrusted_input.py.)"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.bus.keys import Identity, create_keys, make_client, write_allow_list
from tests.merger_helpers import delta_chunks, initial_params
from tests.merger_process_helpers import PARTS, free_port
from tests.test_broker import BrokerProcess, heartbeat, received

ISLANDS = ["island-0", "island-1"]


@pytest.fixture
def secure_broker(tmp_path):
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["broker", "merger", *ISLANDS, "watcher"])
    write_allow_list(
        keys, allow, {"merger": ["merger"], "island": ISLANDS, "observer": ["watcher"]}
    )
    broker = BrokerProcess(tmp_path, "--keys", str(keys), "--allow", str(allow))
    context = zmq.Context()
    yield broker, context, (lambda name: Identity.load(keys, name, server="broker"))
    context.destroy(linger=0)
    broker.stop()


def client(context, kind: int, identity: Identity | None, endpoint: str) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        make_client(socket, identity)
    if kind == zmq.SUB:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def forged_snapshot() -> list:
    """A whole fragment of 7.0s at version 2**40, in the merger's name."""
    values = {path: np.full(initial_params()[path].shape, 7.0, np.float32) for path in PARTS[0]}
    plan = protocol.split_fragment(values, protocol.Codec("fp32"), 1 << 20)[0]
    return protocol.encode(
        protocol.SnapshotChunk(
            sender="merger",
            epoch=1,
            seq=1,
            fragment=0,
            version=2**40,
            chunk_index=0,
            chunk_count=1,
            model=protocol.model_fingerprint(initial_params()),
            codec=protocol.Codec("fp32"),
            slices=plan.slices,
            payloads=plan.payloads,
        )
    )


# a CURVE broker process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_an_island_key_can_neither_publish_snapshots_nor_read_deltas(secure_broker):
    """Attack: island-0's key publishes a forged snapshot on the snapshot bus, in the merger's name,
    and subscribes to the delta bus.  Before roles, island-1 received the forgery 3 times of 3."""
    broker, context, key = secure_broker
    victim = client(context, zmq.SUB, key("island-1"), broker.endpoint(3))
    forger = client(context, zmq.PUB, key("island-0"), broker.endpoint(2))
    assert received(forger, victim, wait_s=3.0, frames=forged_snapshot()) == 0
    merger = client(context, zmq.PUB, key("merger"), broker.endpoint(2))
    # the merger's key is admitted there
    assert received(merger, victim, count=3, frames=heartbeat("merger")) == 3
    reader = client(context, zmq.SUB, key("island-0"), broker.endpoint(1))
    publisher = client(context, zmq.PUB, key("island-1"), broker.endpoint(0))
    assert received(publisher, reader, wait_s=3.0, frames=heartbeat("island-1")) == 0
    observer = client(context, zmq.SUB, key("watcher"), broker.endpoint(1))
    # an observer may read deltas
    assert received(publisher, observer, count=3, frames=heartbeat("island-1")) == 3
    assert broker.stop() == 0
    refusals = [event["detail"] for event in broker.events("auth_refused")]
    assert any(
        "DENIED (role)" in detail and "name=island-0 role=island" in detail for detail in refusals
    ), refusals
    assert broker.events("broker_stopped")[-1]["auth_refused"] >= 2


# a CURVE broker process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_no_peer_speaks_for_another(secure_broker):
    """Attacks: island-0's key sends a heartbeat as island-1 with epoch 2**64-1 (before: island-1
    was locked out); island-1's key replays a captured delta of island-0's with epoch + 1 (before:
    folded a second time).  The broker drops both, counts them and logs both names."""
    broker, context, key = secure_broker
    merger = client(context, zmq.SUB, key("merger"), broker.endpoint(1))
    attacker = client(context, zmq.PUB, key("island-0"), broker.endpoint(0))
    # in its own name: forwarded
    assert received(attacker, merger, count=3, frames=heartbeat("island-0")) == 3
    assert (
        received(attacker, merger, wait_s=2.0, frames=heartbeat("island-1", epoch=2**64 - 1)) == 0
    )
    captured = delta_chunks(PARTS[0], "island-0", 1, 0, 0, seed=1)[0]
    replayer = client(context, zmq.PUB, key("island-1"), broker.endpoint(0))
    replayed = protocol.encode(dataclasses.replace(captured, epoch=captured.epoch + 1))
    assert received(replayer, merger, wait_s=2.0, frames=replayed) == 0
    assert broker.stop() == 0
    refused = broker.events("broker_stopped")[-1]["refused"]
    assert refused.get("delta/sender_mismatch", 0) >= 2, refused
    logged = {(e["peer"], e["claimed_sender"]) for e in broker.events("message_refused")}
    assert {("island-0", "island-1"), ("island-1", "island-0")} <= logged, logged


# a CURVE broker process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_plaintext_attempts_are_counted_and_logged_at_a_bounded_rate(secure_broker):
    """Attack: plaintext connections to the CURVE broker.  Before, they were refused unseen."""
    broker, context, _ = secure_broker
    began = time.monotonic()
    # each is refused at least once
    plain = [client(context, zmq.PUB, None, broker.endpoint(0)) for _ in range(20)]
    deadline = time.monotonic() + 60
    while not [e for e in broker.events("broker_stats") if e["auth_refused"] >= 20]:
        assert time.monotonic() < deadline, broker.events("broker_stats")[-1:]
        time.sleep(0.1)
    assert broker.stop() == 0 and plain
    elapsed = time.monotonic() - began
    lines = [e["detail"] for e in broker.events("auth_refused")]
    assert lines and all("DENIED (handshake)" in line for line in lines), lines
    assert any("MECHANISM_MISMATCH" in line for line in lines) or any(
        "HANDSHAKE_FAILED_NO_DETAIL" in line for line in lines
    ), lines
    # at most one line a second, however many attempts
    assert len(lines) <= elapsed + 1


def bound_merger(tmp_path, keys, allow) -> tuple[subprocess.Popen, Path, tuple[int, int, int]]:
    """A CURVE merger without a broker (it binds its delta SUB, snapshot PUB and control ROUTER):
    the process, its log file and the three ports."""
    init = tmp_path / "init.npz"
    np.savez(init, **initial_params())
    ports = free_port(), free_port(), free_port()
    log = tmp_path / "merger.log"
    merger = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "merger",
            "--run-dir",
            str(tmp_path / "run"),
            "--init-npz",
            str(init),
            "--fragments",
            "2",
            "--delta-endpoint",
            f"@tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"@tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"@tcp://127.0.0.1:{ports[2]}",
            "--keys",
            str(keys),
            "--allow",
            str(allow),
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    return merger, log, ports


# a merger process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_merger_checks_who_sends_on_the_sockets_it_binds(tmp_path):
    """Attack on a merger without a broker (its delta SUB and control ROUTER bound, CURVE):
    island-1's key sends a heartbeat and a resend in island-0's name, and a DEALER with island-0's
    routing id. Each is refused as sender_mismatch, counted and logged."""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["merger", *ISLANDS])
    write_allow_list(keys, allow, {"island": ISLANDS})
    merger, log, (delta, snapshot, control) = bound_merger(tmp_path, keys, allow)
    context = zmq.Context()
    try:
        attacker = Identity.load(keys, "island-1", server="merger")
        pub = client(context, zmq.PUB, attacker, f"tcp://127.0.0.1:{delta}")
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IDENTITY, b"island-0")
        make_client(dealer, attacker)
        dealer.connect(f"tcp://127.0.0.1:{control}")
        resend = protocol.encode(delta_chunks(PARTS[0], "island-0", 1, 0, 0, seed=1)[0])
        deadline = time.monotonic() + 60
        while log.read_text().count('"sender_mismatch"') < 4:
            assert time.monotonic() < deadline and merger.poll() is None, log.read_text()[-2000:]
            pub.send_multipart(heartbeat("island-0", epoch=2**63))
            dealer.send_multipart(resend)
            time.sleep(0.2)
    finally:
        context.destroy(linger=0)
        merger.terminate()
        code = merger.wait(timeout=60)
    assert code == 0
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    refused = [
        e
        for e in events
        if e.get("event") == "message_rejected" and e.get("reason") == "sender_mismatch"
    ]
    assert refused and {e["peer"] for e in refused} == {"island-1"}
    # once a second per peer and socket (telemetry/ratelimit.py): the bus's heartbeat and the
    # control socket's resend each have lines
    assert "routing id 'island-0'" in " ".join(e.get("claimed", "") for e in refused)
    assert {e.get("socket") for e in refused} == {"bus", "control"}
    assert (
        next(e for e in events if e.get("event") == "stopped")["counters"][
            "merger/rejected/sender_mismatch"
        ]
        >= 3
    )


# a merger process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_an_observer_may_ask_for_snapshots_but_never_send_a_delta(tmp_path):
    """The evaluator's role: an observer key on the merger's control socket gets its catch-up
    snapshots, and a delta it sends there in its own name is refused as observer_delta, counted
    and never folded."""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["merger", "watcher"])
    write_allow_list(keys, allow, {"observer": ["watcher"]})
    merger, log, (_, _, control) = bound_merger(tmp_path, keys, allow)
    context = zmq.Context()
    replies = 0
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IDENTITY, b"watcher")
        make_client(dealer, Identity.load(keys, "watcher", server="merger"))
        dealer.connect(f"tcp://127.0.0.1:{control}")
        forged = protocol.encode(delta_chunks(PARTS[0], "watcher", 1, 0, 0, seed=1)[0])
        ask = protocol.encode(
            protocol.SnapshotRequest(sender="watcher", epoch=1, seq=0, fragments=(0,))
        )
        deadline = time.monotonic() + 60
        while not (replies and '"observer_delta"' in log.read_text()):
            assert time.monotonic() < deadline and merger.poll() is None, log.read_text()[-2000:]
            dealer.send_multipart(forged)
            dealer.send_multipart(ask)
            while dealer.poll(200):
                message = protocol.decode(dealer.recv_multipart())
                replies += isinstance(message, protocol.SnapshotChunk) and message.fragment == 0
    finally:
        context.destroy(linger=0)
        merger.terminate()
        code = merger.wait(timeout=60)
    assert code == 0 and replies >= 1
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    stopped = next(e for e in events if e.get("event") == "stopped")
    assert stopped["counters"]["merger/rejected/observer_delta"] >= 1 and stopped["folds"] == 0
    assert not any(e.get("event") == "fold" for e in events)
