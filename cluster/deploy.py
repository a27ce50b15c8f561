"""`dloco deploy`: one cluster file as bundles for separate hosts.  A bundle is a folder to copy to
its host and start there with `docker compose up -d`:

- `hub/`: the broker, the merger and the evaluator, with the secret keys of those three, every
  island's public key (the allow-list, by role) and the initial model.  It publishes three ports,
  the only ones any other host dials: the delta bus's input, the snapshot bus's output and the
  merger's control ROUTER.
- one folder per region: that region's island, its own secret key and the hub's public keys, and
  nothing else: a region host never holds another's secret.  Islands only dial out, so a region
  behind NAT works.  Beside its compose file, `island.sbatch` runs the island under Slurm instead:
  one task per host of the region (`[[regions]] hosts`), one jax.distributed program whose
  coordinator each task takes from Slurm's environment (`--coordinator slurm`).  A region of
  several hosts gets the Slurm script only.

Real hosts have real links and real speeds: the profile's emulated links and slowdowns stay
behind.  Each bundle's README says what to copy where, which ports must be reachable, how to start
it and how to check it (`dloco probe`).  A cluster this cannot place yet is refused, naming why:
a hot standby, merger shards, a network of namespaces, or inputs (a task file, a corpus, a token
file) that would have to travel with a bundle.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from dloco.cluster import topology
from dloco.cluster.config import ClusterConfig
from dloco.protocol.errors import ConfigError, require

# inside every container: the bundle's run/ folder
RUN = "/dloco/run"
# delta in, delta out, snapshot in, snapshot out; the merger's control ROUTER
BROKER_PORTS = ("5551", "5552", "5553", "5554")
CONTROL_PORT = "5560"
# the ports other hosts dial: the islands' deltas in, snapshots out, catch-up and acks
PUBLISHED = {
    BROKER_PORTS[0]: "delta bus (islands publish)",
    BROKER_PORTS[3]: "snapshot bus (islands subscribe)",
    CONTROL_PORT: "the merger's control (acks, resends, catch-up)",
}
HUB_SERVICES = ("broker", "merger", "evaluator")
ENVIRONMENT = {"PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
LOGGING = {"driver": "json-file", "options": {"max-size": "64m", "max-file": "5"}}


def check(config: ClusterConfig) -> None:
    """Refuse what this cannot place on separate hosts yet, naming it."""
    merger = config.merger
    require(not merger.standby, "deploy: a hot standby ([merger] standby) is not placed yet")
    require(merger.shards == 1, "deploy: merger shards ([merger] shards > 1) are not placed yet")
    require(config.network == "loopback", "deploy: run.network = netns is for one machine")
    model = config.model
    require(
        not (model.corpus or model.tokens or model.task.partition(":")[0].endswith(".py")),
        "deploy: a task file, corpus or token file would have to travel with every bundle; the"
        " image's built-in LM on its own standard library sources is placed",
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


def commands(config: ClusterConfig, hub: str) -> dict[str, list[str]]:
    """Every process's `dloco` arguments: the hub's reaching each other by service name, the
    islands the hub at `hub`."""
    inside = topology.Addresses(
        BROKER_PORTS, CONTROL_PORT, broker_host="broker", merger_host="merger", bind_host="*"
    )
    outside = topology.Addresses(BROKER_PORTS, CONTROL_PORT, broker_host=hub, merger_host=hub)
    hub_commands = topology.commands(one_command_each(config), inside, RUN)
    island_commands = topology.commands(one_command_each(config), outside, RUN)
    return {
        **{name: hub_commands[name] for name in HUB_SERVICES},
        **{r.name: island_commands[r.name] for r in config.regions},
    }


def slurm_commands(config: ClusterConfig, hub: str) -> dict[str, list[str]]:
    """Each region's island as one command line for every task of an srun step: paths under the
    bundle's run/ (a Slurm job runs in the folder it was submitted from), the group taken from
    Slurm's environment instead of a coordinator, a count and an index per host."""
    outside = topology.Addresses(BROKER_PORTS, CONTROL_PORT, broker_host=hub, merger_host=hub)
    lines = topology.commands(one_command_each(config), outside, "run")
    return {r.name: [*lines[r.name], "--coordinator", "slurm"] for r in config.regions}


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


def _service(command: list[str], **extra) -> dict:
    return {
        "image": "dloco:latest",
        "command": ["dloco", *command],
        "environment": dict(ENVIRONMENT),
        "volumes": [f"./run:{RUN}"],
        "logging": LOGGING,
        **extra,
    }


def hub_compose(commands: dict[str, list[str]]) -> dict:
    probe = ["CMD", "dloco", "probe"]
    return {
        "name": "dloco-hub",
        "services": {
            "broker": _service(
                commands["broker"],
                ports=[f"{p}:{p}" for p in (BROKER_PORTS[0], BROKER_PORTS[3])],
                healthcheck={"test": [*probe, f"tcp://127.0.0.1:{BROKER_PORTS[0]}"]},
            ),
            "merger": _service(
                commands["merger"],
                ports=[f"{CONTROL_PORT}:{CONTROL_PORT}"],
                depends_on={"broker": {"condition": "service_healthy"}},
                healthcheck={"test": [*probe, f"tcp://127.0.0.1:{CONTROL_PORT}"]},
                stop_grace_period="60s",
            ),
            "evaluator": _service(
                commands["evaluator"], depends_on={"merger": {"condition": "service_healthy"}}
            ),
        },
    }


def region_compose(name: str, command: list[str]) -> dict:
    return {"name": f"dloco-{name}", "services": {name: _service(command)}}


def write(config: ClusterConfig, hub: str, out: Path, prepare) -> list[Path]:
    """The bundles of `config` for a hub reachable at `hub`, under OUT (refused if it exists);
    `prepare(config, run_dir)` makes every key, the allow-list and the initial model
    (cluster.launcher.prepare).  Returns the bundles' folders."""
    check(config)
    require(
        bool(hub) and "/" not in hub and ":" not in hub,
        f"deploy: --hub must be a host, got {hub!r}",
    )
    if out.exists():
        raise ConfigError(f"deploy: {out} exists; give a new folder")
    config = real_hosts(config)
    lines, slurm = commands(config, hub), slurm_commands(config, hub)
    with tempfile.TemporaryDirectory() as scratch:
        made = Path(scratch) / "run"
        prepare(config, made)
        keys = made / "keys"
        hub_run = out / "hub" / "run"
        shutil.copytree(made, hub_run, ignore=_region_secrets(config))
        _dump(hub_compose(lines), out / "hub" / "docker-compose.yml")
        (out / "hub" / "README.md").write_text(hub_readme(config, hub))
        bundles = [out / "hub"]
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
                compose = region_compose(region.name, lines[region.name])
                _dump(compose, bundle / "docker-compose.yml")
            script = island_sbatch(region.name, slurm[region.name], region.hosts)
            (bundle / "island.sbatch").write_text(script)
            (bundle / "island.sbatch").chmod(0o755)
            (bundle / "README.md").write_text(region_readme(region.name, hub, region.hosts))
            bundles.append(bundle)
    return bundles


def _region_secrets(config: ClusterConfig):
    """copytree's ignore: the islands' secret keys stay out of the hub's bundle."""
    secrets = {f"{r.name}.key_secret" for r in config.regions}
    return lambda folder, names: [name for name in names if name in secrets]


def _dump(data: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))


def hub_readme(config: ClusterConfig, hub: str) -> str:
    ports = "\n".join(f"- {port}/tcp: {what}" for port, what in PUBLISHED.items())
    regions = ", ".join(r.name for r in config.regions)
    return f"""# The hub: broker, merger, evaluator

Copy this folder to the hub host, `{hub}`, build the image there from a checkout of dloco
(`docker build -t dloco:latest .`), then:

    docker compose up -d

The islands ({regions}) dial these ports of `{hub}`; open them to the regions' hosts:

{ports}

Nothing else needs to be reachable: islands only connect out. `run/keys` holds the secret keys of
the broker, the merger and the evaluator, and every island's public key; `run/allow` names each
public key's role. The merger's log and checkpoints grow in `run/merger`.

Check it: `docker compose ps` (the broker healthy), then from any host
`dloco probe tcp://{hub}:{BROKER_PORTS[0]} tcp://{hub}:{CONTROL_PORT}`.
"""


def region_readme(name: str, hub: str, hosts: int = 1) -> str:
    compose = (
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
    start = compose if hosts == 1 else slurm
    return f"""# Region {name}: its island

{start}

The island dials the hub `{hub}` on ports {", ".join(PUBLISHED)} (it only connects out: a host
behind NAT works). `run/keys` holds this region's secret key alone, and the hub's public keys; the
hub admits it under the name `{name}` only.

Check it: `dloco probe tcp://{hub}:{BROKER_PORTS[0]}` from this host reaches the hub; after the
island has joined, `dloco probe run/metrics/{name}.jsonl --max-age 120` says it is training.
"""
