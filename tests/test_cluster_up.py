"""Cluster files are checked.  `dloco up` itself runs end to end in test_cluster_faults.py (three
islands with kill -9s, loss, report, plots), test_cluster_modes.py (the synchronous baselines) and
test_compose.py (the compose file's services)."""

from __future__ import annotations

import pytest

from dloco.cluster import config, modes
from dloco.protocol.errors import ConfigError

# A cluster file that is refused, and what the refusal says (a regular expression).
BAD_FILES = (
    ("[run]\nspeed = 3\n", "unknown keys in \\[run\\]"),
    ("[[regions]]\nname = 'a'\nslowdown = 0.5\n", "slowdown"),
    ("[[regions]]\nname = 'a'\ncolor = 'red'\n", "unknown keys in \\[\\[regions\\]\\]"),
    ("not toml", "cannot read"),
    ("[sync]\ncodec = 'int3'\n[[regions]]\nname = 'a'\n", "sync.codec"),
    ("[sync]\nadoption = 'merge'\n[[regions]]\nname = 'a'\n", "sync.adoption"),
    ("[sync]\nalpha = 0.5\n[[regions]]\nname = 'a'\n", "sync.alpha"),
    ("[sync]\ninterval = 2\n[[regions]]\nname = 'a'\n", "sync.interval"),
    ("[run]\neval_every = 0\n[[regions]]\nname = 'a'\n", "run.eval_every"),
    (
        "[merger]\nsnapshot_diff_codec = 'int3'\n[[regions]]\nname = 'a'\n",
        "merger.snapshot_diff_codec",
    ),
    (
        "[merger]\nshare_window = -1\n[[regions]]\nname = 'a'\n",
        "\\[merger\\] merge.share_window must be an int >= 0",
    ),
    (
        "[merger]\nouter_lr = 'fast'\n[[regions]]\nname = 'a'\n",
        "merger.outer_lr must be a number",
    ),
    (
        "[model]\nwidth = 30\n[[regions]]\nname = 'a'\n",
        "\\[model\\] model.width 30 must be a multiple of model.heads 4",
    ),
    (
        "[merger]\nsnapshot_full_every = 1.5\n[[regions]]\nname = 'a'\n",
        "merger.snapshot_full_every",
    ),
    (
        "[merger]\nsnapshot_every_round = -0.5\n[[regions]]\nname = 'a'\n",
        "merger.snapshot_every_round",
    ),
    ("[merger]\nsnapshot_codec = 'int4'\n[[regions]]\nname = 'a'\n", "merger.snapshot_codec"),
    (
        (
            "[merger]\nsnapshot_codec = 'int8'\nsnapshot_diff_codec = 'none'\n[[regions]]\nname"
            " = 'a'\n"
        ),
        "needs merger.snapshot_diff_codec",
    ),
    (
        "[merger]\nsnapshot_every_round = 'often'\n[[regions]]\nname = 'a'\n",
        "merger.snapshot_every_round",
    ),
    (
        "[merger]\nserved_dtype = 'bf16'\nsnapshot_diff_codec = 'none'\n[[regions]]\nname = 'a'\n",
        "merger.served_dtype = 'bf16' needs merger.snapshot_diff_codec",
    ),
    ("[merger]\nserved_dtype = 'fp16'\n[[regions]]\nname = 'a'\n", "merger.served_dtype"),
    ("[merger]\nmomentum_dtype = 'fp16'\n[[regions]]\nname = 'a'\n", "momentum_dtype"),
    ("[run]\neval_trace = -1\n[[regions]]\nname = 'a'\n", "run.eval_trace"),
    ("[sync]\nflush_on_leave = 'yes'\n[[regions]]\nname = 'a'\n", "sync.flush_on_leave"),
    ("[run]\neval_trace = 4.5\n[[regions]]\nname = 'a'\n", "run.eval_trace"),
)


def test_cluster_files_are_checked(tmp_path):
    default = config.load()
    assert [r.name for r in default.regions] == [
        "us-east",
        "us-west",
        "eu-older-hw",
        "asia-older-hw",
    ]
    assert [r.slowdown for r in default.regions] == [1.0, 1.0, 2.0, 2.0]
    bad = tmp_path / "bad.toml"
    for text, message in BAD_FILES:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            config.load(bad)
    with pytest.raises(ConfigError, match="duration_s"):
        default.with_duration(-1)


def test_flush_on_leave_and_eval_trace_reach_the_islands(tmp_path):
    from dloco.cluster import topology

    path = tmp_path / "c.toml"
    path.write_text(
        "[run]\neval_trace = 12\n[sync]\nflush_on_leave = true\n[[regions]]\nname = 'a'\n"
    )
    command = [
        str(a)
        for a in topology.commands(
            config.load(path), topology.Addresses(("1", "2", "3", "4"), "5"), str(tmp_path)
        )["a"]
    ]
    assert "--flush-on-leave" in command and command[command.index("--eval-trace") + 1] == "12"
    default = [
        str(a)
        for a in topology.commands(
            config.load(), topology.Addresses(("1", "2", "3", "4"), "5"), str(tmp_path)
        )["us-east"]
    ]
    assert "--flush-on-leave" not in default and "--eval-trace" not in default


def every_cluster(default: config.ClusterConfig) -> list[config.ClusterConfig]:
    """The shipped profile in each mode, every suite's runs of it, and it with an async standby."""
    import dataclasses

    from dloco.suites import catalog

    clusters = [default.with_mode(mode) for mode in modes.MODES]
    clusters += [transform(default) for _, runs in catalog.SUITES.values() for _, transform in runs]
    clusters.append(
        dataclasses.replace(
            default,
            merger=dataclasses.replace(
                default.merger, standby=True, replication="async", lease_s=1.5
            ),
        )
    )
    return clusters


def test_every_setting_of_the_cluster_file_reaches_the_processes():
    """The typed sections, after the mode's overrides, are what the merger's and the islands' own
    command lines parse from topology's arguments: for the shipped profile, each mode and every
    suite's runs.
    """
    import dataclasses

    from dloco.cli import build_parser
    from dloco.cliargs import from_args
    from dloco.cluster import topology
    from dloco.island.config import SyncConfig, TrainConfig
    from dloco.merger.config import SnapshotConfig
    from dloco.merger.flags import merger_config

    parser, default = build_parser(), config.load()
    for cluster in every_cluster(default):
        sync, merger = cluster.effective()
        commands = topology.commands(
            cluster,
            topology.Addresses(("1", "2", "3", "4"), "5", standby_ports=("6", "7", "8")),
            "/run",
        )
        assert ("standby" in commands) == merger.standby
        snapshots = SnapshotConfig(
            merger.snapshot_codec,
            merger.snapshot_diff_codec,
            merger.snapshot_full_every,
            merger.snapshot_every_round,
        )
        for name in ("merger", "standby") if merger.standby else ("merger",):
            merger_args = parser.parse_args(commands[name])
            # one merger (shards: test_island_group, test_merger_shards)
            assert merger_args.shard == "0/1"
            assert merger_config(merger_args) == merger.math(), cluster.mode
            assert from_args(SnapshotConfig, merger_args) == snapshots, cluster.mode
            if merger.standby:
                assert (merger_args.replication, merger_args.lease) == (
                    merger.replication,
                    merger.lease_s,
                )
            assert merger_args.fragments == sync.fragments
        region = cluster.regions[0]
        island_args = parser.parse_args(commands[region.name])
        expected = dataclasses.replace(sync, interval=cluster.interval_of(region))
        island_sync = from_args(SyncConfig, island_args)
        for key in (*config.SYNC_KEYS, "blocking"):
            assert getattr(island_sync, key) == getattr(expected, key), (cluster.mode, key)
        for field in dataclasses.fields(cluster.model):
            wanted = getattr(cluster.model, field.name)
            # unset, the islands' own default
            wanted = TrainConfig.lr if field.name == "lr" and wanted is None else wanted
            assert getattr(island_args, field.name) == wanted, field.name


def test_the_model_section_names_a_task_and_its_options_reach_the_islands(tmp_path):
    """[model] task: a relative PATH.py is the cluster file's neighbour; [task] pairs become
    --task-option; the built-in LM's keys are refused for another task; sizes are checked."""
    from dloco.cli import build_parser
    from dloco.cluster import topology
    from dloco.island.flags import task_options

    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.toml"
    path.write_text(
        "[model]\ntask = 'mine.py:build'\nbatch = 4\n[task]\nhidden = 32\nrate = 0.5\nwide ="
        " true\nname = 'x'\n[[regions]]\nname = 'a'\n"
    )
    cluster = config.load(path)
    assert cluster.model.task == f"{tmp_path / 'sub' / 'mine.py'}:build"
    island = topology.commands(cluster, topology.Addresses(("1", "2", "3", "4"), "5"), "/run")["a"]
    args = build_parser().parse_args(island)
    assert args.task == cluster.model.task and args.batch == 4
    assert task_options(args) == {"hidden": 32, "name": "x", "rate": 0.5, "wide": True}

    path.write_text(
        "[model]\nsize = '124m'\ncontext = 256\ncorpus = 'text'\n[[regions]]\nname = 'a'\n"
    )
    args = build_parser().parse_args(
        topology.commands(config.load(path), topology.Addresses(("1", "2", "3", "4"), "5"), "/run")[
            "a"
        ]
    )
    assert task_options(args) == {
        "size": "124m",
        "context": 256,
        "corpus": str(tmp_path / "sub" / "text"),
    }
    for text, message in (
        ("[model]\ntask = 'mine.py:build'\nwidth = 64\n", "are the built-in LM's options"),
        ("[model]\nsize = 'huge'\n", "model.size must be one of"),
        ("[model]\ntask = 'nothing'\n", "model.task must be"),
        ("[model]\ncorpus = 'a'\ntokens = 'b'\n", "not both"),
        ("[model]\nsize = 'small'\nheads = 7\n", "multiple of model.heads 7"),
        ("[task]\nbad = [1, 2]\n", "\\[task\\] values must be"),
        ("task = 'x.py:f'\n", "\\[task\\] must be a table"),
    ):
        path.write_text(text + "[[regions]]\nname = 'a'\n")
        with pytest.raises(ConfigError, match=message):
            config.load(path)


def test_compose_mounts_the_task_file_from_the_cluster_files_folder(tmp_path):
    from dloco.cluster import compose

    (tmp_path / "c.toml").write_text("[model]\ntask = 'mine.py:build'\n[[regions]]\nname = 'a'\n")
    rendered = compose.render(config.load(tmp_path / "c.toml"), "conf/c.toml", tmp_path)
    assert (
        "--task, '/dloco/config/mine.py:build'" in rendered
        and "'./conf:/dloco/config:ro'" in rendered
    )
    assert "[dloco, prepare, --config, /dloco/config/c.toml" in rendered
    (tmp_path / "c.toml").write_text(
        f"[model]\ntask = '{tmp_path.parent / 'elsewhere.py'}:build'\n[[regions]]\nname = 'a'\n"
    )
    with pytest.raises(ConfigError, match="outside the cluster file's folder"):
        compose.render(config.load(tmp_path / "c.toml"), "conf/c.toml", tmp_path)
