"""The task plug-in: what an island trains, given by one function.

`dloco island --task SPEC` (and `[model] task = SPEC` in a cluster file) names a function as
``PATH.py:FUNCTION`` or ``MODULE:FUNCTION``.  dloco calls it once per process with a TaskContext
and trains what it returns; the built-in byte LM is such a function (``dloco.island.bytelm:task``,
the default).  The merger never sees the task: it folds named float32 tensors.

    def task(ctx: TaskContext) -> Task:
        model = MyModel(rngs=nnx.Rngs(ctx.seed))          # a Flax NNX module
        return Task(model=model, loss=my_loss,              # loss(model, batch) -> scalar
                    batches=my_shard(ctx.island_index, ctx.islands, ctx.batch, ctx.seed),  # endless
iterator
                    eval_batches=my_held_out(ctx.batch))   # the same list on every island

A batch is an array or a pytree of arrays whose leading axis is the batch (split over the local
devices).  Every island must build the same parameters (paths and shapes) from the same seed: an
island whose model differs from the merger's is refused at join, naming the first differing path.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dloco.protocol.errors import DlocoError

BUILTIN = "dloco.island.bytelm:task"
# Top-level names the project installed before it installed one (`island.bytelm:task` is now
# `dloco.island.bytelm:task`): a task spec written for those gets told the new name.
_FORMER_NAMES = frozenset({"island", "merger", "protocol", "analysis", "cluster", "sim", "suites"})


class TaskError(DlocoError):
    """The task cannot be loaded, or what it returned breaks the contract."""


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """What dloco tells the task function about this process."""

    # which shard of the training data this island trains on, in [0, islands)
    island_index: int
    # how many shards the training data is cut into
    islands: int
    # the model's initialisation seed: the same on every island and in `dloco prepare`
    seed: int
    # examples (sequences) per training step, over all local devices
    batch: int
    # inner steps this island plans to train (schedules may use it)
    max_steps: int
    # --task-option KEY=VALUE / the cluster file's [task]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Task:
    """What an island trains.  `loss` and `metrics` are traced by `nnx.jit`: pure JAX on (model,
    batch)."""

    # a flax.nnx.Module; its nnx.Param leaves are what the islands exchange
    model: Any
    # (model, batch) -> scalar loss to minimise
    loss: Callable[[Any, Any], Any]
    # this island's training batches, endless
    batches: Iterator[Any]
    # held-out batches, identical on every island (the global model is evaluated on them too):
    # the validation split, which every choice of a setting may read
    eval_batches: Sequence[Any]
    # an optax.GradientTransformation; None: dloco's AdamW chain from the training settings
    optimizer: Any = None
    # (model, batch) -> {name: scalar}, held-out extras (e.g. accuracy)
    metrics: Callable[[Any, Any], Mapping[str, Any]] | None = None
    # what one batch counts as "tokens" in the metrics; None: its leading dimension
    count: Callable[[Any], int] | None = None
    # shown in logs and reports
    name: str = ""
    # split -> that split's batches, whole (built when asked): "validation" (what eval_batches
    # sample; a final figure for tuning) or "test" (disjoint from the shards and from validation,
    # for reported figures only).  None: the task has no such splits
    whole_split: Callable[[str], Sequence[Any]] | None = None

    def tokens_in(self, batch) -> int:
        return int(self.count(batch)) if self.count is not None else examples_in(batch)


def examples_in(batch) -> int:
    """A batch's leading dimension (its first leaf's, for a pytree): the default count."""
    import jax

    return int(jax.tree.leaves(batch)[0].shape[0])


def resolve(spec: str) -> Callable[[TaskContext], Task]:
    """The task function named by ``PATH.py:FUNCTION`` or ``MODULE:FUNCTION``."""
    where, sep, function = spec.rpartition(":")
    if not sep or not where or not function.isidentifier():
        raise TaskError(f"--task must be PATH.py:FUNCTION or MODULE:FUNCTION, got {spec!r}")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task file {where} does not exist")
        # a task file may import the modules beside it
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        name = f"dloco_task_{path.stem}_{abs(hash(str(path)))}"
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        # dataclasses and pickling look the module up by name
        sys.modules[name] = module
        try:
            loader.loader.exec_module(module)
        # the user's file: any error in it is a task error, with its own message
        except Exception as error:
            del sys.modules[name]
            raise TaskError(
                f"task file {where} failed to import: {type(error).__name__}: {error}"
            ) from error
    else:
        try:
            module = importlib.import_module(where)
        # the user's module: any error in it is a task error, with its own message
        except Exception as error:
            hint = (
                f" (the project's modules import as dloco.{where})"
                if where.split(".")[0] in _FORMER_NAMES
                else ""
            )
            raise TaskError(
                f"task module {where!r} cannot be imported: {type(error).__name__}: {error}{hint}"
            ) from error
    found = getattr(module, function, None)
    if not callable(found):
        raise TaskError(f"{where} has no function {function!r}")
    return found


def build(spec: str, context: TaskContext) -> Task:
    """Call the task function and check what it returned."""
    function = resolve(spec)
    try:
        task = function(context)
    except DlocoError:
        raise
    # the user's code: say whose error it is, with its own message
    except Exception as error:
        raise TaskError(f"task {spec} raised {type(error).__name__}: {error}") from error
    if not isinstance(task, Task):
        raise TaskError(f"task {spec} returned {type(task).__name__}, not island.task.Task")
    from flax import nnx

    if not isinstance(task.model, nnx.Module):
        raise TaskError(
            f"task {spec}: model is a {type(task.model).__name__}, not a flax.nnx.Module"
        )
    if not callable(task.loss):
        raise TaskError(f"task {spec}: loss is not callable")
    if not isinstance(task.eval_batches, Sequence):
        raise TaskError(
            f"task {spec}: eval_batches must be a list (it is read at every evaluation), got"
            f" {type(task.eval_batches).__name__}"
        )
    if len(task.eval_batches) == 0:
        raise TaskError(
            f"task {spec}: eval_batches is empty (the held-out loss needs at least one batch)"
        )
    if not hasattr(task.batches, "__next__"):
        raise TaskError(
            f"task {spec}: batches must be an iterator (it has no __next__); wrap a list in iter()"
            " or write a generator"
        )
    return task


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is read as an int, a float, true/false, or else kept as a
    string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise TaskError(f"--task-option must be KEY=VALUE with KEY an identifier, got {pair!r}")
        options[key] = _literal(value)
    return options


_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")


def _literal(text: str):
    """true/false, a plain int, a plain decimal float (an exponent allowed); anything else stays the
    string it is ("1_000", "nan" and "Infinity" are not numbers written plainly: kept as text)."""
    if text in ("true", "false"):
        return text == "true"
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def first_difference(
    theirs: Mapping[str, tuple[int, ...]], ours: Mapping[str, tuple[int, ...]]
) -> str | None:
    """The first path (in sorted order) where two models' {path: shape} differ, said for a person;
    None if equal."""
    for path in sorted(set(theirs) | set(ours)):
        if path not in ours:
            return (
                f"the merger's model has {path} {tuple(theirs[path])}, this task's has no such"
                " parameter"
            )
        if path not in theirs:
            return (
                f"this task's model has {path} {tuple(ours[path])}, the merger's has no such"
                " parameter"
            )
        if tuple(theirs[path]) != tuple(ours[path]):
            return (
                f"{path} is {tuple(theirs[path])} in the merger's model and {tuple(ours[path])} in"
                " this task's"
            )
    return None
