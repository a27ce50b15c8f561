"""The task plug-in's worked example, examples/digits.py: its shards, batches and options; it
trains standalone from the repository and from a file outside it, and under `dloco up` (-m e2e);
the shipped cluster file and the report's evaluator pass it the islands' options."""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest

from dloco.island.task import TaskError, build, resolve
from tests.task_helpers import DIGITS, ROOT, context, dloco


def test_digits_splits_shards_and_batches_as_the_contract_asks():
    digits = resolve(f"{DIGITS}:task")
    module = sys.modules[digits.__module__]
    shards, held = module.split(1797, 4, 0.2)
    assert len(held) == 359 and [len(s) for s in shards] == [360, 360, 359, 359]
    everything = np.concatenate([held, *shards])
    # disjoint and covering
    assert sorted(everything.tolist()) == list(range(1797))
    again, held_again = module.split(1797, 4, 0.2)
    assert np.array_equal(held, held_again) and all(
        np.array_equal(a, b) for a, b in zip(shards, again)
    )
    tasks = [digits(context(island_index=i, islands=4)) for i in range(4)]
    first = next(tasks[0].batches)
    assert (
        first["image"].shape == (32, 64)
        and first["image"].dtype == np.float32
        and first["label"].dtype == np.int32
    )
    assert (
        0 <= first["image"].min()
        and first["image"].max() <= 1
        and set(np.unique(first["label"])) <= set(range(10))
    )
    assert len(tasks[0].eval_batches) == 359 // 32 and all(
        b["label"].shape == (32,) for b in tasks[0].eval_batches
    )
    # the held-out batches are every island's, example for example
    for other in tasks[1:]:
        assert all(
            np.array_equal(a["image"], b["image"]) and np.array_equal(a["label"], b["label"])
            for a, b in zip(tasks[0].eval_batches, other.eval_batches)
        )
    # each island's batches come from its own shard (30 batches: ~2.7 passes over it, every example
    # seen)
    from sklearn.datasets import load_digits

    images = (load_digits().data / 16.0).astype(np.float32)
    for index in (0, 3):
        trained = {row.tobytes() for _ in range(30) for row in next(tasks[index].batches)["image"]}
        assert trained == {row.tobytes() for row in images[shards[index]]}
    # a dict batch counts its examples
    assert tasks[0].tokens_in(first) == 32


def test_digits_options_are_checked_by_name():
    digits = resolve(f"{DIGITS}:task")
    assert digits(context(hidden=16, layers=1, held_out=0.5)).model.out.kernel.shape == (16, 10)
    for options, message in (
        ({"width": 3}, r"no options \['width'\]"),
        ({"hidden": 0}, "hidden must be a positive int"),
        ({"layers": True}, "layers must be a positive int"),
        ({"held_out": 1.5}, r"held_out must be a fraction in \(0, 1\)"),
    ):
        with pytest.raises(TaskError, match=message):
            digits(context(**options))
    with pytest.raises(TaskError, match="fewer than one batch of 512"):
        digits(context(batch=512))


@pytest.mark.timeout(240)
def test_digits_trains_standalone(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = dloco(
        "island",
        "--standalone",
        "--task",
        "examples/digits.py:task",
        "--batch",
        "32",
        "--max-steps",
        "150",
        "--eval-every",
        "75",
        "--metrics-out",
        metrics,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    evals = [e for e in map(json.loads, metrics.read_text().splitlines()) if "eval_loss" in e]
    assert [e["step"] for e in evals] == [0, 75, 150]
    # from ln 10 = 2.3 nats, chance
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0, evals
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"] + 0.5, evals
    named = next(json.loads(line) for line in run.stdout.splitlines() if '"event": "task"' in line)
    assert "digits MLP (2 x 64 hidden)" in named["name"], named


def test_a_task_file_outside_the_package_trains(tmp_path):
    """A user's own file, in no package, with an option of its own: what `dloco island --task` does
    with it (resolve, build, Trainer) in this process; the cluster test runs one under `dloco up`.
    """
    from dloco.island.config import TrainConfig
    from dloco.island.train import Trainer

    shutil.copy(DIGITS, tmp_path / "my_digits.py")
    task = build(f"{tmp_path / 'my_digits.py'}:task", context(hidden=32))
    assert "(2 x 32 hidden)" in task.name and sys.modules[task.loss.__module__].__file__ == str(
        tmp_path / "my_digits.py"
    )
    train = TrainConfig(batch=32, lr=1e-2, warmup=5, schedule="constant", max_steps=100)
    trainer = Trainer(task.model, task.loss, train, task.optimizer, task.metrics)
    before = trainer.evaluate_all(task.eval_batches)
    for _ in range(100):
        trainer.step(next(task.batches))
    after = trainer.evaluate_all(task.eval_batches)
    assert after["loss"] < before["loss"] - 1.0 and after["accuracy"] > before["accuracy"] + 0.5, (
        before,
        after,
    )


def test_the_shipped_digits_cluster_file_names_the_example_and_its_options():
    from dloco.cluster import config, topology

    cluster = config.load(ROOT / "examples" / "digits.toml")
    assert (
        cluster.model.task == f"{DIGITS}:task"
        and len(cluster.regions) == 4
        and cluster.max_steps > 0
        and cluster.mode == "decoupled"
    )
    island = [
        str(a)
        for a in topology.commands(cluster, topology.Addresses(("1", "2", "3", "4"), "5"), "/run")[
            "slow-b"
        ]
    ]
    assert (
        island[island.index("--task") + 1] == f"{DIGITS}:task"
        and island[island.index("--island-index") + 1] == "3"
    )
    assert [island[i + 1] for i, a in enumerate(island) if a == "--task-option"] == [
        "hidden=64",
        "layers=2",
    ]


def test_the_report_evaluates_the_task_the_islands_were_given(tmp_path):
    """[task] values reach an island as --task-option text, which it reads back (parse_options): the
    report's evaluator reads them the same way, so a TOML string "32" is the int 32 in both."""
    from dloco.cli import build_parser
    from dloco.cluster import config, topology
    from dloco.cluster.records import run_task

    path = tmp_path / "c.toml"
    path.write_text(
        '[model]\ntask = "digits.py:task"\n[task]\nhidden = "32"\nlayers = 1\nflag = true\nrate ='
        ' 0.5\n[[regions]]\nname = "a"\n'
    )
    cluster = config.load(path)
    command = topology.commands(cluster, topology.Addresses(("1", "2", "3", "4"), "5"), "/r")["a"]
    island = build_parser().parse_args([str(a) for a in command])
    from dloco.island.flags import task_options as island_options

    assert (
        run_task(cluster).options
        == island_options(island)
        == {
            "hidden": 32,
            "layers": 1,
            "flag": True,
            "rate": 0.5,
        }
    )


NETWORKED = """
[run]
duration_s = 400
max_steps = {steps}
eval_every = 50

[model]
task = "tasks/my_digits.py:task"
batch = 32

[task]
hidden = 32

[sync]
fragments = 2
interval = 20

[merger]
# each island trains for a few seconds: the first folds' wait for a second island could hold them
# for the whole run
cold_wait_s = 0
max_staleness = 8
outer_lr = 0.35
share_window = 8
snapshot_codec = "int8"
snapshot_diff_codec = "int4"

[[regions]]
name = "a"

[[regions]]
name = "b"
"""


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_task_file_outside_the_package_trains_a_cluster(tmp_path):
    """Two islands under `dloco up` train a copy of the digits task kept beside the cluster file:
    the merger folds both islands' deltas and its model's held-out loss and accuracy improve."""
    from dloco.analysis.runinfo import merger_folds

    (tmp_path / "tasks").mkdir()
    shutil.copy(DIGITS, tmp_path / "tasks" / "my_digits.py")
    (tmp_path / "c.toml").write_text(NETWORKED.format(steps=150))
    run = tmp_path / "run"
    up = dloco("up", "--config", tmp_path / "c.toml", "--run-dir", run, timeout=560)
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    report = (run / "report.md").read_text()
    accuracy = re.search(
        r"Held-out accuracy ([\d.]+) → ([\d.]+) \(initial → final global model\)", report
    )
    assert accuracy and float(accuracy[2]) > float(accuracy[1]) + 0.3, report
    table = report.split("## Global model")[1].splitlines()
    row = [
        cell.strip()
        for cell in (
            table[table.index(next(line for line in table if line.startswith("|---"))) + 1]
            .strip("|")
            .split("|")
        )
    ]
    initial, final = float(row[2]), float(row[3])
    # from ln 10 = 2.3 nats
    assert final < initial - 0.5, row
    folded = {name for fold in merger_folds(run) for name in fold["contributors"]}
    assert folded == {"a", "b"}, folded
    islands = [
        line
        for line in report.split("## Islands")[1].split("## ")[0].splitlines()
        if line.startswith(("| a ", "| b "))
    ]
    assert len(islands) == 2 and all(int(line.strip("|").split("|")[-2]) > 0 for line in islands), (
        islands
    )
