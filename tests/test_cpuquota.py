"""CPU quotas for islands (run.island_cpus): the quota arithmetic and the mount table by hand, the
kernel's enforcement with real processes in real cgroups (where this process may create them: root
with a cgroup CPU controller, as on the project's machines and CI), and the cluster file, topology
and compose rendering that carry the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dloco.analysis.report import read_exit_codes
from dloco.analysis.runinfo import read_events
from dloco.cluster import compose, config, cpuquota, localcompose, sections, topology
from dloco.cluster.cpuquota import Controller, CpuQuotaError, find_controller, quota_us
from dloco.island.cpugroup import CpuGroup, CpuGroupError
from dloco.protocol.errors import ConfigError
from tests.cluster_helpers import small_profile

V1 = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
28 25 0:25 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
"""
V2 = """\
22 1 0:5 / /proc rw - proc proc rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate
"""


def test_quota_is_cores_times_the_period():
    assert [quota_us(c) for c in (0.45, 0.225, 1, 2.5)] == [45_000, 22_500, 100_000, 250_000]
    assert quota_us(0.5, period_us=200_000) == 100_000
    assert quota_us(0.01) == cpuquota.MIN_QUOTA_US
    for bad in (0, -1, float("nan"), float("inf"), 0.005):
        with pytest.raises(ValueError, match="cores"):
            quota_us(bad)


def test_the_cpu_controller_is_found_in_the_mount_table():
    # v1: the hierarchy whose options name cpu (here co-mounted with cpuacct); groups nest under
    # this process's own
    assert find_controller(
        V1,
        "12:cpuset:/\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n",
        {"/sys/fs/cgroup/unified": ""},
    ) == Controller(1, Path("/sys/fs/cgroup/cpu,cpuacct"), "docker/abc")
    # v1 holds cpu, so the v2 mount lists no controllers; even if it did, v1 wins
    assert (
        find_controller(V1, "4:cpu,cpuacct:/\n", {"/sys/fs/cgroup/unified": "cpu io"}).version == 1
    )
    # v2 only: the mount root, where cgroup.controllers lists cpu (no v2 group with processes may
    # hand it on)
    assert find_controller(
        V2, "0::/user.slice/session-1.scope\n", {"/sys/fs/cgroup": "cpuset cpu io memory pids\n"}
    ) == Controller(2, Path("/sys/fs/cgroup"), "")
    # no CPU controller
    assert find_controller(V2, "0::/\n", {"/sys/fs/cgroup": "memory pids"}) is None
    assert find_controller("", "", {}) is None
    # a container's view of v1: the mount shows only the container's subtree of the hierarchy
    inside = (
        "27 25 0:24 /docker/abc /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    )
    assert find_controller(inside, "4:cpu,cpuacct:/docker/abc\n", {}) == Controller(
        1, Path("/sys/fs/cgroup/cpu"), ""
    )
    assert find_controller(inside, "4:cpu,cpuacct:/docker/abc/job\n", {}).parent == "job"
    # mountinfo escapes a space as \040
    spaced = "27 25 0:24 / /mnt/my\\040cgroups rw - cgroup cgroup rw,cpu\n"
    assert find_controller(spaced, "", {}).mount == Path("/mnt/my cgroups")


def test_no_controller_is_a_clear_error():
    with pytest.raises(CpuQuotaError, match="island_cpus = 0"):
        cpuquota.CpuQuotas(None, "dloco-test")


def test_exit_codes_are_read_back_from_the_report(tmp_path):
    """report.md's tables as write_report lays them out; region names may look like column names."""
    (tmp_path / "report.md").write_text(
        "\n".join(
            [
                "# dloco run report",
                "",
                "Run directory: `x`; mode `decoupled`; 2 regions; planned length 240 s.",
                "",
                "## Islands",
                "",
                "| region | slowdown | exit |",
                "|---|---|---|",
                "| region-a | 1.0 | 0 |",
                "| folds1 | 2.0 (0.225-core quota) | -9 |",
                "",
                "## Global model (the merger's)",
                "",
                "| folds | fragment versions | merger exit | broker exit |",
                "|---|---|---|---|",
                "| 3 | {0: 3} | 0 | None |",
                "",
                "## Chaos",
                "",
                "| at | action | target |",
                "|---|---|---|",
                "| 60 | kill | folds1 |",
            ]
        )
    )
    assert read_exit_codes(tmp_path) == (
        240.0,
        {"region-a": 0, "folds1": -9, "merger": 0, "broker": None},
    )
    (tmp_path / "report.md").write_text(
        "## Islands\n\n| region | exit |\n|---|---|\n| a | zero |\n"
    )
    with pytest.raises(ConfigError, match="'zero' is not an exit status"):
        read_exit_codes(tmp_path)


def test_a_directory_that_is_not_a_cgroup_is_refused(tmp_path):
    with pytest.raises(CpuGroupError, match="not a cgroup"):
        CpuGroup(tmp_path)


def test_island_cpus_in_the_cluster_file(tmp_path):
    regions = '[[regions]]\nname = "fast"\n[[regions]]\nname = "slow"\nslowdown = 2.0\n'
    path = tmp_path / "c.toml"
    path.write_text(
        small_profile(20, 10, regions).replace(
            "eval_every = 10", "eval_every = 10\nisland_cpus = 0.45"
        )
    )
    capped = config.load(path)
    assert [capped.cpus_of(r) for r in capped.regions] == [0.45, 0.225]
    # the shipped profile: slow regions sleep
    uncapped = config.load()
    assert uncapped.island_cpus == 0 and {uncapped.cpus_of(r) for r in uncapped.regions} == {None}
    for value, message in (
        ("-1", "island_cpus must be a number of cores >= 0"),
        ("'half'", "island_cpus must be"),
        ("true", "island_cpus must be"),
        ("0.015", "region slow .*kernel's minimum"),
    ):
        path.write_text(
            small_profile(20, 10, regions).replace(
                "eval_every = 10", f"eval_every = 10\nisland_cpus = {value}"
            )
        )
        with pytest.raises(ConfigError, match=message):
            config.load(path)


def test_a_capped_island_is_slowed_by_its_quota_not_by_sleeping():
    regions = (sections.Region("fast"), sections.Region("slow", slowdown=2.0))
    at = topology.Addresses(("1", "2", "3", "4"), "5")

    def slowdowns(cluster):
        commands = topology.commands(cluster, at, "/run")
        return [commands[r.name][commands[r.name].index("--slowdown") + 1] for r in regions]

    assert slowdowns(config.ClusterConfig(regions)) == ["1.0", "2.0"]
    assert slowdowns(config.ClusterConfig(regions, island_cpus=0.5)) == ["1.0", "1.0"]


def test_compose_carries_the_quota_as_cpus(tmp_path):
    cluster = config.ClusterConfig(
        (sections.Region("fast"), sections.Region("slow", slowdown=2.0)), island_cpus=0.5
    )
    path = tmp_path / "docker-compose.yml"
    path.write_text(compose.render(cluster, "cluster.toml"))
    services = localcompose.load(path, {})
    assert {name: s.cpus for name, s in services.items()} == {
        "prepare": None,
        "broker": None,
        "merger": None,
        "fast": 0.5,
        "slow": 0.25,
        "evaluator": None,
        "status": None,
    }
    assert "cpus" not in compose.render(config.ClusterConfig(cluster.regions), "cluster.toml")
    text = path.read_text()
    for broken, message in (
        (text.replace("cpus: 0.25", "cpus: lots"), "cpus must be a number"),
        (text.replace("cpus: 0.25", "cpus: 0"), "cpus must be > 0"),
        (text.replace("cpus: 0.25", "cpus: true"), "cpus must be a number"),
        (
            text.replace(
                "    stop_grace_period: 60s\n  fast:",
                "    stop_grace_period: 60s\n    cpus: 1\n  fast:",
                1,
            ),
            "island` services only",
        ),
    ):
        assert broken != text
        path.write_text(broken)
        with pytest.raises(ConfigError, match=message):
            localcompose.load(path, {})


# ---- the kernel's enforcement
# ---------------------------------------------------------------------
UNAVAILABLE = cpuquota.unavailable()
# CI sets DLOCO_REQUIRE_CGROUPS (.ci/run): there a machine without CPU quotas fails these tests
needs_cgroups = pytest.mark.skipif(
    UNAVAILABLE is not None and not os.environ.get("DLOCO_REQUIRE_CGROUPS"),
    reason=f"no CPU quotas here: {UNAVAILABLE}",
)

BURNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dloco.island.cpugroup import CpuGroup
    group = CpuGroup(Path(sys.argv[1]))
    group.join()
    began_cpu, began = time.process_time(), time.monotonic()
    while time.monotonic() - began < 2.0:
        pass
    inside = (time.process_time() - began_cpu) / (time.monotonic() - began)
    group.leave()
    print(inside, Path("/proc/self/cgroup").read_text().count(sys.argv[2]))
""")


@needs_cgroups
@pytest.mark.timeout(60)
def test_the_kernel_holds_each_process_to_its_quota_and_the_groups_are_removed():
    quotas = cpuquota.CpuQuotas(cpuquota.detect(), f"dloco-test-{time.monotonic_ns()}")
    burners = {}
    try:
        quotas.create("fast", 0.5)
        quotas.create("slow", 0.25)
        assert (quotas.root / "fast").is_dir() and (quotas.root / "slow").is_dir()
        with pytest.raises(CpuQuotaError, match="kernel's minimum"):
            quotas.create("tiny", 0.005)
        burners = {
            name: subprocess.Popen(
                [sys.executable, "-c", BURNER, str(quotas.groups[name]), quotas.root.name],
                stdout=subprocess.PIPE,
                text=True,
            )
            for name in ("fast", "slow")
        }
        results = {name: p.communicate(timeout=30)[0].split() for name, p in burners.items()}
    finally:
        for burner in burners.values():
            if burner.poll() is None:
                burner.kill()
                burner.wait()
        left = quotas.close()
    assert left == [] and not quotas.root.exists(), left
    assert all(p.returncode == 0 for p in burners.values()), results
    share = {name: float(r[0]) for name, r in results.items()}
    # a busy loop alone would take a whole core; its quota caps it at 0.5 and 0.25 (a busy machine
    # can only give it less)
    assert 0.02 < share["fast"] < 0.56 and 0.02 < share["slow"] < 0.29, share
    # left the group again (back where the launcher was)
    assert {r[1] for r in results.values()} == {"0"}, results


@pytest.mark.e2e
@needs_cgroups
@pytest.mark.timeout(600)
def test_dloco_up_runs_each_island_inside_its_quota(tmp_path):
    """A fast and a half-speed island with island_cpus = 0.5, 100 steps each: each trains inside its
    own quota group (0.5 and 0.25 cores; the kernel test above shows that a group holds its quota),
    and the launcher removes the groups when the run ends."""
    profile = small_profile(
        300,
        20,
        '[[regions]]\nname = "fast"\n[[regions]]\nname = "slow"\nslowdown = 2.0\n',
        max_steps=100,
    )
    (tmp_path / "c.toml").write_text(
        profile.replace("eval_every = 20", "eval_every = 20\nisland_cpus = 0.5")
    )
    run = tmp_path / "run"
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(tmp_path / "c.toml"),
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    line = next(line for line in up.stdout.splitlines() if "CPU quotas (cgroup" in line)
    assert "fast 0.5, slow 0.25 cores; 0.75 of" in line and "WARNING" not in line, line
    root = Path(line.split(", ", 1)[1].split("):", 1)[0])
    # removed at the end
    assert not root.exists(), root
    # what `dloco experiment --from` reads back
    assert read_exit_codes(run) == (300.0, {"fast": 0, "slow": 0, "merger": 0, "broker": 0})
    assert "| slow | 2.0 (0.25-core quota) |" in (run / "report.md").read_text()
    for name in ("fast", "slow"):
        joined = [
            json.loads(x)
            for x in (run / "logs" / f"{name}.log").read_text().splitlines()
            if '"cpu_quota"' in x
        ]
        assert [e["group"] for e in joined] == [str(root / name)], name
        steps = [
            e
            for e in read_events(run / "metrics" / f"{name}.jsonl")
            if e.get("step", 0) >= 1 and "deferred" not in e
        ]
        assert len(steps) >= 100, name
