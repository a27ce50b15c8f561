"""The task plug-in (island/task.py) and its worked example, examples/digits.py: options, spec
resolution and the contract's checks against hand-written cases; the digits task trains standalone
from the repository and from a file outside it, and under `dloco up` (-m e2e); an island whose task
builds another model than the merger's is refused when it joins, by name."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dloco.island.task import (
    TaskContext,
    TaskError,
    build,
    first_difference,
    parse_options,
    resolve,
)

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "digits.py"


def context(island_index=0, islands=1, batch=32, **options) -> TaskContext:
    return TaskContext(
        island_index=island_index,
        islands=islands,
        seed=0,
        batch=batch,
        max_steps=10,
        options=options,
    )


def test_options_are_read_as_int_float_bool_or_string():
    assert parse_options(
        [
            "hidden=64",
            "rate=0.5",
            "big=1e3",
            "below=-3",
            "on=true",
            "off=false",
            "name=abc",
            "empty=",
            "eq=a=b",
            "title=True",
        ]
    ) == {
        "hidden": 64,
        "rate": 0.5,
        "big": 1000.0,
        "below": -3,
        "on": True,
        "off": False,
        "name": "abc",
        "empty": "",
        "eq": "a=b",
        "title": "True",
    }
    # the last one given wins
    assert type(parse_options(["n=7"])["n"]) is int and parse_options(["a=1", "a=2"]) == {"a": 2}
    for bad in ("hidden", "=5", "1x=2", "a-b=1", " a=1"):
        with pytest.raises(TaskError, match="KEY=VALUE with KEY an identifier"):
            parse_options([bad])


def test_numbers_not_written_plainly_stay_text_and_a_metric_may_not_be_called_loss():
    import numpy as np

    from dloco.island.config import TrainConfig
    from dloco.island.train import Trainer

    assert parse_options(["a=nan", "b=Infinity", "c=1_000", "d=1e-3", "e=-.5"]) == {
        "a": "nan",
        "b": "Infinity",
        "c": "1_000",
        "d": 0.001,
        "e": -0.5,
    }
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    trainer = Trainer(
        model,
        lambda m, b: (m(b) ** 2).mean(),
        TrainConfig(batch=2),
        metrics=lambda m, b: {"loss": (m(b) ** 2).mean()},
    )
    with pytest.raises(TaskError, match="may not be named 'loss'"):
        trainer.evaluate([np.zeros((2, 2), np.float32)])


def test_first_difference_names_the_first_path_in_sorted_order():
    assert first_difference({"a": (2, 3), "b": (4,)}, {"b": (4,), "a": (2, 3)}) is None
    # shapes as lists (msgpack) or tuples alike
    assert first_difference({"a": [2, 3]}, {"a": (2, 3)}) is None
    assert (
        first_difference({"a": (2,), "b": (3,)}, {"a": (2,)})
        == "the merger's model has b (3,), this task's has no such parameter"
    )
    assert (
        first_difference({"a": (2,)}, {"a": (2,), "c": (1,)})
        == "this task's model has c (1,), the merger's has no such parameter"
    )
    assert (
        first_difference({"a": (2,)}, {"a": (4,)})
        == "a is (2,) in the merger's model and (4,) in this task's"
    )
    # b differs too, but a comes first
    assert (
        first_difference({"b": (1,), "a": (1,)}, {"b": (2,), "a": (3,)})
        == "a is (1,) in the merger's model and (3,) in this task's"
    )
    assert first_difference({"x/1": (5,)}, {"x/0": (5,)}).startswith(
        "this task's model has x/0 (5,)"
    )


def test_resolve_finds_files_and_modules_and_names_what_is_wrong(tmp_path):
    from dloco.island import bytelm

    assert resolve("dloco.island.bytelm:task") is bytelm.task
    assert resolve(f"{DIGITS}:task").__name__ == "task"
    for spec in ("no_colon", "x.py:", ":task", "x.py:not-a-name"):
        with pytest.raises(TaskError, match="must be PATH.py:FUNCTION or MODULE:FUNCTION"):
            resolve(spec)
    with pytest.raises(TaskError, match="task file .*nope.py does not exist"):
        resolve(f"{tmp_path / 'nope.py'}:task")
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('boom at import')\n")
    modules = set(sys.modules)
    with pytest.raises(
        TaskError, match="raising.py failed to import: RuntimeError: boom at import"
    ):
        resolve(f"{raising}:task")
    # the half-imported module is not left behind
    assert set(sys.modules) == modules
    (tmp_path / "empty.py").write_text("task = 3  # not a function\n")
    for spec in (f"{tmp_path / 'empty.py'}:task", f"{tmp_path / 'empty.py'}:other"):
        with pytest.raises(TaskError, match="has no function"):
            resolve(spec)
    with pytest.raises(TaskError, match="task module 'no_such_module_here' cannot be imported"):
        resolve("no_such_module_here:task")


BROKEN = """
from flax import nnx
from dloco.island.task import Task

def _loss(model, batch):
    return (model(batch) ** 2).mean()

def _task(**changes):
    fields = dict(model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)), loss=_loss, batches=iter([]), eval_batches=[[[0.0, 0.0]]])
    return Task(**{**fields, **changes})

def not_a_task(ctx):
    return {"model": None}

def no_module(ctx):
    return _task(model=object())

def loss_not_callable(ctx):
    return _task(loss=3.0)

def no_eval_batches(ctx):
    return _task(eval_batches=[])

def batches_a_list(ctx):
    return _task(batches=[[[0.0, 0.0]]])

def eval_batches_a_generator(ctx):
    return _task(eval_batches=(b for b in [[[0.0, 0.0]]]))

def raises(ctx):
    return {}["missing"]

def fine(ctx):
    return _task()
"""


@pytest.mark.parametrize(
    "function,message",
    [
        ("not_a_task", "returned dict, not island.task.Task"),
        ("no_module", "model is a object, not a flax.nnx.Module"),
        ("loss_not_callable", "loss is not callable"),
        ("no_eval_batches", "eval_batches is empty"),
        ("batches_a_list", "batches must be an iterator"),
        ("eval_batches_a_generator", "eval_batches must be a list"),
        ("raises", "raised KeyError: 'missing'"),
    ],
)
def test_build_refuses_what_breaks_the_contract(tmp_path, function, message):
    (tmp_path / "broken.py").write_text(BROKEN)
    assert build(f"{tmp_path / 'broken.py'}:fine", context()).loss.__name__ == "_loss"
    with pytest.raises(TaskError, match=message):
        build(f"{tmp_path / 'broken.py'}:{function}", context())


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


def dloco(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


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


class ForeignLink:
    """A link that has received, of another model, the snapshots of `arrived` fragments (their
    layout only, as NetworkLink keeps)."""

    bytes_sent = bytes_received = 0
    unfolded: dict = {}

    def __init__(self, layout: dict[int, dict[str, tuple]]) -> None:
        self.foreign = layout

    def snapshots(self) -> list:
        return []


def test_join_refuses_another_model_once_what_arrived_shows_the_difference():
    """The merger's model has two hidden layers, this task's three: every path the merger sends is
    one of this task's, with its shape, so the difference shows only when every fragment is in."""
    from dloco.island import exchange
    from dloco.island.config import SyncConfig, TrainConfig
    from dloco.island.loop import IslandLoop, JoinTimeout, ModelMismatch
    from dloco.island.metrics import MetricsWriter
    from dloco.island.train import Trainer

    digits = resolve(f"{DIGITS}:task")
    merger_params = Trainer(
        digits(context()).model, digits(context()).loss, TrainConfig(batch=32)
    ).params()
    fragments = exchange.partition({p: v.shape for p, v in merger_params.items()}, 2)
    layout = {f: {p: merger_params[p].shape for p in paths} for f, paths in enumerate(fragments)}
    ours = digits(context(layers=3))
    loop = IslandLoop(
        Trainer(ours.model, ours.loss, TrainConfig(batch=32)),
        ours.batches,
        ours.eval_batches,
        TrainConfig(batch=32),
        SyncConfig(fragments=2, interval=10),
        MetricsWriter(None),
        link=ForeignLink({0: layout[0]}),
    )
    # fragment 0 alone agrees with this task's model: nothing to refuse
    with pytest.raises(JoinTimeout):
        loop.join(0.2)
    loop.link = ForeignLink(layout)
    with pytest.raises(
        ModelMismatch,
        match=r"this task's model has hidden/2/bias \(64,\), the merger's has no such parameter",
    ):
        loop.join(30.0)
    # half a model that differs in what arrived is refused by the join's deadline, naming what it
    # saw
    loop.link = ForeignLink({1: {**layout[1], "hidden/1/kernel": (64, 32)}})
    with pytest.raises(
        ModelMismatch,
        match=r"hidden/1/kernel is \(64, 32\) in the merger's model and \(64, 64\) in this task's",
    ):
        loop.join(0.2)


# a merger, a broker and an island process: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_island_whose_task_differs_from_the_merger_model_is_refused_at_join(tmp_path):
    """The merger starts from the digits model with 64 hidden units; an island given hidden=32 is
    refused when the merger's snapshots arrive (not after its join timeout), naming the first
    differing parameter and both shapes."""
    from dloco.cluster.ports import free_ports
    from dloco.island.config import TrainConfig
    from dloco.island.train import Trainer

    # what `dloco island --write-init --task ...digits.py:task` writes, without starting a process
    # for it
    init = tmp_path / "init.npz"
    merger_task = build(f"{DIGITS}:task", context())
    np.savez(init, **Trainer(merger_task.model, merger_task.loss, TrainConfig(batch=32)).params())
    ports = free_ports(3)
    merger = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "merger",
            "--run-dir",
            tmp_path / "m",
            "--init-npz",
            init,
            "--fragments",
            "2",
            "--delta-endpoint",
            f"@tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"@tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"@tcp://127.0.0.1:{ports[2]}",
            "--insecure",
        ],
        stdout=open(tmp_path / "merger.log", "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        island = dloco(
            "island",
            "--name",
            "other",
            "--task",
            f"{DIGITS}:task",
            "--task-option",
            "hidden=32",
            "--batch",
            "32",
            "--max-steps",
            "50",
            "--fragments",
            "2",
            "--interval",
            "10",
            "--join-timeout",
            "200",
            "--insecure",
            "--delta-endpoint",
            f"tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"tcp://127.0.0.1:{ports[2]}",
            timeout=260,
        )
    finally:
        merger.terminate()
        merger.wait(timeout=30)
    assert island.returncode == 2, (island.stdout[-2000:], island.stderr[-2000:])
    assert (
        "the merger trains another model than this task: hidden/0/bias is (64,) in the merger's"
        " model and (32,) in this task's" in island.stderr
    ), island.stderr[-2000:]
    assert "Traceback" not in island.stderr and '"event": "step"' not in island.stdout


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
    from dloco.island.main import task_options as island_options

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
