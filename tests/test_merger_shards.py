"""Merger shards (protocol/shards.py, `dloco merger --shard I/N`): the pure parts by hand; a
synchronous run (blocking islands, every round folded once both islands' deltas are in: what
sync-diloco does, with two fragments) gives the same bytes for every fragment with two shards
as with one merger, each shard's log replays to its checkpoint, and a shard refuses a run
directory of another shard.  Bounded by work (steps), never by seconds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dloco.analysis.export import params_of
from dloco.cluster.ports import free_ports
from dloco.merger.log.logmatch import other_shard
from dloco.merger.log.rundir import check_shard
from dloco.merger.state import checkpoint
from dloco.merger.state.recovery import checkpoint_dir
from dloco.protocol import shards
from dloco.protocol.errors import ConfigError


def test_shards_by_hand():
    assert [shards.shard_of(f, 3) for f in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert shards.owned(1, 3, 8) == [1, 4, 7] and shards.owned(0, 1, 3) == [0, 1, 2]
    assert shards.names("merger", 3) == ["merger", "merger.1", "merger.2"] and shards.names(
        "m", 1
    ) == ["m"]
    assert shards.parse("1/4") == (1, 4)
    for bad in ("1", "4/4", "-1/2", "a/b", "0/0", "1/2000"):
        with pytest.raises(ConfigError, match="--shard"):
            shards.parse(bad)
    assert shards.shard_name(None, 2, 3) == "merger.2" and shards.shard_name(None, 0, 3) == "merger"
    assert shards.shard_name("eu", 0, 2) == "eu" and shards.shard_name("eu.1", 1, 2) == "eu.1"
    # islands tell the shards apart by name
    for given, shard in (("merger", 1), ("merger.2", 1), ("merger.1", 0)):
        with pytest.raises(ConfigError, match="shard 0 is named BASE"):
            shards.shard_name(given, shard, 3)
    # one merger: any name
    assert shards.shard_name("eu.2", 0, 1) == "eu.2"
    assert shards.subscriptions(1, 2, 12) == [
        b"delta/1/",
        b"delta/3/",
        b"delta/5/",
        b"delta/7/",
        b"delta/9/",
        b"delta/11/",
        b"heartbeat/1/",
    ]
    assert shards.subscriptions(0, 1, 12) == [b"delta/", b"heartbeat/0/"]


def test_the_shards_of_a_run_are_found_by_index_and_a_missing_one_is_named(tmp_path):
    from dloco.analysis.runinfo import RunDirError, merger_logs, shard_run_dirs

    for name in ("merger", "merger.2", "merger.1.bak", "merger.x"):
        (tmp_path / name).mkdir()
    # fragment f is shard f % N's: a gap would shift them
    with pytest.raises(RunDirError, match="merger.1 are missing"):
        shard_run_dirs(tmp_path)
    (tmp_path / "merger.1").mkdir()
    assert [p.name for p in shard_run_dirs(tmp_path)] == ["merger", "merger.1", "merger.2"]
    (tmp_path / "logs").mkdir()
    for name in ("merger.10.log", "merger.2.log", "merger.2.log.old", "merger.log"):
        (tmp_path / "logs" / name).write_text("")
    assert merger_logs(tmp_path) == ["merger.log", "standby.log", "merger.2.log", "merger.10.log"]


def test_a_run_directory_belongs_to_one_shard(tmp_path):
    def log_a_record(run_dir):
        (run_dir / "wal").mkdir(parents=True, exist_ok=True)
        (run_dir / "wal" / "000000000000.seg").write_bytes(b"a record")

    (tmp_path / "a").mkdir()
    check_shard(tmp_path / "a", 1, 2)
    # nothing logged yet (a standby that refused its primary): another shard may take it
    (tmp_path / "a" / "wal").mkdir()
    (tmp_path / "a" / "wal" / "000000000000.seg").write_bytes(b"")
    check_shard(tmp_path / "a", 0, 2)
    check_shard(tmp_path / "a", 1, 2)
    log_a_record(tmp_path / "a")
    # the same shard again: fine
    check_shard(tmp_path / "a", 1, 2)
    with pytest.raises(ConfigError, match="merger shard 1/2, not 0/2"):
        check_shard(tmp_path / "a", 0, 2)
    # an unsharded merger's log, from before shards were recorded
    log_a_record(tmp_path / "b")
    with pytest.raises(ConfigError, match="unsharded merger"):
        check_shard(tmp_path / "b", 0, 2)
    check_shard(tmp_path / "b", 0, 1)


def test_a_standby_keeps_only_a_log_of_its_own_shard():
    """logmatch.other_shard by hand: fragments [a, b] / [c] / [d], a log holding fragment 1's
    tensors is shard 1/3's; a whole model's is an unsharded merger's."""
    genesis = {"fragments": [["a", "b"], ["c"], ["d"]], "tensors": [["c", [4]]]}
    assert other_shard(genesis, 1, 3) is None
    why = other_shard(genesis, 0, 3)
    assert "holds fragments [1] of 3" in why and "shard 0/3, folds [0]" in why
    assert "folds [0, 1, 2]" in other_shard(genesis, 0, 1)
    whole = {**genesis, "tensors": [[p, [4]] for p in "abcd"]}
    assert other_shard(whole, 0, 1) is None
    assert "holds fragments [0, 1, 2] of 3" in other_shard(whole, 1, 2)
    # a log written before genesis records listed their tensors
    old = {"fragments": genesis["fragments"], "params": {"c": {"shape": [4], "data": b""}}}
    assert other_shard(old, 1, 3) is None and other_shard(old, 0, 1) is not None


def test_a_cluster_with_two_merger_shards_wires_every_island_to_both():
    from dloco.cli import build_parser
    from dloco.cluster import topology
    from dloco.cluster.config import ClusterConfig
    from dloco.cluster.sections import MergerSection, Region

    config = ClusterConfig(regions=(Region("east"),), merger=MergerSection(shards=2))
    assert config.process_names == ["east", "merger", "merger.1", "broker"]
    commands = topology.commands(
        config, topology.Addresses(("1", "2", "3", "4"), "5", shard_control_ports=("9",)), "/run"
    )
    parser = build_parser()
    zero, one, east = (parser.parse_args(commands[name]) for name in ("merger", "merger.1", "east"))
    # None: merger (protocol.shards.shard_name)
    assert (zero.shard, zero.name, str(zero.run_dir)) == ("0/2", None, "/run/merger")
    assert (one.shard, one.name, str(one.run_dir), one.control_endpoint) == (
        "1/2",
        "merger.1",
        "/run/merger.1",
        "@tcp://127.0.0.1:9",
    )
    assert east.control_endpoint == ["tcp://127.0.0.1:5", "tcp://127.0.0.1:9"]
    assert parser.parse_args(commands["evaluator"]).control_endpoint == east.control_endpoint
    import yaml

    from dloco.cluster import compose

    # one service per shard, every island wired to both
    services = yaml.safe_load(compose.render(config, "cluster.toml"))["services"]
    assert (
        services["merger.1"]["command"][services["merger.1"]["command"].index("--shard") + 1]
        == "1/2"
    )
    assert "tcp://merger.1:${DLOCO_CONTROL_PORT_MERGER_1:-5571}" in services["east"]["command"]
    assert set(services["east"]["depends_on"]) == {"merger", "merger.1"}
    # a standby per shard: standby, standby.1
    assert MergerSection(shards=2, standby=True).processes == [
        "merger",
        "merger.1",
        "standby",
        "standby.1",
    ]
    with pytest.raises(ConfigError, match="must not exceed sync.fragments"):
        # it folds the whole model as one fragment
        config.with_mode("sync-diloco")


def _dloco(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dloco", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


MODEL = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch",
    "8",
    "--seed",
    "5",
]


# Over 60 lines: the broker's, each shard's and each island's command line, started in that order,
# then waited for.
def _synchronous_run(tmp_path, count: int) -> list[dict]:
    """Broker, `count` merger shards and two blocking islands (40 steps, fragments 2, H 10); the
    shards' final checkpoints."""
    base = tmp_path / f"shards{count}"
    base.mkdir()
    init = base / "init.npz"
    assert _dloco("island", "--write-init", init, *MODEL).wait(timeout=300) == 0
    ports = [str(p) for p in free_ports(4 + count)]
    at = [f"tcp://127.0.0.1:{p}" for p in ports]
    processes = [
        _dloco(
            "broker",
            "--insecure",
            "--delta-in",
            at[0],
            "--delta-out",
            at[1],
            "--snapshot-in",
            at[2],
            "--snapshot-out",
            at[3],
        )
    ]
    try:
        for index, name in enumerate(shards.names("merger", count)):
            processes.append(
                _dloco(
                    "merger",
                    "--insecure",
                    "--run-dir",
                    base / name,
                    "--init-npz",
                    init,
                    "--fragments",
                    2,
                    "--name",
                    name,
                    "--shard",
                    f"{index}/{count}",
                    "--delta-endpoint",
                    at[1],
                    "--snapshot-endpoint",
                    at[2],
                    "--control-endpoint",
                    f"@{at[4 + index]}",
                    "--quorum",
                    2,
                    "--quorum-timeout",
                    300,
                    "--grace-cap",
                    0,
                    "--share-window",
                    0,
                    "--outer",
                    "nesterov",
                    "--outer-lr",
                    0.7,
                )
            )
        controls = [arg for endpoint in at[4:] for arg in ("--control-endpoint", endpoint)]
        islands = [
            _dloco(
                "island",
                "--insecure",
                "--name",
                name,
                "--islands",
                2,
                "--island-index",
                index,
                *MODEL,
                "--max-steps",
                40,
                "--fragments",
                2,
                "--interval",
                10,
                "--blocking",
                "--delta-endpoint",
                at[0],
                "--snapshot-endpoint",
                at[3],
                *controls,
                "--metrics-out",
                base / f"{name}.jsonl",
                "--eval-every",
                40,
                "--settle-timeout",
                400,
            )
            for index, name in enumerate(("a", "b"))
        ]
        for island in islands:
            out, _ = island.communicate(timeout=400)
            assert island.returncode == 0, out[-3000:]
        for merger in processes[1:]:
            merger.terminate()
            out, _ = merger.communicate(timeout=120)
            assert merger.returncode == 0, out[-3000:]
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)
    for name in shards.names("merger", count):
        replay = subprocess.run(
            [
                sys.executable,
                "-m",
                "dloco",
                "replay",
                str(base / name),
                "--verify",
                "--every",
                "1000000",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert replay.returncode == 0 and "ok sha256=" in replay.stdout, (
            replay.stdout[-2000:] + replay.stderr[-2000:]
        )
    return [
        checkpoint.latest(checkpoint_dir(base / name)) for name in shards.names("merger", count)
    ]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_two_shards_fold_the_bytes_one_merger_folds(tmp_path):
    (one,) = _synchronous_run(tmp_path, 1)
    split = _synchronous_run(tmp_path, 2)
    for fragment in range(2):
        mine = split[shards.shard_of(fragment, 2)]["fragments"][fragment]
        theirs = one["fragments"][fragment]
        # every island's 4 deltas of it, one round per fold
        assert int(mine["version"]) == int(theirs["version"]) >= 4
        assert params_of({"fragments": [mine]}).keys() == params_of({"fragments": [theirs]}).keys()
        for path in mine["params"]:
            assert mine["params"][path]["data"] == theirs["params"][path]["data"], (fragment, path)
        other = split[1 - shards.shard_of(fragment, 2)]["fragments"][fragment]
        # the other shard never held it
        assert int(other["version"]) == 0 and not other["params"]
    # and the run did train: every fragment moved
    with np.load(tmp_path / "shards1" / "init.npz") as init:
        folded = params_of(one)
        assert all(not np.array_equal(folded[path], init[path]) for path in init.files)
