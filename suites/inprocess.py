"""`sync-dp` in one process: the cluster's sync-dp arithmetic without the bus.

In the cluster's `sync-dp` mode (cluster/modes.py MODES) every island takes one AdamW step on its
own shard with its own optimizer state, sends the fp32 change, and the merger averages the islands'
changes (outer SGD at lr 1) and every island adopts the average before its next step.  This module
does the same in one process: one Trainer per island (its task built as that island builds it, so
the same shard, batches, initial model and held-out batches), one step each, the parameters
averaged, every Trainer set to the average.  The rate follows the budget as an island's does
(island/schedule.py), from the cluster tokens an island has heard of, and the run stops when they
reach the budget, as the cluster's islands do.

What it saves is the bus: the cluster's sync-dp moves the whole model through the merger at every
step (fp32 up and down, the write-ahead log on disk), about 3 s per step on two cores against
about 0.5 s here.  Its loss per step is the cluster's (`tests/test_quality_suite.py` compares the
two on the quick model); its seconds per step are not, and the quality suite takes those from a
short run through the bus (`sync-dp-linked`).
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

# a finished run's curve, in its run directory
RESULT = "in_process.json"


@dataclasses.dataclass
class InProcessRun:
    """What one in-process sync-dp run measured: the shared model's held-out loss every
    `eval_every` rounds, against rounds (each island's steps) and cluster tokens."""

    budget: int
    islands: int
    rounds: int
    cluster_tokens: int
    before: float
    after: float
    # {"step", "cluster_tokens", "since_start", "eval_loss"}, the last one at the end
    curve: list[dict]
    seconds: float

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


def average(values: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The element-wise mean of several islands' parameters (float32, as the merger's fp32
    average)."""
    if not values:
        raise ValueError("nothing to average")
    return {
        path: np.mean([v[path] for v in values], axis=0, dtype=np.float32) for path in values[0]
    }


def _islands(config: ClusterConfig, run) -> list[tuple]:
    """Each island's (task, Trainer) for `run` (cluster.records.run_task's), trained to the
    cluster's token budget."""
    from dloco.island.config import TrainConfig
    from dloco.island.task import TaskContext, build
    from dloco.island.train import Trainer

    train = TrainConfig(
        batch=run.batch, seed=run.seed, eval_every=config.eval_every, budget_tokens=config.tokens
    )
    islands = []
    for index in range(run.islands):
        task = build(
            run.task, TaskContext(index, run.islands, run.seed, run.batch, 10**9, run.options)
        )
        islands.append((task, Trainer(task.model, task.loss, train, task.optimizer, task.metrics)))
    return islands


def train_sync_dp(config: ClusterConfig, log=lambda line: None) -> InProcessRun:
    """Train `config` (mode sync-dp, a token budget) in one process; see the module's docstring."""
    from dloco.island import schedule

    if config.mode != "sync-dp" or not config.tokens:
        raise ConfigError(
            "in-process training is for mode sync-dp with a token budget, got mode"
            f" {config.mode!r}, tokens {config.tokens}"
        )
    run = run_task(config)
    islands = _islands(config, run)
    evaluate = islands[0][1].evaluate
    held_out = islands[0][0].eval_batches
    started = time.monotonic()
    before = evaluate(held_out)
    # As an island of the cluster hears them: the merger's ack of a round comes after the island has
    # set its rate for the next one, so its view lags by a round (island/loop.py _follow_budget);
    # it stops once that view reaches the budget.
    curve, tokens, heard, rounds = [], 0, 0, 0
    while heard < config.tokens:
        scale = schedule.decay(round(1e6 * schedule.progress(heard, config.tokens)) / 1e6)
        trained, previous = [], tokens
        for task, trainer in islands:
            batch = next(task.batches)
            trainer.set_rate_scale(scale)
            trainer.step(batch)
            tokens += task.tokens_in(batch)
            trained.append(trainer.params())
        heard = previous
        mean = average(trained)
        for _, trainer in islands:
            trainer.set_params(mean)
        rounds += 1
        if rounds % config.eval_every == 0 or heard >= config.tokens:
            curve.append(
                {
                    "step": rounds,
                    "cluster_tokens": tokens,
                    "since_start": time.monotonic() - started,
                    "eval_loss": evaluate(held_out),
                }
            )
            log(
                f"sync-dp in one process: round {rounds}, {tokens:,} of {config.tokens:,} cluster"
                f" tokens, held-out loss {curve[-1]['eval_loss']:.4f}"
            )
    return InProcessRun(
        config.tokens,
        run.islands,
        rounds,
        tokens,
        before,
        curve[-1]["eval_loss"],
        curve,
        time.monotonic() - started,
    )
