"""Your own task: a handwritten-digit classifier, trained by dloco's islands.

A task is one function, ``task(ctx) -> Task`` (island/task.py).  This file is a complete one, meant
to be copied: a small Flax NNX MLP on scikit-learn's bundled digits (1,797 8x8 grey images, 10
classes; they ship inside the scikit-learn wheel, nothing is downloaded).

    dloco island --standalone --task examples/digits.py:task --max-steps 300
    dloco island --standalone --task examples/digits.py:task --task-option hidden=128
    dloco up --config examples/digits.toml          # four islands, the cluster file's [task]
options

What the contract asks, and how this file answers it:
  * every island builds the same parameters from ctx.seed: the model depends only on the options
    and the seed, never on ctx.island_index;
  * each island trains its own shard: the examples not held out are cut into ctx.islands disjoint
    shards and ctx.island_index picks one;
  * the held-out batches are the same on every island (and in the report's evaluator): the split
    uses a fixed seed of its own, not ctx.seed, so runs with different seeds are measured alike;
  * a batch may be any pytree whose leaves share a leading batch axis: here a dict of images and
labels.

Options (--task-option KEY=VALUE, or KEY = VALUE under the cluster file's [task]):
  hidden    units per hidden layer (default 64)
  layers    hidden layers (default 2)
  held_out  fraction of the examples held out for evaluation, in (0, 1) (default 0.2)
Every island of a cluster must get the same hidden and layers: an island whose model differs from
the merger's is refused when it joins.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import optax
from flax import nnx

from dloco.island.task import Task, TaskContext, TaskError

PIXELS, CLASSES = 64, 10
DEFAULTS = {"hidden": 64, "layers": 2, "held_out": 0.2}
# the held-out set and the shards do not move with ctx.seed (see above)
SPLIT_SEED = 0


class Classifier(nnx.Module):
    """64 pixels -> `layers` ReLU layers of `hidden` units -> 10 logits."""

    def __init__(self, hidden: int, layers: int, rngs: nnx.Rngs) -> None:
        sizes = [PIXELS] + [hidden] * layers
        self.hidden = nnx.List(
            [nnx.Linear(n_in, n_out, rngs=rngs) for n_in, n_out in zip(sizes, sizes[1:])]
        )
        self.out = nnx.Linear(sizes[-1], CLASSES, rngs=rngs)

    def __call__(self, image_BxP):
        x = image_BxP
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


def loss(model: Classifier, batch):
    """Mean softmax cross-entropy (nats per example)."""
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def metrics(model: Classifier, batch) -> dict:
    """Held-out extras besides the loss: the report prints them for the global model."""
    return {"accuracy": (model(batch["image"]).argmax(axis=-1) == batch["label"]).mean()}


def options(given) -> dict:
    """DEFAULTS overridden by the given options; an unknown or out-of-range one is a TaskError that
    names it."""
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise TaskError(
            f"the digits task has no options {sorted(unknown)}; it takes {sorted(DEFAULTS)}"
        )
    chosen = {**DEFAULTS, **given}
    for key in ("hidden", "layers"):
        if type(chosen[key]) is not int or chosen[key] < 1:
            raise TaskError(f"digits option {key} must be a positive int, got {chosen[key]!r}")
    if type(chosen["held_out"]) not in (int, float) or not 0 < chosen["held_out"] < 1:
        raise TaskError(
            f"digits option held_out must be a fraction in (0, 1), got {chosen['held_out']!r}"
        )
    return chosen


def split(count: int, islands: int, held_out: float) -> tuple[list[np.ndarray], np.ndarray]:
    """(one index array per island, held-out indices): disjoint, covering all `count` examples, and
    the same in every process (a fixed seed)."""
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    held = round(count * held_out)
    return np.array_split(order[held:], islands), order[:held]


def shard_batches(images_NxP: np.ndarray, labels_N: np.ndarray, batch: int, seed) -> Iterator[dict]:
    """Endless batches of exactly `batch` examples: the shard reshuffled each epoch, epochs run
    together so that no batch is short (a short one would compile the step again)."""
    rng = np.random.default_rng(seed)
    queue = np.empty(0, dtype=np.int64)
    while True:
        while queue.size < batch:
            queue = np.concatenate([queue, rng.permutation(len(labels_N))])
        take, queue = queue[:batch], queue[batch:]
        yield {"image": images_NxP[take], "label": labels_N[take]}


def task(ctx: TaskContext) -> Task:
    # here, not at the top: only a process that trains this task pays for the import
    from sklearn.datasets import load_digits

    chosen = options(ctx.options)
    digits = load_digits()
    # pixel intensities 0..16 -> [0, 1]
    images_NxP = (digits.data / 16.0).astype(np.float32)
    labels_N = digits.target.astype(np.int32)
    shards, held = split(len(labels_N), ctx.islands, chosen["held_out"])
    shard = shards[ctx.island_index]
    if len(shard) == 0:
        raise TaskError(
            f"{ctx.islands} islands leave island {ctx.island_index} no training examples: use fewer"
            " islands"
        )
    # Every held-out batch has exactly ctx.batch examples (one compilation, equal weights in the
    # mean); the last partial batch is left out, fewer than ctx.batch examples.
    eval_batches = [
        {"image": images_NxP[held[i : i + ctx.batch]], "label": labels_N[held[i : i + ctx.batch]]}
        for i in range(0, len(held) - ctx.batch + 1, ctx.batch)
    ]
    if not eval_batches:
        raise TaskError(
            f"the held-out set has {len(held)} examples, fewer than one batch of {ctx.batch}: "
            "lower the batch or raise held_out"
        )
    model = Classifier(chosen["hidden"], chosen["layers"], nnx.Rngs(ctx.seed))
    # optimizer=None: dloco's AdamW chain (island --lr, --warmup, --schedule, clipping), the one the
    # built-in LM trains with; it fits this small MLP as it is, and keeps those flags meaningful.
    return Task(
        model=model,
        loss=loss,
        batches=shard_batches(
            images_NxP[shard], labels_N[shard], ctx.batch, (ctx.seed, ctx.island_index)
        ),
        eval_batches=eval_batches,
        metrics=metrics,
        name=(
            f"digits MLP ({chosen['layers']} x {chosen['hidden']} hidden) on scikit-learn's"
            f" {len(labels_N):,} 8x8 digits: {len(shard)} training examples in shard"
            f" {ctx.island_index} of {ctx.islands}, {len(eval_batches) * ctx.batch} held out in"
            f" {len(eval_batches)} batches"
        ),
    )
