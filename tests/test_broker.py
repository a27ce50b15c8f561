"""The broker as a real process: forwards both buses, counts, stops on SIGTERM; CURVE by default
with an allowlist; unknown keys and plaintext clients get nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from dloco import protocol
from dloco.bus.keys import Identity, create_keys, make_client, write_allow_list
from dloco.cluster.ports import free_ports


class BrokerProcess:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.ports = free_ports(4)
        names = ("--delta-in", "--delta-out", "--snapshot-in", "--snapshot-out")
        args = [
            a for name, port in zip(names, self.ports) for a in (name, f"tcp://127.0.0.1:{port}")
        ]
        self.log = tmp / f"broker-{self.ports[0]}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dloco", "broker", *args, "--stats-every", "1", *extra],
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while "broker_started" not in self.log.read_text():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "broker did not start"
            time.sleep(0.05)

    def endpoint(self, index: int) -> str:
        return f"tcp://127.0.0.1:{self.ports[index]}"

    def stop(self) -> int:
        """SIGTERM and wait; SIGKILL if it does not go (then the test fails on the exit code)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            return -9

    def events(self, name: str) -> list[dict]:
        return [
            json.loads(line)
            for line in self.log.read_text().splitlines()
            if f'"event": "{name}"' in line
        ]


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pair(context, broker: BrokerProcess, bus: int, pub_identity=None, sub_identity=None):
    """A publisher into bus `bus` (0 delta, 1 snapshot) and a subscriber out of it."""
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    for socket, identity in ((pub, pub_identity), (sub, sub_identity)):
        socket.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            make_client(socket, identity)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub.connect(broker.endpoint(2 * bus))
    sub.connect(broker.endpoint(2 * bus + 1))
    return pub, sub


def heartbeat(sender: str, epoch: int = 1) -> list:
    return protocol.encode(protocol.Heartbeat(sender=sender, epoch=epoch, seq=0))


def received(pub, sub, count: int = 20, wait_s: float = 3.0, frames=None) -> int:
    """Publish `count` messages (`frames`, by default an undecodable one) for up to `wait_s` (until
    the subscription is through); count arrivals."""
    got, deadline = 0, time.monotonic() + wait_s
    while time.monotonic() < deadline and got < count:
        pub.send_multipart(frames or [b"delta/0", b"header", b"x" * 1000])
        if sub.poll(50):
            while sub.poll(0):
                sub.recv_multipart()
                got += 1
    return got


@pytest.mark.timeout(120)
def test_insecure_broker_forwards_both_buses_counts_and_stops_cleanly(tmp_path, context):
    broker = BrokerProcess(tmp_path, "--insecure")
    try:
        for bus in (0, 1):
            pub, sub = pair(context, broker, bus)
            assert received(pub, sub) >= 20
        time.sleep(1.2)
    finally:
        code = broker.stop()
    assert code == 0
    stopped = broker.events("broker_stopped")[-1]
    assert stopped["messages"]["delta/delta"] >= 20 and stopped["messages"]["snapshot/delta"] >= 20
    assert stopped["bytes"]["delta/delta"] >= 20 * 1000 and broker.events("broker_stats")
    assert "WARNING: --insecure" in broker.log.read_text()


@pytest.mark.timeout(120)
def test_curve_admits_listed_keys_only_and_logs_refusals(tmp_path, context):
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    create_keys(keys, ["broker", "island-0", "merger", "stranger"])
    write_allow_list(keys, allow, {"island": ["island-0"], "merger": ["merger"]})
    broker = BrokerProcess(tmp_path, "--keys", str(keys), "--allow", str(allow))
    try:
        island = Identity.load(keys, "island-0", server="broker")
        merger = Identity.load(keys, "merger", server="broker")
        stranger = Identity.load(keys, "stranger", server="broker")
        pub, sub = pair(context, broker, 0, island, merger)
        # both listed: traffic flows, encrypted
        assert received(pub, sub, frames=heartbeat("island-0")) >= 20
        pub, sub = pair(context, broker, 0, stranger, merger)
        # unknown publisher: refused
        assert received(pub, sub, wait_s=2.0, frames=heartbeat("stranger")) == 0
        pub, sub = pair(context, broker, 0, island, None)
        # plaintext subscriber cannot talk to a secure broker
        assert received(pub, sub, wait_s=2.0, frames=heartbeat("island-0")) == 0
    finally:
        code = broker.stop()
    assert code == 0
    assert (
        broker.events("auth_refused") and broker.events("broker_stopped")[-1]["auth_refused"] >= 2
    )


def test_the_allow_list_is_read_by_role_and_its_mistakes_are_named(tmp_path):
    from dloco.bus.keys import load_allow_list
    from dloco.protocol.errors import ConfigError

    keys, allow = tmp_path / "keys", tmp_path / "allow"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "keys",
            str(keys),
            "island-0",
            "island-1",
            "--allow",
            str(allow),
            "--role",
            "island",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0 and "listed island-0, island-1 as island" in made.stdout
    create_keys(keys, ["merger"])
    write_allow_list(keys, allow, {"merger": ["merger"]})
    peers = load_allow_list(allow)
    assert sorted((p.role, p.name) for p in peers.values()) == [
        ("island", "island-0"),
        ("island", "island-1"),
        ("merger", "merger"),
    ]
    (allow / "merger" / "island-0.key").write_bytes((keys / "island-0.key").read_bytes())
    with pytest.raises(ConfigError, match="also listed as island/island-0"):
        load_allow_list(allow)
    (allow / "merger" / "island-0.key").unlink()
    (allow / "stray.key").write_bytes((keys / "merger.key").read_bytes())
    with pytest.raises(ConfigError, match="keys without a role"):
        load_allow_list(allow)
    (allow / "stray.key").unlink()
    (allow / "admins").mkdir()
    with pytest.raises(ConfigError, match="not roles"):
        load_allow_list(allow)


def test_keys_are_private_and_bad_invocations_are_clear(tmp_path):
    for path in create_keys(tmp_path / "k", ["broker"]):
        assert path.stat().st_mode & 0o777 == 0o600
    run = subprocess.run(
        [sys.executable, "-m", "dloco", "broker"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "CURVE is on by default" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "dloco", "broker", "--insecure", "--delta-in", "nonsense://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "cannot bind" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.timeout(120)
def test_only_the_protocols_subscriptions_reach_the_publishers(tmp_path, context):
    """A subscriber floods the snapshot bus with 5,000 distinct topics no subscriber of the protocol
    makes: each is refused and counted, none reaches the publishers.  A protocol subscription beside
    it reaches them once however many subscribe, and one subscriber's unsubscribing does not cut the
    others' traffic."""
    flood_count = 5000
    broker = BrokerProcess(tmp_path, "--insecure")
    try:
        # a publisher that sees the subscriptions reaching it
        upstream = context.socket(zmq.XPUB)
        upstream.setsockopt(zmq.LINGER, 0)
        upstream.connect(broker.endpoint(2))
        flood, honest, second = (context.socket(zmq.SUB) for _ in range(3))
        # else ZeroMQ keeps only the first 1,000 subscriptions in its queue
        flood.setsockopt(zmq.SNDHWM, 0)
        for socket in (flood, honest):
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(broker.endpoint(3))
        for i in range(flood_count - 1):
            flood.setsockopt(zmq.SUBSCRIBE, b"z%05d" % i)
        # a fragment number past the protocol's
        flood.setsockopt(zmq.SUBSCRIBE, b"snapshot/12345")
        honest.setsockopt(zmq.SUBSCRIBE, b"snapshot/")
        seen = []
        while b"\x01snapshot/" not in seen:
            assert upstream.poll(10_000), seen[:3]
            seen.append(upstream.recv())
        assert received(upstream, honest, frames=[b"snapshot/0", b"header", b"x" * 100]) >= 20
        second.setsockopt(zmq.LINGER, 0)
        second.setsockopt(zmq.SUBSCRIBE, b"snapshot/")
        second.connect(broker.endpoint(3))
        assert received(upstream, second, frames=[b"snapshot/0", b"header", b"x" * 100]) >= 20
        honest.setsockopt(zmq.UNSUBSCRIBE, b"snapshot/")
        deadline = time.monotonic() + 30
        while (broker.events("broker_stats") or [{}])[-1].get("refused", {}).get(
            "snapshot/subscription", 0
        ) < flood_count:
            assert time.monotonic() < deadline, broker.events("broker_stats")[-1:]
            time.sleep(0.2)
        # still fed
        assert received(upstream, second, frames=[b"snapshot/0", b"header", b"x" * 100]) >= 20
    finally:
        code = broker.stop()
    # nothing of the flood upstream
    assert code == 0 and seen == [b"\x01snapshot/"]
    # nor the second subscription of the same topic, nor the first's unsubscription
    assert not upstream.poll(0)
    stopped = broker.events("broker_stopped")[-1]
    assert stopped["refused"]["snapshot/subscription"] == flood_count
    assert stopped["subscriptions"] == {"snapshot/subscribe": 1}
    # a line a second at most
    assert len(broker.events("subscription_refused")) <= 60


def test_the_subscriptions_the_protocol_makes_by_hand():
    from dloco.protocol import subscribable
    from dloco.protocol.limits import MAX_SUBSCRIPTION_BYTES

    made = [
        b"",
        b"ack",
        b"hello",
        b"resend",
        b"snapshot_request",
        b"delta/",
        b"delta/0/",
        b"delta/9999/",
        b"heartbeat/",
        b"heartbeat/3/",
        b"snapshot/",
        b"snapshot/12",
    ]
    assert (
        all(subscribable(topic) for topic in made) and max(map(len, made)) == MAX_SUBSCRIPTION_BYTES
    )
    for topic in (
        b"delta/3",
        b"delta/10000/",
        b"snapshot/12345",
        b"acks",
        b"x" * 500,
        b"delta//",
        b"heartbeat/a/",
        b"\x00ack",
    ):
        assert not subscribable(topic), topic
