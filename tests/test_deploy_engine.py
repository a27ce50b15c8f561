"""`dloco deploy`'s bundles on a real Docker engine (-m e2e): the hub and two regions as separate
compose projects, each on a network of its own, the regions reaching the hub only through the
ports it publishes on this machine (as `host.docker.internal`).  The run trains to its budget,
both regions' deltas are folded; a region whose bundle holds another region's key is refused by
the hub and never folded.

Needs a Docker engine and the image `dloco:latest` (scripts/compose-smoke builds it; .ci/run
runs that first and sets DLOCO_REQUIRE_DOCKER, so that there a missing engine fails the test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from dloco.cluster import config as cluster_config
from dloco.cluster import deploy, launcher

HUB = "host.docker.internal"
# the islands reach the hub's published ports through the machine's gateway
OVERRIDE = "services:\n  {name}:\n    extra_hosts: ['host.docker.internal:host-gateway']\n"
# The budget counts every island's tokens: large enough that an island whose container starts
# late still trains a share of it.
CLUSTER = """
[run]
tokens = 393216
eval_every = 12
seed = 0

[model]
width = 32
depth = 1
heads = 2
context = 32
batch = 8

[sync]
fragments = 2
interval = 8

[merger]
outer_lr = 0.15
cold_wait_s = 0.0

[[regions]]
name = "us-east"

[[regions]]
name = "us-west"

[[regions]]
name = "victim"

[[regions]]
name = "rogue"
"""
# how long any one wait may take (a stuck engine fails the test rather than hanging it)
LIMIT_S = 900


def engine() -> str | None:
    """Why no engine and image can run bundles here, or None."""
    if shutil.which("docker") is None:
        return "no docker client"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return "no Docker engine running"
    image = subprocess.run(
        ["docker", "image", "inspect", "dloco:latest"], capture_output=True, timeout=60
    )
    return None if image.returncode == 0 else "no image dloco:latest (scripts/compose-smoke)"


@pytest.fixture(scope="module")
def compose():
    if (why := engine()) is not None:
        if os.environ.get("DLOCO_REQUIRE_DOCKER"):
            pytest.fail(f"a Docker engine is required here (DLOCO_REQUIRE_DOCKER) but: {why}")
        pytest.skip(why)
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    from tests.test_compose import compose_binary

    return [str(compose_binary())]


def up(compose, bundle, project: str) -> None:
    started = subprocess.run(
        [*compose, "-p", project, "up", "-d"],
        cwd=bundle,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert started.returncode == 0, started.stderr[-3000:]


def down(compose, bundles, projects: dict[str, str]) -> None:
    """Every project (bundle name -> project) torn down with its volumes."""
    for name, project in projects.items():
        subprocess.run(
            [*compose, "-p", project, "down", "--volumes", "--timeout", "30"],
            cwd=bundles / name,
            capture_output=True,
            timeout=LIMIT_S,
        )


def logs(compose, bundle, project: str, service: str) -> list[dict]:
    out = subprocess.run(
        [*compose, "-p", project, "logs", "--no-log-prefix", service],
        cwd=bundle,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def exited(compose, bundle, project: str, service: str) -> int | None:
    state = subprocess.run(
        [*compose, "-p", project, "ps", "--all", "--format", "{{.State}} {{.ExitCode}}", service],
        cwd=bundle,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    return int(state[1]) if state and state[0] == "exited" else None


# Over 60 lines: one run of three projects in its order: bundles, the hub, the regions, the rogue,
# then what the hub folded and refused, then tear-down.
@pytest.mark.e2e
@pytest.mark.timeout(2 * LIMIT_S)
def test_the_bundles_train_across_separate_projects_and_a_borrowed_key_is_refused(
    tmp_path, compose
):
    (tmp_path / "cluster.toml").write_text(CLUSTER)
    config = cluster_config.load(tmp_path / "cluster.toml")
    bundles = tmp_path / "bundles"
    deploy.write(config, HUB, bundles, launcher.prepare)
    # the rogue region presents the victim's key under its own name; the victim never starts (its
    # key's owner would be refused beside the impostor: a stolen key costs its owner too)
    keys = bundles / "rogue" / "run" / "keys"
    for suffix in (".key", ".key_secret"):
        shutil.copy2(
            bundles / "victim" / "run" / "keys" / f"victim{suffix}", keys / f"rogue{suffix}"
        )
    started = [r for r in config.regions if r.name != "victim"]
    projects = {"hub": f"dloco-hub-{os.getpid()}"}
    projects.update({r.name: f"dloco-{r.name}-{os.getpid()}" for r in started})
    try:
        up(compose, bundles / "hub", projects["hub"])
        for region in started:
            (bundles / region.name / "docker-compose.override.yml").write_text(
                OVERRIDE.format(name=region.name)
            )
            up(compose, bundles / region.name, projects[region.name])
        deadline = time.monotonic() + LIMIT_S
        honest = ("us-east", "us-west")
        while not all(exited(compose, bundles / n, projects[n], n) is not None for n in honest):
            assert time.monotonic() < deadline, "the islands did not reach the budget"
            time.sleep(5)
        assert [exited(compose, bundles / n, projects[n], n) for n in honest] == [0, 0]
        folds = [
            e
            for e in logs(compose, bundles / "hub", projects["hub"], "merger")
            if e.get("event") == "fold"
        ]
        contributors = {name for fold in folds for name in fold["contributors"]}
        assert {"us-east", "us-west"} <= contributors and "rogue" not in contributors
        refused = [
            e
            for e in logs(compose, bundles / "hub", projects["hub"], "broker")
            if e.get("event") == "message_refused"
        ]
        assert any(
            e["reason"] == "sender_mismatch" and e["claimed_sender"] == "rogue" for e in refused
        ), refused[-5:]
    finally:
        down(compose, bundles, projects)


STANDBY = "standby.docker.internal"
# every project reaches the others' published ports through the machine's gateway, by host name
GATEWAY = ["host.docker.internal:host-gateway", f"{STANDBY}:host-gateway"]
# etcd for the hub's bundle without a registry: Debian's etcd-server on the compose smoke's base
# image (DLOCO_ETCD_IMAGE names another, as it does for a user without gcr.io)
ETCD_IMAGE = "dloco-etcd:bookworm"
ETCD_DOCKERFILE = """FROM dloco-base:bookworm
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \\
    --no-install-recommends etcd-server etcd-client >/dev/null && rm -rf /var/lib/apt/lists/*
"""


def etcd_image() -> str:
    if image := os.environ.get("DLOCO_ETCD_IMAGE"):
        return image
    built = subprocess.run(
        ["docker", "build", "-q", "-t", ETCD_IMAGE, "-"],
        input=ETCD_DOCKERFILE,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return ETCD_IMAGE


def reach_all(bundle, services) -> None:
    """An override that lets `services` of `bundle` dial the hub and the standby by name."""
    override = {"services": {name: {"extra_hosts": GATEWAY} for name in services}}
    (bundle / "docker-compose.override.yml").write_text(json.dumps(override))


def events(compose, bundle, project, service, name) -> list[dict]:
    return [e for e in logs(compose, bundle, project, service) if e.get("event") == name]


# Over 60 lines: one run of four projects in its order (hub, standby, regions), the merger killed
# once it folds, the standby's takeover and folds after it, then tear-down.
@pytest.mark.e2e
@pytest.mark.timeout(2 * LIMIT_S)
def test_the_standby_on_a_second_hub_host_takes_over_through_the_hubs_etcd(
    tmp_path, compose, monkeypatch
):
    """`dloco deploy --standby-host`: the hub's bundle runs an etcd member beside the merger, the
    standby's bundle (a separate project, reaching the hub only through its published ports) follows
    the merger's log; the merger killed (-9) mid-run, the standby claims the lease in etcd, takes
    over, and both regions' deltas are folded by it until the islands reach their budget."""
    monkeypatch.setenv("DLOCO_ETCD_IMAGE", etcd_image())
    # two regions; four times the budget, so that the takeover comes early in the run
    two = CLUSTER.split('\n[[regions]]\nname = "victim"')[0]
    # a lease long enough that a loaded machine's stalls (seconds, four projects on two cores) do
    # not hand the lease over before the kill
    two = two.replace("cold_wait_s = 0.0", "cold_wait_s = 0.0\nstandby = true\nlease_s = 10.0")
    (tmp_path / "cluster.toml").write_text(two.replace("tokens = 393216", "tokens = 1572864"))
    config = cluster_config.load(tmp_path / "cluster.toml")
    bundles = tmp_path / "bundles"
    deploy.write(config, HUB, bundles, launcher.prepare, standby=STANDBY)
    reach_all(bundles / "hub", ["merger", "evaluator"])
    reach_all(bundles / "standby", ["standby"])
    honest = [r.name for r in config.regions]
    for name in honest:
        reach_all(bundles / name, [name])
    projects = {n: f"dloco-{n}-{os.getpid()}" for n in ["hub", "standby", *honest]}
    try:
        for name, project in projects.items():
            up(compose, bundles / name, project)
        hub = (compose, bundles / "hub", projects["hub"])
        standby = (compose, bundles / "standby", projects["standby"])
        deadline = time.monotonic() + LIMIT_S
        # the standby connected and caught up, as its primary says
        while len(events(*hub, "merger", "fold")) < 10 or not events(
            *hub, "merger", "standby_following"
        ):
            assert time.monotonic() < deadline, (
                "the merger did not fold with its standby following",
                [e.get("event") for e in logs(*hub, "merger")][-20:],
                logs(*standby, "standby")[-10:],
            )
            time.sleep(1)
        killed = subprocess.run(
            [*compose, "-p", projects["hub"], "kill", "merger"],
            cwd=bundles / "hub",
            capture_output=True,
            timeout=120,
        )
        assert killed.returncode == 0, killed.stderr
        while not all(exited(compose, bundles / n, projects[n], n) is not None for n in honest):
            assert time.monotonic() < deadline, "the islands did not reach the budget"
            time.sleep(5)
        assert [exited(compose, bundles / n, projects[n], n) for n in honest] == [0, 0]
        took = events(*standby, "standby", "taking_over")
        assert len(took) == 1 and "etcd_revision" in took[0], took
        # it took over the merger's whole log (replication is synchronous), then folded on from it
        assert took[0]["behind_records"] == 0 and took[0]["length"] > 10, took
        # each fragment's versions go on from the merger's last (which the standby may fold again
        # if the merger died before replicating it), not from the initial model
        last, first = {}, {}
        for e in events(*hub, "merger", "fold"):
            last[e["fragment"]] = max(last.get(e["fragment"], 0), e["version"])
        folds = events(*standby, "standby", "fold")
        for e in folds:
            first[e["fragment"]] = min(first.get(e["fragment"], e["version"]), e["version"])
        assert first and all(first[f] >= last[f] >= 2 for f in first), (last, first)
        assert {c for fold in folds for c in fold["contributors"]} == set(honest)
    finally:
        down(compose, bundles, projects)
