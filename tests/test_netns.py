"""The network-namespace harness's pure parts (cluster/netns.py): addresses and links per host, the
router's rules for each fault, its drop counters, and chaos's network actions and their checks.
The harness itself runs in tests/test_network_faults.py (root, -m e2e)."""

from __future__ import annotations

import pytest

from dloco.cluster import chaos, netns
from dloco.cluster.config import ClusterConfig
from dloco.cluster.sections import Region
from dloco.protocol.errors import ConfigError


def test_each_host_gets_its_own_subnet_namespace_and_links_within_linux_limits():
    hosts = netns.plan("123456789", ["broker", "merger", "us-east"])
    east = hosts["us-east"]
    assert (east.namespace, east.address, east.router_address) == (
        "dloco-123456789-us-east",
        "10.77.3.2",
        "10.77.3.1",
    )
    assert (east.host_link, east.router_link) == ("d456789h3", "d456789r3")
    assert all(
        len(h.host_link) <= 15 and len(h.router_link) <= 15
        for h in netns.plan("9" * 12, [f"h{k}" for k in range(250)]).values()
    )
    with pytest.raises(netns.NetworkError, match="at most 250"):
        netns.plan("1", [f"h{k}" for k in range(251)])
    setup = netns.setup_commands("dloco-1-router", east)
    assert setup[0] == ["ip", "netns", "add", "dloco-123456789-us-east"]
    assert ["ip", "-n", east.namespace, "route", "add", "default", "via", "10.77.3.1"] in setup


def test_each_fault_is_router_rules_on_the_hosts_link():
    host = netns.plan("1", ["a"])["a"]
    out, into = ["-i", host.router_link], ["-o", host.router_link]
    assert netns.rules(host, "partition") == [[*out, "-j", "DROP"], [*into, "-j", "DROP"]]
    assert netns.rules(host, "partition-out") == [[*out, "-j", "DROP"]]
    assert netns.rules(host, "partition-in") == [[*into, "-j", "DROP"]]
    assert netns.rules(host, "loss-2") == [
        [*side, "-m", "statistic", "--mode", "random", "--probability", "0.020000", "-j", "DROP"]
        for side in (out, into)
    ]
    with pytest.raises(netns.NetworkError):
        netns.rules(host, "loss-100")
    with pytest.raises(netns.NetworkError):
        netns.rules(host, "jam")


def test_dropped_packets_are_read_from_the_routers_counters():
    listing = (
        "Chain FORWARD (policy ACCEPT 10 packets, 900 bytes)\n"
        "    pkts      bytes target     prot opt in     out     source               destination\n"
        "      80     4800 DROP       0    --  d1r3   *       0.0.0.0/0            0.0.0.0/0\n"
        "      19     1140 DROP       0    --  *      d1r3    0.0.0.0/0            0.0.0.0/0"
        "            statistic mode random probability 0.1\n"
        "       7      420 DROP       0    --  d1r4   *       0.0.0.0/0            0.0.0.0/0\n"
    )
    assert netns.dropped_packets(listing, "d1r3") == 99
    assert (
        netns.dropped_packets(listing, "d1r4") == 7 and netns.dropped_packets(listing, "d1r5") == 0
    )


def test_network_chaos_parses_does_not_take_a_process_down_and_needs_netns():
    events = chaos.parse(
        "partition:a@step=10,heal:a@+10,loss-2.5:a@b.step=+5,"
        "partition-in:merger@folds=3,heal:merger@+5"
    )
    assert [e.action for e in events] == ["partition", "heal", "loss-2.5", "partition-in", "heal"]
    assert all(chaos.is_network(e.action) for e in events) and not chaos.is_network("kill")
    # a partitioned island still makes steps
    chaos.check(events, ["a", "b", "merger", "broker"], ["a", "b"])
    with pytest.raises(ConfigError, match="between 0 and 100"):
        chaos.parse("loss-150:a@step=3")
    with pytest.raises(ConfigError, match="chaos action must be one of"):
        chaos.parse("jam:a@step=3")
    regions = (Region("a"), Region("b"))
    with pytest.raises(ConfigError, match='run.network = "netns"'):
        ClusterConfig(regions=regions, chaos=events)
    assert ClusterConfig(regions=regions, chaos=events, network="netns").network == "netns"
    with pytest.raises(ConfigError, match="run.network must be one of"):
        ClusterConfig(regions=regions, network="wifi")
    assert netns.host_names(ClusterConfig(regions=(Region("a"), Region("b", hosts=2)))) == [
        "broker",
        "merger",
        "evaluator",
        "a",
        "b",
    ]
