"""The task plug-in (island/task.py): options, spec resolution, naming the first difference of two
models, and the contract's checks against hand-written cases. (The worked example, digits:
tests/test_digits_task.py; a task of another model refused at join: tests/test_task_join.py.)"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dloco.island.task import (
    TaskError,
    build,
    first_difference,
    parse_options,
    resolve,
)
from tests.task_helpers import DIGITS, context


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
    fields = dict(
        model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
        loss=_loss,
        batches=iter([]),
        eval_batches=[[[0.0, 0.0]]],
    )
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
