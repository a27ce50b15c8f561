"""`dloco deploy`: one cluster file as bundles for separate hosts.  A bundle is a folder to copy to
its host and start there with `docker compose up -d`:

- `hub/`: the broker, the merger and the evaluator, with the secret keys of those three, every
  island's public key (the allow-list, by role) and the initial model.  It publishes three ports,
  the only ones any island dials: the delta bus's input, the snapshot bus's output and the
  merger's control ROUTER.
- with `[merger] standby = true`, `standby/` for a second hub host (`--standby-host`): the merger's
  hot standby, with the merger's secret key (either may be the primary) and no other.  The hub
  then also runs one etcd member that holds the pair's lease (`[merger] failover = "etcd"`, or
  `--etcd URL,...` for an etcd cluster of your own) and publishes to the standby's host what it
  needs: the delta bus's output, the snapshot bus's input, the merger's replication port and
  etcd's client port.  The islands dial both mergers' control ports.
- one folder per region: that region's island, its own secret key and the hub's public keys, and
  nothing else: a region host never holds another's secret.  Islands only dial out, so a region
  behind NAT works.  Beside its compose file, `island.sbatch` runs the island under Slurm instead:
  one task per host of the region (`[[regions]] hosts`), one jax.distributed program whose
  coordinator each task takes from Slurm's environment (`--coordinator slurm`).  A region of
  several hosts gets the Slurm script only.

Real hosts have real links and real speeds: the profile's emulated links and slowdowns stay
behind.  Each bundle's README says what to copy where, which ports must be reachable, how to start
it and how to check it (`dloco probe`).  A cluster this cannot place yet is refused, naming why:
merger shards, a network of namespaces, or inputs (a task file, a corpus, a token
file) that would have to travel with a bundle.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from dloco.cluster import compose, etcd, topology
from dloco.cluster.bundle_texts import (
    BROKER_PORTS,
    CONTROL_PORT,
    FROM_STANDBY,
    STANDBY_PORTS,
    hub_readme,
    island_sbatch,
    region_readme,
    standby_readme,
)
from dloco.cluster.config import ClusterConfig
from dloco.merger.replication.consensus import check_endpoints
from dloco.protocol.errors import ConfigError, require

# inside every container: the bundle's run/ folder
RUN = "/dloco/run"
HUB_SERVICES = ("broker", "merger", "evaluator")
# a host name (RFC 1123 labels) or an IPv4 address, as --hub and --standby-host take them
LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST = re.compile(rf"(?=.{{1,253}}$){LABEL}(\.{LABEL})*\.?")
LOOPBACK = ("localhost", "[::1]")
ENVIRONMENT = {"PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
LOGGING = {"driver": "json-file", "options": {"max-size": "64m", "max-file": "5"}}


def check(config: ClusterConfig, hub: str, standby: str | None, etcd_urls: str = "") -> None:
    """Refuse what this cannot place on separate hosts yet, naming it."""
    merger = config.merger
    require(merger.shards == 1, "deploy: merger shards ([merger] shards > 1) are not placed yet")
    require(config.network == "loopback", "deploy: run.network = netns is for one machine")
    model = config.model
    require(
        not (model.corpus or model.tokens or model.task.partition(":")[0].endswith(".py")),
        "deploy: a task file, corpus or token file would have to travel with every bundle; the"
        " image's built-in LM on its own standard library sources is placed",
    )
    taken = {r.name for r in config.regions} & {"hub", "standby"}
    require(
        not taken,
        f"deploy: a region named {', '.join(sorted(taken))} would share a bundle's folder",
    )
    for flag, host in (("--hub", hub), ("--standby-host", standby)):
        require(
            host is None or HOST.fullmatch(host) is not None,
            f"deploy: {flag} must be a host name or IPv4 address, got {host!r}",
        )
    if merger.standby:
        require(
            bool(standby),
            "deploy: a hot standby ([merger] standby) needs a host of its own: --standby-host",
        )
        require(
            standby.lower().rstrip(".") != hub.lower().rstrip("."),
            f"deploy: the standby's host is the hub's ({hub}): it would share the merger's"
            " failures; give another host",
        )
    else:
        require(not standby, "deploy: --standby-host, but the cluster file has no [merger] standby")
    if etcd_urls:
        require(
            merger.etcd,
            'deploy: --etcd is for a standby with [merger] failover = "etcd"; the cluster file has'
            f" standby = {str(merger.standby).lower()}, failover = {merger.failover!r}",
        )
        for url in check_endpoints(etcd_urls.split(",")):
            where = url.partition("://")[2].rpartition(":")[0]
            require(
                where not in LOOPBACK and not where.startswith("127."),
                f"deploy: --etcd {url} is this host's own address; give one the hub and the"
                " standby both reach",
            )


def real_hosts(config: ClusterConfig) -> ClusterConfig:
    """`config` on real hosts: no emulated links, no slowdowns, no CPU quotas."""
    regions = tuple(
        dataclasses.replace(r, uplink_mbps=None, downlink_mbps=None, rtt_ms=0.0, slowdown=1.0)
        for r in config.regions
    )
    return dataclasses.replace(config, regions=regions, island_cpus=0.0)


def one_command_each(config: ClusterConfig) -> ClusterConfig:
    """`config` with every island written as one command line: a region's hosts are the tasks of
    its Slurm job, which take their group from Slurm (every process of an island is started with
    the same flags but for the group's; each takes its part of the batch)."""
    regions = tuple(dataclasses.replace(r, hosts=1) for r in config.regions)
    return dataclasses.replace(config, regions=regions)


def _addresses(hub: str, standby: str | None, **where) -> topology.Addresses:
    """Where everything listens: the hub's fixed ports, the standby's on `standby`; `where` says
    how this side reaches the hub (by default: at `hub`)."""
    return topology.Addresses(
        BROKER_PORTS,
        CONTROL_PORT,
        **{"broker_host": hub, "merger_host": hub, "etcd_host": hub, **where},
        standby_ports=STANDBY_PORTS,
        standby_host=standby or "standby",
    )


def commands(
    config: ClusterConfig, hub: str, standby: str | None = None, etcd_urls: str = ""
) -> dict[str, list[str]]:
    """Every process's `dloco` arguments: the hub's reaching each other by service name, the
    standby and the islands the hub at `hub`, the standby (if any) at `standby`; the pair's lease
    in etcd at `etcd_urls` (default: the hub's own member)."""
    config = one_command_each(config)
    inside = _addresses(
        hub, standby, broker_host="broker", merger_host="merger", etcd_host="etcd", bind_host="*"
    )
    hub_lines = topology.commands(config, inside, RUN)
    island_lines = topology.commands(config, _addresses(hub, standby), RUN)
    out = {
        **{name: hub_lines[name] for name in HUB_SERVICES},
        **{r.name: island_lines[r.name] for r in config.regions},
    }
    if config.merger.standby:
        out["standby"] = topology.commands(config, _addresses(hub, standby, bind_host="*"), RUN)[
            "standby"
        ]
    if etcd_urls:
        # an etcd of the user's may hold other deployments' keys: this pair's under its hub's name
        urls = ",".join(check_endpoints(etcd_urls.split(",")))
        for name in ("merger", "standby"):
            at = out[name].index("--etcd") + 1
            own = ["--etcd-prefix", f"/dloco/{hub.lower()}/merger"]
            out[name] = [*out[name][:at], urls, *own, *out[name][at + 1 :]]
    return out


def slurm_commands(
    config: ClusterConfig, hub: str, standby: str | None = None
) -> dict[str, list[str]]:
    """Each region's island as one command line for every task of an srun step: paths under the
    bundle's run/ (a Slurm job runs in the folder it was submitted from), the group taken from
    Slurm's environment instead of a coordinator, a count and an index per host."""
    lines = topology.commands(one_command_each(config), _addresses(hub, standby), "run")
    return {r.name: [*lines[r.name], "--coordinator", "slurm"] for r in config.regions}


def _service(command: list[str], **extra) -> dict:
    return {
        "image": "dloco:latest",
        "command": ["dloco", *command],
        "environment": dict(ENVIRONMENT),
        "volumes": [f"./run:{RUN}"],
        "logging": LOGGING,
        **extra,
    }


def _ports(*ports: str) -> list[str]:
    return [f"{port}:{port}" for port in ports]


def hub_compose(commands: dict[str, list[str]], own_etcd: bool = False) -> dict:
    """The hub's compose file; with a standby in `commands`, the ports its host dials published
    too, and (`own_etcd`) one etcd member holding the pair's lease."""
    probe = ["CMD", "dloco", "probe"]
    pair = "standby" in commands
    services = {
        "broker": _service(
            commands["broker"],
            ports=_ports(BROKER_PORTS[0], BROKER_PORTS[3], *(BROKER_PORTS[1:3] if pair else ())),
            healthcheck={"test": [*probe, f"tcp://127.0.0.1:{BROKER_PORTS[0]}"]},
        ),
        "merger": _service(
            commands["merger"],
            ports=_ports(CONTROL_PORT, *(STANDBY_PORTS[1:2] if pair else ())),
            depends_on={"broker": {"condition": "service_healthy"}},
            healthcheck={"test": [*probe, f"tcp://127.0.0.1:{CONTROL_PORT}"]},
            stop_grace_period="60s",
        ),
        # a merger restarted after its standby took over follows it, its control port closed
        "evaluator": _service(
            commands["evaluator"],
            depends_on={"merger": {"condition": "service_started" if pair else "service_healthy"}},
        ),
    }
    if own_etcd:
        member = {
            **compose.etcd_service("./run"),
            "ports": _ports(etcd.CLIENT_PORT),
            "restart": "on-failure",
        }
        services = {"etcd": member, **services}
        services["merger"]["depends_on"]["etcd"] = {"condition": "service_healthy"}
    return {"name": "dloco-hub", "services": services}


def standby_compose(command: list[str]) -> dict:
    return {
        "name": "dloco-standby",
        "services": {
            # it exits if etcd is out of reach at its start: it tries again
            "standby": _service(
                command,
                ports=_ports(*FROM_STANDBY),
                stop_grace_period="60s",
                restart="on-failure",
            )
        },
    }


def region_compose(name: str, command: list[str]) -> dict:
    return {"name": f"dloco-{name}", "services": {name: _service(command)}}


def write(
    config: ClusterConfig,
    hub: str,
    out: Path,
    prepare,
    standby: str | None = None,
    etcd_urls: str = "",
) -> list[Path]:
    """The bundles of `config` for a hub reachable at `hub` (and a standby at `standby`), under
    OUT (refused if it exists; nothing is left there if writing fails); `prepare(config, run_dir)`
    makes every key, the allow-list and the initial model (cluster.launcher.prepare); the pair's
    lease in etcd at `etcd_urls` (default: an etcd member in the hub's bundle).  Returns the
    bundles' folders."""
    check(config, hub, standby, etcd_urls)
    if out.exists():
        raise ConfigError(f"deploy: {out} exists; give a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    # beside OUT, mode 0700 (it holds every secret key until the bundles are complete)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent)) / "bundles"
    try:
        names = _write(config, hub, staging, prepare, standby, etcd_urls)
        staging.rename(out)
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    return [out / name for name in names]


# Over 60 lines: the bundles in turn (hub, standby, each region), each its files and its README.
def _write(config, hub: str, out: Path, prepare, standby, etcd_urls: str) -> list[str]:
    """write's bundles into OUT; their folders' names."""
    config = real_hosts(config)
    own_etcd = config.merger.etcd and not etcd_urls
    lines = commands(config, hub, standby, etcd_urls if config.merger.etcd else "")
    slurm = slurm_commands(config, hub, standby)
    with tempfile.TemporaryDirectory() as scratch:
        made = Path(scratch) / "run"
        prepare(config, made)
        keys = made / "keys"
        hub_run = out / "hub" / "run"
        shutil.copytree(made, hub_run, ignore=_secrets_but(("broker", "merger", "evaluator")))
        _dump(hub_compose(lines, own_etcd), out / "hub" / "docker-compose.yml")
        (out / "hub" / "README.md").write_text(
            hub_readme(config, hub, standby, own_etcd, etcd_urls)
        )
        bundles = ["hub"]
        if standby:
            shutil.copytree(made, out / "standby" / "run", ignore=_secrets_but(("merger",)))
            (out / "standby" / "run" / "init.npz").unlink()
            _dump(standby_compose(lines["standby"]), out / "standby" / "docker-compose.yml")
            (out / "standby" / "README.md").write_text(
                standby_readme(hub, standby, etcd_urls, config.merger.etcd)
            )
            bundles.append("standby")
        for region in config.regions:
            bundle = out / region.name
            (bundle / "run" / "keys").mkdir(parents=True)
            (bundle / "run" / "metrics").mkdir()
            for key in (
                f"{region.name}.key_secret",
                f"{region.name}.key",
                "broker.key",
                "merger.key",
            ):
                shutil.copy2(keys / key, bundle / "run" / "keys" / key)
            (bundle / "run" / "keys").chmod(0o700)
            if region.hosts == 1:
                compose_file = region_compose(region.name, lines[region.name])
                _dump(compose_file, bundle / "docker-compose.yml")
            script = island_sbatch(region.name, slurm[region.name], region.hosts)
            (bundle / "island.sbatch").write_text(script)
            (bundle / "island.sbatch").chmod(0o755)
            readme = region_readme(region.name, hub, region.hosts, standby)
            (bundle / "README.md").write_text(readme)
            bundles.append(region.name)
    return bundles


def _secrets_but(own: Sequence[str]):
    """copytree's ignore: every secret key but those of `own` stays out of the bundle."""
    return lambda folder, names: [
        name
        for name in names
        if name.endswith(".key_secret") and name.removesuffix(".key_secret") not in own
    ]


def _dump(data: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))
