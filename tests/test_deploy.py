"""`dloco deploy` (cluster/deploy.py): one cluster file as a bundle per host.  A region's bundle
holds its own secret key and the hub's public keys, nothing else; the hub's holds no island's
secret; the islands dial only the ports the hub publishes, in compose or under Slurm (a region of
several hosts is one job of a task per host); every compose file is one `docker compose` reads;
what cannot be placed yet is refused by name."""

from __future__ import annotations

import dataclasses
import shlex
import stat
import subprocess

import pytest
import yaml

from dloco.cluster import bundle_texts, deploy, launcher
from dloco.cluster import config as cluster_config
from dloco.protocol.errors import ConfigError
from tests.test_compose import compose_binary

HUB = "hub.example.org"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    out = tmp_path_factory.mktemp("deploy") / "bundles"
    deploy.write(cluster_config.load(), HUB, out, launcher.prepare)
    return out


def names(folder) -> set[str]:
    return {path.name for path in folder.iterdir()}


def test_a_region_holds_its_own_secret_and_the_hubs_public_keys_only(bundles):
    regions = [r.name for r in cluster_config.load().regions]
    assert names(bundles) == {"hub", *regions}
    for region in regions:
        keys = bundles / region / "run" / "keys"
        assert names(keys) == {f"{region}.key_secret", f"{region}.key", "broker.key", "merger.key"}
        assert stat.S_IMODE((keys / f"{region}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE(keys.stat().st_mode) == 0o700


def test_the_hub_holds_no_islands_secret_and_admits_each_island_by_name(bundles):
    regions = {r.name for r in cluster_config.load().regions}
    keys = names(bundles / "hub" / "run" / "keys")
    secrets = {name.removesuffix(".key_secret") for name in keys if name.endswith("_secret")}
    assert secrets == {"broker", "merger", "evaluator"}
    assert {f"{r}.key" for r in regions} <= keys
    allowed = names(bundles / "hub" / "run" / "allow" / "island")
    assert allowed == {f"{r}.key" for r in regions}
    assert (bundles / "hub" / "run" / "init.npz").exists()


def test_islands_dial_only_the_ports_the_hub_publishes(bundles):
    hub = yaml.safe_load((bundles / "hub" / "docker-compose.yml").read_text())
    published = {
        port.split(":")[0]
        for service in hub["services"].values()
        for port in service.get("ports", [])
    }
    assert published == set(bundle_texts.PUBLISHED)
    for region in cluster_config.load().regions:
        (island,) = yaml.safe_load((bundles / region.name / "docker-compose.yml").read_text())[
            "services"
        ].values()
        dialled = {arg for arg in island["command"] if arg.startswith("tcp://")}
        assert dialled == {f"tcp://{HUB}:{port}" for port in bundle_texts.PUBLISHED}
        # a real host: no emulated link, no sleep
        command = island["command"]
        assert "--uplink-mbps" not in command and command[command.index("--slowdown") + 1] == "1.0"
        # the same island under Slurm: the same endpoints, its group from Slurm's environment
        script = (bundles / region.name / "island.sbatch").read_text()
        (srun,) = [line for line in script.splitlines() if line.startswith("exec srun ")]
        words = shlex.split(srun)
        assert {arg for arg in words if arg.startswith("tcp://")} == dialled
        assert words[words.index("--coordinator") + 1] == "slurm" and "--process-id" not in words
        assert "#SBATCH --ntasks=1" in script and words[3:5] == ["dloco", "island"]


def test_a_region_of_several_hosts_is_one_slurm_job_of_a_task_per_host(tmp_path):
    config = cluster_config.load()
    first = dataclasses.replace(config.regions[0], hosts=4)
    config = dataclasses.replace(config, regions=(first, *config.regions[1:]))
    deploy.write(config, HUB, tmp_path / "out", launcher.prepare)
    bundle = tmp_path / "out" / first.name
    assert names(bundle) == {"run", "island.sbatch", "README.md"}
    script = (bundle / "island.sbatch").read_text()
    words = shlex.split(script.splitlines()[-1])
    assert "#SBATCH --ntasks=4" in script and "--num-processes" not in words
    assert words[words.index("--coordinator") + 1] == "slurm"
    assert words[words.index("--metrics-out") + 1] == f"run/metrics/{first.name}.jsonl"
    assert "sbatch island.sbatch" in (bundle / "README.md").read_text()


def test_every_bundle_is_a_compose_file_docker_compose_reads(bundles):
    binary = compose_binary()
    for bundle in bundles.iterdir():
        checked = subprocess.run(
            [binary, "-f", bundle / "docker-compose.yml", "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=bundle,
        )
        assert checked.returncode == 0, (bundle.name, checked.stderr)
        assert f"`{HUB}`" in (bundle / "README.md").read_text()


STANDBY = "hub2.example.org"


def with_standby(failover: str = "etcd"):
    config = cluster_config.load()
    merger = dataclasses.replace(config.merger, standby=True, failover=failover)
    return dataclasses.replace(config, merger=merger)


def services(bundle) -> dict:
    return yaml.safe_load((bundle / "docker-compose.yml").read_text())["services"]


def published(bundle) -> set[str]:
    return {p.split(":")[0] for s in services(bundle).values() for p in s.get("ports", [])}


def endpoints(command: list[str]) -> set[str]:
    return {e for arg in command if arg.startswith("tcp://") for e in arg.split(",")}


def urls(command: list[str]) -> set[str]:
    return {e for arg in command if arg.startswith("http://") for e in arg.split(",")}


def test_a_standby_host_holds_the_mergers_secret_only_and_everyone_dials_both_mergers(tmp_path):
    """The standby's bundle: the merger's secret key (it speaks as the merger) and public keys
    only, no initial model; the hub runs etcd and publishes what the standby dials; the standby
    publishes its control port (islands, evaluator) and its replication port (the merger)."""
    config = with_standby()
    deploy.write(config, HUB, tmp_path / "out", launcher.prepare, standby=STANDBY)
    out = tmp_path / "out"
    regions = [r.name for r in config.regions]
    assert names(out) == {"hub", "standby", *regions}
    keys = names(out / "standby" / "run" / "keys")
    assert {k for k in keys if k.endswith("_secret")} == {"merger.key_secret"}
    assert not (out / "standby" / "run" / "init.npz").exists()
    hub = services(out / "hub")
    assert list(hub) == ["etcd", "broker", "merger", "evaluator"]
    assert hub["merger"]["depends_on"]["etcd"] == {"condition": "service_healthy"}
    # every port a process of another host dials is published by the bundle of the host it names,
    # and bound there by the service that publishes it
    where = {HUB: out / "hub", STANDBY: out / "standby"}
    for bundle in [out / "hub", out / "standby", *(out / r for r in regions)]:
        for service in services(bundle).values():
            for endpoint in endpoints(service["command"]) | urls(service["command"]):
                host, port = endpoint.split("://")[1].split(":")
                if host in where:
                    assert port in published(where[host]), (bundle.name, endpoint)
    for bundle in where.values():
        for service in services(bundle).values():
            bound = {arg.rpartition(":")[2] for arg in service["command"] if "://*:" in arg}
            bound |= {a.rpartition(":")[2] for a in service["command"] if "0.0.0.0" in a}
            assert {p.split(":")[0] for p in service.get("ports", [])} <= bound, service
    assert published(out / "standby") == {"5561", "5563"}
    (standby,) = services(out / "standby").values()
    command = standby["command"]
    assert endpoints(command) == {f"tcp://{HUB}:{p}" for p in ("5552", "5553", "5562")}
    assert command[command.index("--etcd") + 1] == f"http://{HUB}:2379"
    merger = hub["merger"]["command"]
    assert merger[merger.index("--peer") + 1] == f"tcp://{STANDBY}:5563"
    assert merger[merger.index("--etcd") + 1] == "http://etcd:2379"
    both = {f"tcp://{HUB}:5560", f"tcp://{STANDBY}:5561"}
    for region in regions:
        (island,) = services(out / region).values()
        assert endpoints(island["command"]) == {f"tcp://{HUB}:5551", f"tcp://{HUB}:5554", *both}
        assert STANDBY in (out / region / "README.md").read_text()
    assert f"tcp://{STANDBY}:5561" in endpoints(hub["evaluator"]["command"])
    assert f"{HUB}:2379" in (out / "standby" / "README.md").read_text()
    assert "no authentication" in (out / "hub" / "README.md").read_text()
    binary = compose_binary()
    for bundle in ("hub", "standby"):
        checked = subprocess.run(
            [binary, "-f", out / bundle / "docker-compose.yml", "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=out / bundle,
        )
        assert checked.returncode == 0, (bundle, checked.stderr)


def test_an_etcd_of_your_own_replaces_the_hubs_member_and_lease_failover_needs_none(tmp_path):
    urls = "http://etcd-a:2379,http://etcd-b:2379"
    deploy.write(with_standby(), HUB, tmp_path / "own", launcher.prepare, STANDBY, urls)
    hub = services(tmp_path / "own" / "hub")
    assert "etcd" not in hub and "2379" not in published(tmp_path / "own" / "hub")
    (standby,) = services(tmp_path / "own" / "standby").values()
    for command in (hub["merger"]["command"], standby["command"]):
        assert command[command.index("--etcd") + 1] == urls
        # its keys apart from any other deployment's in that etcd
        assert command[command.index("--etcd-prefix") + 1] == f"/dloco/{HUB}/merger"
    assert "etcd-a:2379" in (tmp_path / "own" / "hub" / "README.md").read_text()
    deploy.write(with_standby("lease"), HUB, tmp_path / "lease", launcher.prepare, STANDBY)
    hub = services(tmp_path / "lease" / "hub")
    assert "etcd" not in hub and "--etcd" not in hub["merger"]["command"]
    assert "prefer etcd" in (tmp_path / "lease" / "standby" / "README.md").read_text()


@pytest.mark.parametrize(
    ("config", "standby", "named"),
    [
        (with_standby, None, "--standby-host"),
        (with_standby, HUB, "the hub's"),
        (with_standby, HUB.upper() + ".", "the hub's"),
        (with_standby, "hub2:5561", "--standby-host must be a host"),
        (with_standby, "hub2,hub3", "--standby-host must be a host"),
        (cluster_config.load, STANDBY, "no \\[merger\\] standby"),
    ],
)
def test_a_standby_without_a_host_of_its_own_is_refused(tmp_path, config, standby, named):
    with pytest.raises(ConfigError, match=named):
        deploy.write(config(), HUB, tmp_path / "out", launcher.prepare, standby=standby)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("failover", "urls", "named"),
    [
        ("etcd", "etcd-a:2379", "http://HOST:PORT"),
        ("etcd", "http://a:2379,", "http://HOST:PORT"),
        ("lease", "http://a:2379", "failover = 'lease'"),
        ("etcd", "http://127.0.0.1:2379", "this host's own"),
        ("etcd", "http://localhost:2379", "this host's own"),
    ],
)
def test_an_etcd_given_wrong_or_without_use_is_refused(tmp_path, failover, urls, named):
    with pytest.raises(ConfigError, match=named):
        deploy.write(with_standby(failover), HUB, tmp_path / "out", launcher.prepare, STANDBY, urls)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda c: dataclasses.replace(c, merger=dataclasses.replace(c.merger, shards=2)),
            "shards",
        ),
        (lambda c: dataclasses.replace(c, network="netns"), "netns"),
        (
            lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, corpus="/x")),
            "corpus",
        ),
    ],
)
def test_what_cannot_be_placed_yet_is_refused_by_name(tmp_path, change, named):
    with pytest.raises(ConfigError, match=named):
        deploy.write(change(cluster_config.load()), HUB, tmp_path / "out", launcher.prepare)
    assert not (tmp_path / "out").exists()


def test_a_region_named_as_a_bundle_is_refused_and_a_failed_write_leaves_nothing(tmp_path):
    config = cluster_config.load()
    hub = dataclasses.replace(config.regions[0], name="hub")
    with pytest.raises(ConfigError, match="region named hub"):
        deploy.write(
            dataclasses.replace(config, regions=(hub, *config.regions[1:])),
            HUB,
            tmp_path / "out",
            launcher.prepare,
        )

    # the last region's key lost after the hub's and the first regions' bundles were written
    def losing(config, run_dir):
        launcher.prepare(config, run_dir)
        (run_dir / "keys" / f"{config.regions[-1].name}.key_secret").unlink()

    with pytest.raises(FileNotFoundError, match="key_secret"):
        deploy.write(config, HUB, tmp_path / "out", losing)
    assert list(tmp_path.iterdir()) == []


def test_a_hub_that_is_not_a_host_and_a_folder_that_exists_are_refused(tmp_path):
    for hub in ("", "tcp://hub:5551", "hub:5551", "a,b", "hub name"):
        with pytest.raises(ConfigError, match="--hub"):
            deploy.write(cluster_config.load(), hub, tmp_path / "out", launcher.prepare)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists"):
        deploy.write(cluster_config.load(), HUB, tmp_path / "taken", launcher.prepare)
