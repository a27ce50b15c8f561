"""The merger's global model, evaluated: at the end of a run, and at chosen moments during it,
rebuilt from the merger's write-ahead log (merger.recovery.replay: the same bytes the merger held).

The islands' evaluations measure each island's own parameters; this measures the one model the
cluster trains, against the wall clock and against the tokens the whole cluster had trained by then
(`cluster_tokens_at`: every island, every life), which is the compute spent.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from dloco.analysis.runinfo import RunTask, merger_folds, shard_run_dirs, wall


class Evaluator:
    """The islands' task, built as an island builds it, to evaluate parameters on its held-out
    batches."""

    def __init__(self, run: RunTask, run_dir: Path) -> None:
        from dloco.island.config import TrainConfig
        from dloco.island.train import Trainer

        task = build_task(run)
        self.task = run
        config = TrainConfig(batch=run.batch, seed=run.seed)
        self.trainer = Trainer(task.model, task.loss, config, task.optimizer, task.metrics)
        self.batches = task.eval_batches
        self.whole_split = task.whole_split
        self.run_dir = run_dir

    def loss(self, params: dict[str, np.ndarray]) -> float:
        return self.metrics(params)["loss"]

    def metrics(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        """Held-out loss and the task's metrics ({"loss": ..., name: ...})."""
        self.trainer.set_params(params)
        return self.trainer.evaluate_all(self.batches)

    def on_splits(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        """The loss on the whole validation and test splits ({} when the task has none)."""
        if self.whole_split is None:
            return {}
        self.trainer.set_params(params)
        return {
            split: self.trainer.evaluate_whole(self.whole_split(split))
            for split in ("validation", "test")
        }

    def final_on_splits(self) -> dict[str, float]:
        """The merger's last checkpoint on the whole splits ({} without one, or without splits)."""
        from dloco.analysis.export import latest_saved, params_of

        saved = latest_saved(self.run_dir)
        return {} if saved is None else self.on_splits(params_of(saved))

    def initial(self) -> dict[str, float]:
        with np.load(self.run_dir / "init.npz") as initial:
            return self.metrics({k: initial[k] for k in initial.files})

    def final(self) -> dict[str, float] | None:
        """The merger's last checkpoint (written when it stops), evaluated; None without one."""
        from dloco.analysis.export import latest_saved, params_of

        saved = latest_saved(self.run_dir)
        if saved is None:
            return None
        return self.metrics(params_of(saved))


def build_task(run: RunTask):
    """The run's task (island.task.Task), built as island 0 builds it: its model holds the initial
    parameters."""
    from dloco.island.task import TaskContext, build

    context = TaskContext(
        island_index=0,
        islands=run.islands,
        seed=run.seed,
        batch=run.batch,
        max_steps=1,
        options=run.options,
    )
    return build(run.task, context)


def cluster_tokens_at(lives_by_island: dict[str, list[list[dict]]], at: float) -> int:
    """Tokens the whole cluster had trained by wall time `at`: each island's last step event at or
    before it, summed over the island's lives (a restarted island counts from 0 again)."""
    total = 0
    for runs in lives_by_island.values():
        for life in runs:
            walls = [e["wall"] for e in life if "wall" in e]
            i = bisect.bisect_right(walls, at)
            if i:
                total += life[i - 1].get("tokens", 0)
    return total


def when_cluster_reached(lives_by_island: dict[str, list[list[dict]]], tokens: int) -> float | None:
    """The first wall time at which the cluster had trained `tokens` (None: never)."""
    steps = sorted(
        (e["wall"], (name, i), e.get("tokens", 0))
        for name, runs in lives_by_island.items()
        for i, life in enumerate(runs)
        for e in life
        if "wall" in e and e.get("step", 0) > 0
    )
    current: dict[tuple[str, int], int] = {}
    for at, life, trained in steps:
        current[life] = trained
        if sum(current.values()) >= tokens:
            return at
    return None


def states_at(run_dir: Path, walls: list[float]) -> list[dict[str, np.ndarray] | None]:
    """The global model's parameters at each wall time: every fold the merger had made by then
    (its fold log lines give each fold's time), rebuilt by replaying its log.  None before the
    first fold.  A fold whose log line is missing (a merger killed between the two writes) takes
    the time of the fold before it (the first fold: the earliest logged).  With merger shards each
    shard's log is replayed and each fragment taken from the shard that folds it.  Raises
    ReplayError when the rebuilt model is not the one the merger held: a checkpoint's digest
    differs (other fold kernels or jax than the log's), or the log has folds and merger.log none."""
    folded_at: dict[tuple[int, int], float] = {}
    for event in merger_folds(run_dir):
        folded_at.setdefault((event["fragment"], event["version"]), wall(event))
    directories = shard_run_dirs(run_dir)
    count = len(directories)
    by_shard = [
        _replayed_states(
            run_dir,
            directory,
            {key: at for key, at in folded_at.items() if key[0] % count == shard},
            walls,
        )
        for shard, directory in enumerate(directories)
    ]
    found: list[dict[str, np.ndarray] | None] = []
    initial: dict[int, list] = {}
    for at in range(len(walls)):
        held = [states[at] for states in by_shard]
        if all(states is None for states in held):
            found.append(None)
            continue
        fragments = len(next(states for states in held if states is not None))
        found.append(_params([_of_owner(held, f, directories, initial) for f in range(fragments)]))
    return found


def _of_owner(held: list, fragment: int, directories: list[Path], initial: dict[int, list]):
    """`fragment`'s state from the shard that folds it (`held`: each shard's states, None before its
    first fold), at its start where that shard has not folded yet (its genesis record: a shard
    holds no other shard's fragment)."""
    from dloco.merger.state.recovery import initial_states

    owner = fragment % len(held)
    if held[owner] is not None:
        return held[owner][fragment]
    if owner not in initial:
        initial[owner] = initial_states(directories[owner])
    return initial[owner][fragment]


def _replayed_states(
    run_dir: Path, directory: Path, folded_at: dict[tuple[int, int], float], walls: list[float]
) -> list:
    """One merger's (shard's) fragment states at each wall time (None before its first fold);
    `folded_at`: when each of its folds was logged."""
    from dloco.merger.state.core import ReplayError
    from dloco.merger.state.recovery import replay

    order = sorted(range(len(walls)), key=lambda i: walls[i])
    found: list = [None] * len(walls)
    progress = {"next": 0, "time": min(folded_at.values(), default=float("-inf")), "states": None}

    def on_fold(index, record, report, core) -> None:
        at = max(
            progress["time"],
            folded_at.get((record["fragment"], record["version"]), progress["time"]),
        )
        while progress["next"] < len(order) and walls[order[progress["next"]]] < at:
            found[order[progress["next"]]] = progress["states"]
            progress["next"] += 1
        # host views: a later fold of a fragment takes its step in place, on a copy of what a
        # view holds
        progress["time"], progress["states"] = at, [_viewed(state) for state in core.states]

    for position, expected, rebuilt in replay(directory, on_fold, strict=False):
        if expected != rebuilt:
            raise ReplayError(
                f"{run_dir}: the model rebuilt from the log differs from the merger's checkpoint at"
                f" record {position} ({directory.name})"
            )
    if progress["states"] is not None and not folded_at:
        log = "merger.log" if directory.name in ("merger", "standby") else f"{directory.name}.log"
        raise ReplayError(f"{run_dir}: the log has folds but logs/{log} dates none of them")
    for i in order[progress["next"] :]:
        found[i] = progress["states"]
    return found


def _viewed(state):
    return state._replace(params={path: np.asarray(v) for path, v in state.params.items()})


def _params(states) -> dict[str, np.ndarray] | None:
    if states is None:
        return None
    return {path: np.asarray(value) for state in states for path, value in state.params.items()}
