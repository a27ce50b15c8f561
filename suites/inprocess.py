"""Data parallelism in one process: the quality suite's `sync-dp` baseline.

Data parallelism is one optimizer on the all-reduced gradient of the global batch: every replica
holds the same parameters and the same optimizer state, and takes the same step.  Here the global
batch is the concatenation of every island's batch (each island's task built as that island builds
it: the same shard, data order, initial model and held-out batches) and one Trainer takes one AdamW
step on it, its gradient clipped by its global norm, at the peak rate `[model] lr` (tuned at the
global batch: EXPERIMENTS.md).  With equal batches the mean of the islands' gradients is the
gradient of the concatenated batch, so this is the all-reduce without the replicas:
`all_reduce_step` does it the replicated way, and tests/test_data_parallel.py checks that the two
agree to float rounding and that the replicas' optimizer states stay identical.

The rate follows the budget as an island's does (island/schedule.py): warmup by steps, then the
decay over the cluster's tokens, here known exactly.  The run stops once the cluster's tokens reach
the budget.  The model is evaluated on the validation batches every `eval_every` steps, and at the
end on the whole validation and test splits.

This is the baseline's loss per token; its seconds per step over the profile's links come from the
bus (`sync-avg`, the same bytes and barrier per step: suites/quality.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from dloco.cluster.config import ClusterConfig
from dloco.cluster.records import run_task
from dloco.protocol.errors import ConfigError

# a finished run's result and its final parameters, in its run directory
RESULT, FINAL_PARAMS = "in_process.json", "final.npz"


@dataclasses.dataclass
class InProcessRun:
    """What one in-process data-parallel run measured: the model's validation loss every
    `eval_every` steps, against steps and cluster tokens, and the whole splits at the end."""

    budget: int
    islands: int
    # optimizer steps, each on the global batch (every island's batch)
    rounds: int
    cluster_tokens: int
    before: float
    after: float
    # {"step", "cluster_tokens", "since_start", "eval_loss"}, the last one at the end
    curve: list[dict]
    seconds: float
    # the final model on each whole split: {"validation": loss, "test": loss}
    final: dict = dataclasses.field(default_factory=dict)
    # the peak learning rate at the global batch, and the seed
    lr: float = 0.0
    seed: int = 0

    def save(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESULT).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> InProcessRun | None:
        """A finished run's result, or None when there is none."""
        try:
            return cls(**json.loads((run_dir / RESULT).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def concatenate(batches: list):
    """The islands' batches as one global batch (arrays or pytrees of arrays, along the leading
    axis)."""
    import jax

    return jax.tree.map(lambda *parts: np.concatenate(parts), *batches)


def all_reduce_step(trainers: list, batches: list) -> float:
    """One data-parallel step of replicas: each Trainer's gradient on its batch, their mean (the
    all-reduce), the same optimizer step on every Trainer.  Returns the mean loss."""
    import jax

    results = [trainer.gradient(batch) for trainer, batch in zip(trainers, batches, strict=True)]
    mean = jax.tree.map(lambda *parts: sum(parts) / len(parts), *[g for _, g in results])
    for trainer in trainers:
        trainer.apply(mean)
    return float(np.mean([float(loss) for loss, _ in results]))


def peak_lr(config: ClusterConfig) -> float:
    from dloco.island.config import TrainConfig

    return config.model.lr if config.model.lr is not None else TrainConfig.lr


def _islands_tasks(config: ClusterConfig, run) -> list:
    """Each island's task, built as that island builds it."""
    from dloco.island.task import TaskContext, build

    return [
        build(run.task, TaskContext(index, run.islands, run.seed, run.batch, 10**9, run.options))
        for index in range(run.islands)
    ]


def train_sync_dp(
    config: ClusterConfig, log=lambda line: None, run_dir: Path | None = None
) -> InProcessRun:
    """Train `config` (mode sync-dp, a token budget) in one process; see the module's docstring.
    With `run_dir`, the final parameters go to RUN_DIR/final.npz (to evaluate them again)."""
    from dloco.island import schedule

    if config.mode != "sync-dp" or not config.tokens:
        raise ConfigError(
            "in-process training is for mode sync-dp with a token budget, got mode"
            f" {config.mode!r}, tokens {config.tokens}"
        )
    run = run_task(config)
    tasks = _islands_tasks(config, run)
    first = tasks[0]
    trainer = _global_trainer(config, run, first)
    held_out = first.eval_batches
    started = time.monotonic()
    before = trainer.evaluate(held_out)
    curve, tokens, steps = [], 0, 0
    while tokens < config.tokens:
        trainer.set_rate_scale(
            schedule.decay(round(1e6 * schedule.progress(tokens, config.tokens)) / 1e6)
        )
        batches = [next(task.batches) for task in tasks]
        trainer.step(concatenate(batches))
        tokens += sum(task.tokens_in(batch) for task, batch in zip(tasks, batches, strict=True))
        steps += 1
        if steps % config.eval_every == 0 or tokens >= config.tokens:
            curve.append(
                {
                    "step": steps,
                    "cluster_tokens": tokens,
                    "since_start": time.monotonic() - started,
                    "eval_loss": trainer.evaluate(held_out),
                }
            )
            log(
                f"sync-dp in one process: step {steps}, {tokens:,} of {config.tokens:,} cluster"
                f" tokens, validation loss {curve[-1]['eval_loss']:.4f}"
            )
    return InProcessRun(
        config.tokens,
        run.islands,
        steps,
        tokens,
        before,
        curve[-1]["eval_loss"],
        curve,
        time.monotonic() - started,
        _finish(trainer, first, run_dir),
        peak_lr(config),
        run.seed,
    )


def _global_trainer(config: ClusterConfig, run, task):
    """One Trainer of the first island's model at the global batch (every island's), its peak lr
    the cluster's `[model] lr`, its rate decaying over the cluster's token budget."""
    from dloco.island.config import TrainConfig
    from dloco.island.train import Trainer

    train = TrainConfig(
        batch=run.batch * run.islands,
        lr=peak_lr(config),
        seed=run.seed,
        eval_every=config.eval_every,
        budget_tokens=config.tokens,
    )
    return Trainer(task.model, task.loss, train, task.optimizer, task.metrics)


def _finish(trainer, task, run_dir: Path | None) -> dict:
    """The final model on the whole validation and test splits ({} when the task has none); with
    `run_dir`, its parameters saved there."""
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(run_dir / FINAL_PARAMS, **trainer.params())
    if task.whole_split is None:
        return {}
    return {name: trainer.evaluate_whole(task.whole_split(name)) for name in ("validation", "test")}
