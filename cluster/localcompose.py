"""A compose file read back into local process specs, so the same file's commands, environment,
health checks and dependencies run on a machine without a Docker engine (`dloco up --compose
FILE`; cluster.launcher runs them).

Reading understands the subset of the compose specification that cluster.compose renders (command
and healthcheck lists, environment, volumes, depends_on conditions, `${VAR:-default}`
interpolation) and refuses anything else by name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from pathlib import Path

import yaml

from dloco.protocol.errors import ConfigError, require

_VARIABLE = re.compile(
    r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)"
)


def interpolate(text: str, env: dict[str, str]) -> str:
    """`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `$VAR` and `$$` as compose reads them."""

    def value(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(3)
        if name in env and (env[name] != "" or ":-" not in match.group(0)):
            return env[name]
        return match.group(2) or ""

    return _VARIABLE.sub(value, text)


@dataclasses.dataclass(frozen=True)
class Service:
    """A process to start on this machine, and what it waits for."""

    command: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # a command that exits 0 when the service is healthy
    health: list[str] | None = None
    health_interval_s: float = 2.0
    health_retries: int = 60
    # service -> condition
    depends: dict[str, str] = dataclasses.field(default_factory=dict)
    # runs to completion before its dependents start (prepare)
    one_shot: bool = False
    # a CPU quota in cores (compose's `cpus`; cluster.cpuquota)
    cpus: float | None = None


# `logging` is Docker's log driver: run locally, each process bounds its own log file instead.
_KNOWN = {
    "image",
    "build",
    "command",
    "environment",
    "volumes",
    "depends_on",
    "healthcheck",
    "stop_grace_period",
    "cpus",
    "ports",
    "logging",
}
_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", str(text))
    require(match is not None, f"compose duration {text!r}: expected e.g. 2s")
    return float(match.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60}[match.group(2)]


def _cpus(value, command: list, where: str) -> float | None:
    """compose's `cpus` (a number or a numeric string) as cores, or None when absent.  Run locally,
    a quota applies to islands only (they enter it after compiling: island/cpugroup.py)."""
    if value is None:
        return None
    require(
        command[:2] == ["dloco", "island"],
        f"{where}: cpus is applied to `dloco island` services only when run locally",
    )
    try:
        if isinstance(value, bool):
            raise TypeError(value)
        cores = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cpus must be a number of cores, got {value!r}") from None
    require(0 < cores < float("inf"), f"{where}: cpus must be > 0, got {value!r}")
    return cores


def _localize(
    args: list,
    env: dict[str, str],
    mounts: list[tuple[str, str]],
    hosts: list[str],
    program: list[str],
) -> list[str]:
    """Interpolate; container paths -> host paths (longest mount first); tcp://HOST: and a
    --coordinator HOST:PORT -> loopback; dloco -> program."""
    out = []
    for arg in (interpolate(str(a), env) for a in args):
        # a multi-host island's process 0
        if out and out[-1] == "--coordinator" and arg.rpartition(":")[0] in hosts:
            arg = "127.0.0.1:" + arg.rpartition(":")[2]
        for container, host in sorted(mounts, key=lambda m: -len(m[0])):
            if arg == container or arg.startswith(container + "/"):
                arg = host + arg[len(container) :]
                break
        for other in hosts:
            arg = arg.replace(f"tcp://{other}:", "tcp://127.0.0.1:")
        # a container's every interface: this machine's loopback
        arg = "127.0.0.1" if arg == "0.0.0.0" else arg
        out.append(arg)
    return program + out[1:] if out and out[0] == "dloco" else out


def dloco_program() -> list[str]:
    """This Python running the `dloco` command line, whatever the working directory: `-P` keeps
    the directory out of the import path, so a folder there named `dloco` (a checkout's, a
    container's WORKDIR) cannot shadow the installed package."""
    return [sys.executable, "-P", "-m", "dloco"]


def load(path: Path, env: dict[str, str], program: list[str] | None = None) -> dict[str, Service]:
    """The compose file's services as local processes: `dloco` becomes this Python's `-m dloco`,
    container paths of volumes become their host paths, service names and `*` become 127.0.0.1."""
    program = program or dloco_program()
    env = {**os.environ, **env}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read compose file {path}: {error}") from None
    require(
        isinstance(data, dict) and isinstance(data.get("services"), dict), f"{path}: no services"
    )
    # A service of a profile (monitoring: Prometheus, Grafana) starts only when asked for, under
    # docker compose.
    chosen = {
        name: spec
        for name, spec in data["services"].items()
        if not (isinstance(spec, dict) and spec.get("profiles"))
    }
    services = {
        name: _service(path, name, spec, env, list(chosen), program)
        for name, spec in chosen.items()
    }
    for name, service in services.items():
        for other, condition in service.depends.items():
            require(
                condition != "service_healthy" or services[other].health is not None,
                f"{path}: service {name} waits for {other} to be healthy, but {other} has no"
                " healthcheck",
            )
    # what others wait to complete is a one-shot job
    for service in list(services.values()):
        for other, condition in service.depends.items():
            if condition == "service_completed_successfully":
                services[other] = dataclasses.replace(services[other], one_shot=True)
    return services


def _service(
    path: Path, name: str, spec: dict, env: dict[str, str], names: list[str], program: list[str]
) -> Service:
    """One service of the file as a local process (`names`: every service the file runs)."""
    where = f"{path}: service {name}"
    unknown = set(spec) - _KNOWN
    require(not unknown, f"{where}: keys the local runner does not understand: {sorted(unknown)}")
    mounts = []
    for volume in spec.get("volumes", []):
        host, container = interpolate(volume, env).split(":")[:2]
        mounts.append((container, str((path.parent / host).resolve())))

    localize = functools.partial(
        _localize, env=env, mounts=mounts, hosts=[*names, "*"], program=program
    )
    command = spec.get("command")
    require(isinstance(command, list) and command, f"{where}: command must be a non-empty list")
    environment = spec.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    health, interval, retries = None, 2.0, 60
    if "healthcheck" in spec:
        check = spec["healthcheck"]
        test = check.get("test", [])
        require(
            isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"),
            f"{where}: healthcheck.test must be [CMD, ...]",
        )
        health = localize(test[1:]) if test[0] == "CMD" else ["sh", "-c", interpolate(test[1], env)]
        interval, retries = _seconds(check.get("interval", "2s")), int(check.get("retries", 60))
    return Service(
        localize(command),
        {k: interpolate(str(v), env) for k, v in environment.items()},
        health,
        interval,
        retries,
        _conditions(path, name, spec.get("depends_on", {}), names),
        cpus=_cpus(spec.get("cpus"), command, where),
    )


def _conditions(path: Path, name: str, depends: dict | list, names: list[str]) -> dict[str, str]:
    """A service's depends_on (a list, or a map with conditions) as service -> condition."""
    if isinstance(depends, list):
        depends = {other: {"condition": "service_started"} for other in depends}
    conditions = {}
    for other, rule in depends.items():
        require(other in names, f"{path}: service {name} depends on unknown service {other!r}")
        conditions[other] = rule.get("condition", "service_started")
        require(
            conditions[other] in _CONDITIONS,
            f"{path}: service {name}: unknown condition {conditions[other]!r}",
        )
    return conditions


def start_order(services: dict[str, Service], wanted: list[str] | None = None) -> list[str]:
    """Dependencies first (as `docker compose up [SERVICE...]`: what is named, and what it
    needs)."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        require(name in services, f"unknown service {name!r}; the file has: {', '.join(services)}")
        require(name not in path, f"dependency cycle: {' -> '.join((*path, name))}")
        if name in order:
            return
        for other in services[name].depends:
            visit(other, (*path, name))
        order.append(name)

    for name in wanted or list(services):
        visit(name, ())
    return order


def port_variables(text: str) -> list[str]:
    """Every DLOCO_..._PORT... variable a compose file interpolates (a local run gives each a free
    port)."""
    return sorted(set(re.findall(r"\$\{(DLOCO_[A-Z0-9_]*PORT[A-Z0-9_]*)", text)))
