"""What a bundle of `dloco deploy` (cluster/deploy.py) tells its host: the ports each host
publishes and who dials them, each bundle's README, and a region's Slurm script."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from dloco.cluster import etcd
from dloco.cluster.config import ClusterConfig

# delta in, delta out, snapshot in, snapshot out; the merger's control ROUTER
BROKER_PORTS = ("5551", "5552", "5553", "5554")
CONTROL_PORT = "5560"
# the ports other hosts dial: the islands' deltas in, snapshots out, catch-up and acks
PUBLISHED = {
    BROKER_PORTS[0]: "delta bus (islands publish)",
    BROKER_PORTS[3]: "snapshot bus (islands subscribe)",
    CONTROL_PORT: "the merger's control (acks, resends, catch-up)",
}
# with [merger] standby: the standby's control port, the merger's and the standby's replication
STANDBY_PORTS = ("5561", "5562", "5563")
# and what the hub publishes to the standby's host, what the standby publishes
TO_STANDBY = {
    BROKER_PORTS[1]: "delta bus (the standby receives the deltas)",
    BROKER_PORTS[2]: "snapshot bus (the standby, once primary, publishes)",
    STANDBY_PORTS[1]: "the merger's replication (the standby follows its log)",
}
FROM_STANDBY = {
    STANDBY_PORTS[0]: "the standby's control (the regions and the hub: acks, catch-up)",
    STANDBY_PORTS[2]: "the standby's replication (the hub's merger: to fence it, or to follow it"
    " once it is primary)",
}


def island_sbatch(name: str, command: list[str], tasks: int, program: Sequence[str] = ("dloco",)):
    """A batch script that runs `command` (a `dloco` command line) as `tasks` tasks of one srun
    step; `program` is how the host starts dloco."""
    return f"""#!/bin/bash
# Region {name}'s island under Slurm: {tasks} task(s) of one jax.distributed program, one per host
# of the region; each takes the group's coordinator, size and its index from Slurm's environment.
# From this folder: sbatch island.sbatch  (scancel ends it; the hub sees the island leave)
#SBATCH --job-name=dloco-{name}
#SBATCH --ntasks={tasks}
#SBATCH --output=run/slurm-%j.out
# one task per host, as the cluster file places them: uncomment on a cluster of several nodes
##SBATCH --ntasks-per-node=1
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
exec srun --kill-on-bad-exit=1 {shlex.join([*program, *command])}
"""


def _listing(ports: dict[str, str]) -> str:
    return "\n".join(f"- {port}/tcp: {what}" for port, what in ports.items())


def hub_readme(
    config: ClusterConfig, hub: str, standby: str | None, own_etcd: bool, etcd_urls: str = ""
) -> str:
    regions = ", ".join(r.name for r in config.regions)
    pair, in_etcd = "", " in etcd" if config.merger.etcd else ""
    if standby:
        to_standby = {
            **TO_STANDBY,
            **({etcd.CLIENT_PORT: "etcd (the pair's lease)"} if own_etcd else {}),
        }
        external = (
            f"\nThe merger reaches the etcd cluster at {etcd_urls}; open it to this host and to"
            f" `{standby}`.\n"
            if etcd_urls
            else ""
        )
        guarded = (
            f"\netcd's {etcd.CLIENT_PORT} has no authentication: open it to `{standby}` alone"
            " (a firewall rule),\nnever to the internet; whoever reaches it can take the lease.\n"
            if own_etcd
            else ""
        )
        pair = f"""
The merger's hot standby runs on `{standby}` (the `standby` bundle). Open these ports of `{hub}`
to that host as well:

{_listing(to_standby)}
{guarded}{external}
`{standby}` publishes {STANDBY_PORTS[0]} (to the regions and this host) and {STANDBY_PORTS[2]} (to
this host). Whichever of the two mergers holds the lease{in_etcd} is the primary; the other
follows its log and takes over when the lease lapses (PROTOCOL.md §12). After a takeover, the
merger restarted here follows the standby: `docker compose ps` then shows it unhealthy (its
control port is closed while it follows) and `docker compose logs merger` says `following`.
"""
    return f"""# The hub: broker, merger, evaluator

Copy this folder to the hub host, `{hub}`, build the image there from a checkout of dloco
(`docker build -t dloco:latest .`), then:

    docker compose up -d

The islands ({regions}) dial these ports of `{hub}`; open them to the regions' hosts:

{_listing(PUBLISHED)}
{pair}
Nothing else needs to be reachable: islands only connect out. `run/keys` holds the secret keys of
the broker, the merger and the evaluator, and every island's public key; `run/allow` names each
public key's role. The merger's log and checkpoints grow in `run/merger`.

Check it: `docker compose ps` (the broker healthy), then from any host
`dloco probe tcp://{hub}:{BROKER_PORTS[0]} tcp://{hub}:{CONTROL_PORT}`.
"""


def standby_readme(hub: str, standby: str, etcd_urls: str, in_etcd: bool) -> str:
    if in_etcd:
        where = (
            f"etcd at {etcd_urls}" if etcd_urls else f"the hub's etcd ({hub}:{etcd.CLIENT_PORT})"
        )
        lease = (
            f"lease in\n{where} lapses: it then folds, acknowledges and publishes in the merger's"
            " place, and the islands,\nwhich dial both, carry on (PROTOCOL.md §12). A standby cut"
            " off from etcd cannot claim the lease,\nso it never takes over from a merger that is"
            " still acknowledging."
        )
    else:
        lease = (
            'heartbeats stop for\na lease (`[merger] failover = "lease"`): it then folds,'
            " acknowledges and publishes in the merger's\nplace, and the islands, which dial both,"
            " carry on. A standby cut off from the merger alone takes\nover too, and what the"
            " merger acknowledged meanwhile is set aside (PROTOCOL.md §12): prefer etcd."
        )
    dialled = [*TO_STANDBY, *([etcd.CLIENT_PORT] if in_etcd and not etcd_urls else [])]
    return f"""# The merger's hot standby

Copy this folder to `{standby}`, a host other than the hub's, build the image there from a checkout
of dloco (`docker build -t dloco:latest .`), then, once the hub runs:

    docker compose up -d

It follows the merger's log over the replication stream and takes over when the merger's {lease}

It dials `{hub}` on {", ".join(dialled)}. Open these ports of this host ({STANDBY_PORTS[0]} to the
hub and to every region, {STANDBY_PORTS[2]} to the hub alone):

{_listing(FROM_STANDBY)}

`run/keys` holds the merger's secret key (the standby speaks as the merger) and the others' public
keys; its own copy of the log grows in `run/standby`.

Check it: on the hub, `docker compose logs merger` shows `standby_following` once this standby has
connected and caught up; `docker compose logs standby` here shows `taking_over` if it ever does.
"""


def region_readme(name: str, hub: str, hosts: int = 1, standby: str | None = None) -> str:
    compose_start = (
        f"Copy this folder to the host of region `{name}`, build the image there from a checkout"
        " of dloco\n(`docker build -t dloco:latest .`), then:\n\n    docker compose up -d\n\n"
        "Or, on a Slurm cluster with dloco installed (`pip install` from a checkout), from this"
        " folder on\na filesystem the nodes share: `sbatch island.sbatch`."
    )
    slurm = (
        f"Region `{name}` is one island over {hosts} hosts: it runs under Slurm, one task per host"
        " of\none jax.distributed program. Copy this folder to a filesystem the nodes share,"
        " install dloco on\nthem (`pip install` from a checkout), then from this folder:\n\n"
        "    sbatch island.sbatch"
    )
    start = compose_start if hosts == 1 else slurm
    also = f" and the merger's standby `{standby}` on port {STANDBY_PORTS[0]}" if standby else ""
    return f"""# Region {name}: its island

{start}

The island dials the hub `{hub}` on ports {", ".join(PUBLISHED)}{also} (it only connects out: a
host behind NAT works). `run/keys` holds this region's secret key alone, and the hub's public
keys; the hub admits it under the name `{name}` only.

Check it: `dloco probe tcp://{hub}:{BROKER_PORTS[0]}` from this host reaches the hub; after the
island has joined, `dloco probe run/metrics/{name}.jsonl --max-age 120` says it is training.
"""
