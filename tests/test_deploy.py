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

from dloco.cluster import config as cluster_config
from dloco.cluster import deploy, launcher
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
    assert published == set(deploy.PUBLISHED)
    for region in cluster_config.load().regions:
        (island,) = yaml.safe_load((bundles / region.name / "docker-compose.yml").read_text())[
            "services"
        ].values()
        dialled = {arg for arg in island["command"] if arg.startswith("tcp://")}
        assert dialled == {f"tcp://{HUB}:{port}" for port in deploy.PUBLISHED}
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


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda c: dataclasses.replace(c, merger=dataclasses.replace(c.merger, standby=True)),
            "standby",
        ),
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


def test_a_hub_that_is_not_a_host_and_a_folder_that_exists_are_refused(tmp_path):
    for hub in ("", "tcp://hub:5551", "hub:5551"):
        with pytest.raises(ConfigError, match="--hub"):
            deploy.write(cluster_config.load(), hub, tmp_path / "out", launcher.prepare)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists"):
        deploy.write(cluster_config.load(), HUB, tmp_path / "taken", launcher.prepare)
