"""A cluster on a network of its own: every host (broker, each merger, the evaluator, each region)
in a Linux network namespace with its own address, joined through a router namespace by a veth
pair, so that the network's faults can be made in the kernel while processes run unchanged:

- a partition: the router drops what a host sends and what is sent to it (no reset: TCP stays
  "established" and only ZMTP heartbeats notice), or one direction only;
- loss: the router drops a share of the host's packets, each way (TCP resends);
- healing: the host's rules removed.

`[run] network = "netns"` (root, `ip` and `iptables`) runs `dloco up` this way; the chaos actions
`partition`, `partition-in`, `partition-out`, `loss-P` and `heal` act on it (cluster/chaos.py).
`plan` is pure (names, addresses, the commands' arguments); `Network` runs them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

from dloco.protocol.errors import DlocoError

# host k is 10.77.k.2, its router side 10.77.k.1 (private to the run's namespaces)
SUBNET = "10.77"


class NetworkError(DlocoError):
    """The namespaces could not be made or changed (not root, no `ip` or `iptables`, a kernel
    without them)."""


@dataclasses.dataclass(frozen=True)
class Host:
    # the host's name in the cluster (a process, or a region for all its processes)
    name: str
    namespace: str
    address: str
    router_address: str
    # the veth end in the host's namespace
    host_link: str
    # the veth end in the router's namespace
    router_link: str


def plan(tag: str, names: list[str]) -> dict[str, Host]:
    """Each host's namespace, address and links; `tag` keeps two runs' namespaces apart (interface
    names stay within Linux's 15 characters)."""
    if len(names) > 250:
        raise NetworkError(f"at most 250 hosts on one network, got {len(names)}")
    return {
        name: Host(
            name,
            f"dloco-{tag}-{name}",
            f"{SUBNET}.{k}.2",
            f"{SUBNET}.{k}.1",
            f"d{tag[-6:]}h{k}",
            f"d{tag[-6:]}r{k}",
        )
        for k, name in enumerate(names, 1)
    }


def setup_commands(router: str, host: Host) -> list[list[str]]:
    """`ip` commands that make `host`'s namespace and join it to the router's."""
    n, r = ["ip", "-n", host.namespace], ["ip", "-n", router]
    return [
        ["ip", "netns", "add", host.namespace],
        [
            "ip",
            "link",
            "add",
            host.host_link,
            "netns",
            host.namespace,
            "type",
            "veth",
            "peer",
            "name",
            host.router_link,
            "netns",
            router,
        ],
        [*n, "addr", "add", f"{host.address}/24", "dev", host.host_link],
        [*n, "link", "set", host.host_link, "up"],
        [*n, "link", "set", "lo", "up"],
        [*n, "route", "add", "default", "via", host.router_address],
        [*r, "addr", "add", f"{host.router_address}/24", "dev", host.router_link],
        [*r, "link", "set", host.router_link, "up"],
    ]


def rules(host: Host, fault: str, peer: Host | None = None) -> list[list[str]]:
    """iptables FORWARD rules (arguments after `-A FORWARD`) of the router for a fault of `host`:
    partition (both ways), partition-out (it sends nothing), partition-in (it receives nothing),
    partition-from-PEER (nothing between it and `peer`, both ways), or loss-P (P % of its packets
    each way)."""
    sent, received = ["-i", host.router_link], ["-o", host.router_link]
    if fault.startswith("partition-from-"):
        if peer is None:
            raise NetworkError(f"{fault}: no such host")
        return [
            [*sent, "-o", peer.router_link, "-j", "DROP"],
            [*received, "-i", peer.router_link, "-j", "DROP"],
        ]
    if fault == "partition":
        return [[*sent, "-j", "DROP"], [*received, "-j", "DROP"]]
    if fault == "partition-out":
        return [[*sent, "-j", "DROP"]]
    if fault == "partition-in":
        return [[*received, "-j", "DROP"]]
    if fault.startswith("loss-"):
        share = float(fault.removeprefix("loss-")) / 100
        if not 0 < share < 1:
            raise NetworkError(f"loss must be between 0 and 100 %, got {fault}")
        drop = [
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            f"{share:.6f}",
            "-j",
            "DROP",
        ]
        return [[*sent, *drop], [*received, *drop]]
    raise NetworkError(f"unknown network fault {fault!r}")


def dropped_packets(listing: str, link: str) -> int:
    """The packets of the DROP rules on `link` in `iptables -L FORWARD -v -x -n` output (first
    column)."""
    return sum(
        int(line.split()[0])
        for line in listing.splitlines()
        if line.split()[2:3] == ["DROP"] and link in line.split()[5:7]
    )


def iptables() -> str:
    """The kernel's legacy tables where the tool has them (no nf_tables needed), else plain
    iptables."""
    for tool in ("iptables-legacy", "iptables"):
        if shutil.which(tool):
            return tool
    raise NetworkError("iptables is not installed (Debian: apt-get install iptables)")


def unavailable() -> str | None:
    """Why this machine cannot run a network of namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip",):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    try:
        iptables()
    except NetworkError as error:
        return str(error)
    probe = f"dloco-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Network:
    """The namespaces of one run: made on entry, removed on close (and every process in them with
    them)."""

    def __init__(self, names: list[str], tag: str | None = None) -> None:
        self.tag = tag or str(os.getpid())
        self.router = f"dloco-{self.tag}-router"
        self.hosts = plan(self.tag, names)
        # host -> its rules in force
        self.faults: dict[str, list[list[str]]] = {}
        self.tool = iptables()
        try:
            self._run(["ip", "netns", "add", self.router])
            self._run(
                ["ip", "netns", "exec", self.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]
            )
            self._run(["ip", "-n", self.router, "link", "set", "lo", "up"])
            for host in self.hosts.values():
                for command in setup_commands(self.router, host):
                    self._run(command)
        except NetworkError:
            self.close()
            raise

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def wrap(self, name: str, command: list[str]) -> list[str]:
        """`command` run in `name`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[name].namespace, *command]

    def fault(self, name: str, fault: str) -> int:
        """Put `fault` on `name`'s link (after healing what was there: one fault per host at a
        time). Returns the packets the fault it replaced dropped."""
        dropped = self.heal(name)
        added = rules(
            self.hosts[name], fault, self.hosts.get(fault.removeprefix("partition-from-"))
        )
        for rule in added:
            self._run(["ip", "netns", "exec", self.router, self.tool, "-A", "FORWARD", *rule])
        self.faults[name] = added
        return dropped

    def heal(self, name: str) -> int:
        """Remove `name`'s fault; returns the packets it dropped (the router's counters)."""
        dropped = self.dropped(name) if name in self.faults else 0
        for rule in self.faults.pop(name, []):
            self._run(["ip", "netns", "exec", self.router, self.tool, "-D", "FORWARD", *rule])
        return dropped

    def dropped(self, name: str) -> int:
        """Packets dropped so far by the rules on `name`'s link."""
        listing = subprocess.run(
            ["ip", "netns", "exec", self.router, self.tool, "-L", "FORWARD", "-v", "-x", "-n"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return dropped_packets(listing, self.hosts[name].router_link)

    def close(self) -> None:
        """Every namespace of the run removed (their links go with them)."""
        for namespace in [*(h.namespace for h in self.hosts.values()), self.router]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    @staticmethod
    def _run(command: list[str]) -> None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise NetworkError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


class Faults:
    """Chaos's network events on a `Network`: targets are processes, faults sit on their hosts."""

    def __init__(self, network: Network) -> None:
        self.network = network
        # chaos target -> the host its fault is on (a merger's role may move before the heal)
        self.on: dict[str, str] = {}
        # chaos target -> what its last event measured, for chaos.jsonl
        self.effect: dict[str, dict] = {}

    def act(self, action: str, target: str, host_of) -> None:
        """`action` (partition..., loss-P, heal) on `target`'s host; `host_of` maps a process to its
        host."""
        if action == "heal":
            dropped = self.network.heal(self.on.pop(target, host_of(target)))
        else:
            host = self.on[target] = host_of(target)
            peer = (
                action.removeprefix("partition-from-")
                if action.startswith("partition-from-")
                else None
            )
            dropped = self.network.fault(
                host, action if peer is None else f"partition-from-{host_of(peer)}"
            )
        # what the fault it ended (or replaced) dropped
        self.effect[target] = {"dropped_packets": dropped}


def host_names(config) -> list[str]:
    """The hosts of a cluster: the broker, each merger process, the evaluator, each region (all of
    a multi-host region's processes share its host, as one site behind one link)."""
    return ["broker", *config.merger.processes, "evaluator", *(r.name for r in config.regions)]


def services(config, run_dir, network: Network) -> dict:
    """The cluster's processes (cluster/topology.py's commands), each in its host's namespace,
    reaching the others at their hosts' addresses; every namespace has the ports to itself."""
    from dloco.cluster import etcd, topology
    from dloco.cluster.localcompose import Service, dloco_program

    mergers = config.merger.processes
    shards = [name for name in mergers if name.startswith("merger.")]
    standbys = [name for name in mergers if name.startswith("standby.")]
    groups = [r.name for r in config.regions if r.hosts > 1]
    at = topology.Addresses(
        broker_ports=("5550", "5551", "5552", "5553"),
        control_port="5560",
        broker_host=network.address("broker"),
        merger_host=network.address("merger"),
        bind_host="*",
        standby_ports=("5561", "5562", "5563"),
        standby_host=network.address("standby") if "standby" in mergers else "127.0.0.1",
        coordinator_ports={name: str(5580 + k) for k, name in enumerate(groups)},
        coordinator_host="127.0.0.1",
        shard_control_ports=tuple(str(5570 + k) for k in range(len(shards))),
        shard_hosts=tuple(network.address(name) for name in shards),
        shard_standby_ports=tuple(
            (str(5590 + 3 * k), str(5591 + 3 * k), str(5592 + 3 * k)) for k in range(len(standbys))
        ),
        shard_standby_hosts=tuple(network.address(name) for name in standbys),
    )
    commands = topology.commands(config, at, str(run_dir))
    site = {process: region.name for region in config.regions for process in region.processes}
    cpus = {name: config.cpus_of(r) for r in config.regions for name in r.processes}
    # etcd on the hub's host, beside the broker
    site["etcd"] = "broker"
    services = {
        name: Service(
            network.wrap(site.get(name, name), [*dloco_program(), *args]),
            cpus=cpus.get(name),
        )
        for name, args in commands.items()
    }
    probe = [*dloco_program(), "probe", f"tcp://{at.broker_host}:{at.etcd_ports[0]}"]
    return etcd.first(services, network.wrap("broker", probe))
