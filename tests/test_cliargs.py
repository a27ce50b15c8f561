"""cliargs' one rule for a typed config's flags (`add_fields`, `from_args`, `as_flags`), on a
hand-written dataclass, and the island's and merger's tables read back through it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dloco.cli import build_parser
from dloco.cliargs import Flag, add_fields, as_flags, from_args, int_at_least
from dloco.island.config import SyncConfig, TrainConfig
from dloco.island.flags import SYNC_FLAGS, TASK_TRAIN_FLAGS, TRAIN_FLAGS


@dataclasses.dataclass(frozen=True)
class Example:
    steps: int = 10
    rate: float = 0.5
    name: str = "a"
    fast: bool = False
    wait_s: float = 2.0
    # no flag: keeps its default
    hidden: int = 7


FLAGS = (
    Flag("steps", type=int_at_least(1)),
    "rate",
    Flag("name", choices=("a", "b")),
    "fast",
    Flag("wait_s", flag="--wait"),
)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser()
    add_fields(out, Example, FLAGS)
    return out


def test_flags_take_their_names_types_and_defaults_from_the_fields():
    assert from_args(Example, parser().parse_args([])) == Example()
    args = parser().parse_args(["--steps", "3", "--rate", "0.25", "--name", "b", "--fast"])
    assert from_args(Example, args) == Example(3, 0.25, "b", True, 2.0, 7)
    assert from_args(Example, parser().parse_args(["--wait", "1.5"])).wait_s == 1.5
    assert from_args(Example, parser().parse_args([]), hidden=9).hidden == 9


def test_bad_values_are_refused_by_the_flags_type_and_choices():
    for bad in (["--steps", "0"], ["--rate", "x"], ["--name", "c"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)


def test_a_config_written_out_as_flags_reads_back_to_itself():
    assert as_flags(Example(), FLAGS) == []
    config = Example(steps=4, fast=True, wait_s=0.5)
    assert as_flags(config, FLAGS) == ["--steps", "4", "--fast", "--wait", "0.5"]
    assert from_args(Example, parser().parse_args(as_flags(config, FLAGS))) == config
    # a value of another type than the field's is written out even when equal, and refused
    odd = dataclasses.replace(Example(), steps=True, rate=0.5)
    assert as_flags(odd, FLAGS) == ["--steps", "True"]
    with pytest.raises(SystemExit):
        parser().parse_args(as_flags(odd, FLAGS))


def test_a_switch_must_default_to_off():
    @dataclasses.dataclass(frozen=True)
    class On:
        loud: bool = True

    with pytest.raises(ValueError, match="a switch must be off"):
        add_fields(argparse.ArgumentParser(), On, ["loud"])


def test_the_island_reads_back_what_its_tables_write():
    train = TrainConfig(batch=4, lr=1e-3, warmup=3, max_steps=9, eval_early=True, budget_tokens=5)
    sync = SyncConfig(interval=7, codec="int8", adoption="replace", alpha=0.5, blocking=True)
    flags = as_flags(train, TRAIN_FLAGS + TASK_TRAIN_FLAGS) + as_flags(sync, SYNC_FLAGS)
    args = build_parser().parse_args(["island", *flags])
    assert from_args(TrainConfig, args) == train and from_args(SyncConfig, args) == sync


def test_the_merger_reads_back_what_its_tables_write():
    from dloco.merger.config import (
        MergeConfig,
        MergerConfig,
        OuterConfig,
        RoundConfig,
        SnapshotConfig,
    )
    from dloco.merger.flags import MATH_FLAGS, SNAPSHOT_FLAGS, merger_config

    math = MergerConfig(
        MergeConfig(method="average", max_staleness=9, share_window=8),
        OuterConfig(
            kind="delayed_nesterov", lr=0.5, momentum=0.8, delay=2, momentum_dtype="bfloat16"
        ),
        RoundConfig(quorum=2, quorum_timeout_s=5.0, grace_cap_s=0.5, cold_wait_s=12.0),
    )
    snapshots = SnapshotConfig("int8", "int4", 3, 1.0, "bf16")
    parts = zip((math.merge, math.outer, math.round), MATH_FLAGS)
    flags = [f for part, (_, table) in parts for f in as_flags(part, table)]
    flags += as_flags(snapshots, SNAPSHOT_FLAGS)
    required = ["--run-dir", "r", "--delta-endpoint", "a", "--snapshot-endpoint", "b"]
    args = build_parser().parse_args(["merger", *required, "--control-endpoint", "c", *flags])
    assert merger_config(args) == math and from_args(SnapshotConfig, args) == snapshots
