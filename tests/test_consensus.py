"""Failover through etcd (merger/replication/consensus.py): the lease arithmetic against
hand-derived values, then the claims against a real etcd (Debian's etcd-server; one member, and
three of which one is lost).  CI installs etcd and sets DLOCO_REQUIRE_ETCD, so that a machine
without it fails there instead of skipping."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from dloco.cluster.ports import free_ports
from dloco.merger.replication.consensus import (
    RATE_BOUND,
    Consensus,
    EtcdUnreachable,
    LeaseClock,
    PrimaryLease,
    check_endpoints,
    epoch_after,
)
from dloco.protocol.errors import ConfigError


def test_a_lease_counts_valid_for_half_its_ttl_past_the_renewal_that_was_granted():
    assert RATE_BOUND == 2.0
    clock = LeaseClock()
    assert not clock.valid(0.0)
    # sent at 10.0, etcd granted 3 s: valid on this clock until 10.0 + 3 / 2
    clock.renewed(10.0, 3)
    assert clock.valid(11.49) and not clock.valid(11.5)
    # an older renewal answered late never shortens it
    clock.renewed(9.0, 3)
    assert clock.valid(11.49)
    clock.renewed(11.0, 3)
    assert clock.valid(12.49) and not clock.valid(12.5)


def test_a_claims_epoch_is_above_the_stored_one_and_at_least_the_claimers_floor():
    assert epoch_after(5, None) == 5
    assert epoch_after(5, {"value": "9"}) == 10
    assert epoch_after(50, {"value": "9"}) == 50


def test_etcd_endpoints_are_checked():
    assert check_endpoints(["http://a:2379/", " http://b:1 "]) == ("http://a:2379", "http://b:1")
    for bad in (["a:2379"], ["ftp://a"], []):
        with pytest.raises(ConfigError):
            check_endpoints(bad)


def _etcd_binary() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("DLOCO_REQUIRE_ETCD"):
            pytest.fail("etcd is required here (DLOCO_REQUIRE_ETCD) but not on PATH")
        pytest.skip("no etcd binary (Debian: apt install etcd-server)")
    return binary


def _wait_ready(url: str, process: subprocess.Popen) -> None:
    for _ in range(200):
        assert process.poll() is None, "etcd exited at start"
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as answer:
                if b'"true"' in answer.read():
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"etcd at {url} never became healthy")


@pytest.fixture
def etcd_cluster(tmp_path):
    """start(n): n etcd members on free loopback ports; returns (client URLs, processes)."""
    binary, started = _etcd_binary(), []

    def start(n: int):
        ports = free_ports(2 * n)
        names = [f"m{i}" for i in range(n)]
        cluster = ",".join(f"{m}=http://127.0.0.1:{ports[2 * i + 1]}" for i, m in enumerate(names))
        urls, processes = [], []
        for i, name in enumerate(names):
            client, peer = ports[2 * i], ports[2 * i + 1]
            processes.append(
                subprocess.Popen(
                    [
                        binary,
                        *("--name", name, "--data-dir", str(tmp_path / name)),
                        *("--listen-client-urls", f"http://127.0.0.1:{client}"),
                        *("--advertise-client-urls", f"http://127.0.0.1:{client}"),
                        *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
                        *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
                        *("--initial-cluster", cluster, "--log-level", "error"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            urls.append(f"http://127.0.0.1:{client}")
        started.extend(processes)
        for url, process in zip(urls, processes):
            _wait_ready(url, process)
        return urls, processes

    yield start
    for process in started:
        process.kill()
        process.wait(timeout=30)


class _Log:
    def __init__(self) -> None:
        self.events = []

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append((level, event, fields))


@pytest.mark.timeout(120)
def test_one_claim_wins_a_held_key_is_refused_and_a_revoked_one_goes_to_the_next_epoch(
    etcd_cluster,
):
    (url,), _ = etcd_cluster(1)
    a, b = (Consensus([url], "/test/pair", holder, lease_s=2.0) for holder in ("a", "b"))
    first = a.claim(floor=100)
    assert first is not None and first.epoch == 100 and first.ttl_s == 2
    assert b.claim(floor=5) is None and b.holder_now() == "a"
    a.etcd.revoke(first.lease)
    assert a.holder_now() is None
    second = b.claim(floor=5)
    # above the stored epoch, whatever b's own floor
    assert second is not None and second.epoch == 101 and second.revision > first.revision
    # a's own claim is no longer the newest: a reclaim is refused
    assert a.claim(floor=0, own=first) is None


@pytest.mark.timeout(120)
def test_a_holder_whose_lease_lapsed_reclaims_it_only_if_nobody_claimed_it_since(etcd_cluster):
    (url,), _ = etcd_cluster(1)
    a = Consensus([url], "/test/pair", "a", lease_s=2.0)
    first = a.claim(floor=7)
    a.etcd.revoke(first.lease)
    again = a.claim(floor=0, own=first)
    assert again is not None and again.epoch == 7 and a.holder_now() == "a"


@pytest.mark.timeout(120)
def test_the_primarys_lease_survives_the_loss_of_one_etcd_member_of_three(etcd_cluster):
    urls, processes = etcd_cluster(3)
    log = _Log()
    consensus = Consensus(urls, "/test/pair", "a", lease_s=2.0)
    lease = PrimaryLease(consensus, consensus.claim(floor=1), log)
    try:
        # the member it talks to is lost; the other two are a quorum
        processes[consensus.etcd.good].kill()
        began = time.monotonic()
        # four TTLs of renewals, through the two left
        renewed = 0
        while time.monotonic() - began < 4 * consensus.ttl_s:
            if lease.valid():
                renewed += 1
            time.sleep(consensus.ttl_s / 6)
        assert lease.lost is None and lease.valid(), log.events
        assert renewed > 0
        other = Consensus(urls, "/test/pair", "b", lease_s=2.0)
        assert other.claim(floor=1) is None and other.holder_now() == "a"
    finally:
        lease.close()
    # closed: the key is given up at once
    assert Consensus(urls, "/test/pair", "b", lease_s=2.0).claim(floor=1) is not None


@pytest.mark.timeout(120)
def test_a_lease_is_not_valid_while_etcd_is_down_and_is_valid_again_once_it_is_back(
    etcd_cluster, tmp_path
):
    (url,), (process,) = etcd_cluster(1)
    log = _Log()
    consensus = Consensus([url], "/test/pair", "a", lease_s=2.0)
    lease = PrimaryLease(consensus, consensus.claim(floor=1), log)
    try:
        assert lease.valid()
        process.send_signal(subprocess.signal.SIGSTOP)
        # a renewal unanswered: no longer valid within half a TTL plus one renewal's timeout
        deadline = time.monotonic() + 3 * consensus.ttl_s
        while lease.valid() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lease.valid()
        process.send_signal(subprocess.signal.SIGCONT)
        deadline = time.monotonic() + 6 * consensus.ttl_s
        while not lease.valid() and time.monotonic() < deadline:
            time.sleep(0.05)
        # renewed again, or (had etcd let it expire) reclaimed: the epoch key is still its own
        assert lease.valid() and lease.lost is None, log.events
        assert ("warning", "etcd_unreachable") in [(lv, e) for lv, e, _ in log.events]
    finally:
        lease.close()


def test_a_merger_given_an_etcd_out_of_reach_stops_at_once_naming_each_endpoint(tmp_path):
    dead = [f"http://127.0.0.1:{port}" for port in free_ports(2)]
    merger = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "merger",
            *("--run-dir", str(tmp_path / "m"), "--insecure"),
            *("--delta-endpoint", "tcp://127.0.0.1:1", "--snapshot-endpoint", "tcp://127.0.0.1:2"),
            *("--control-endpoint", f"@tcp://127.0.0.1:{free_ports(1)[0]}"),
            *("--replication-endpoint", f"@tcp://127.0.0.1:{free_ports(1)[0]}"),
            *("--peer", "tcp://127.0.0.1:3", "--etcd", ",".join(dead)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert merger.returncode == 2, merger.stderr
    assert "etcd unreachable" in merger.stderr and all(url in merger.stderr for url in dead)


def test_an_etcd_error_names_the_endpoint(tmp_path):
    (port,) = free_ports(1)
    with pytest.raises(EtcdUnreachable, match=f"127.0.0.1:{port}"):
        Consensus([f"http://127.0.0.1:{port}"], "/x", "a", lease_s=2.0).check()
