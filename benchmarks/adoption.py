"""`dloco bench adoption`: what an island's adoption of a snapshot costs beside a training step.

Adopting a fragment reads the island's parameters (theta, for the rebase) and writes the
fragment's new values back; a send reads them too.  Each is timed against one inner step of the
same Trainer in the same run (the reference), and against the walk of the whole model graph that
`flat_params` and `assign` do (how a Trainer read and wrote parameters before it went through
their Variables).  The default model and batch of `dloco island`; the fragment is the largest of
P = 4.  Medians of `reps`, the four measures taken in turn each repetition so that they see the
same machine load.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from dloco.island import bytelm, data, exchange
from dloco.island.config import ModelConfig, TrainConfig
from dloco.island.train import assign, flat_params


def run(reps: int = 20, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)):
    corpus = data.load()
    shards, _, _ = data.split(corpus, 1)
    model, train = ModelConfig(), TrainConfig()
    trainer = bytelm.trainer(model, train)
    batches = data.Batches(shards[0], train.batch, model.context, 0, 0)
    params = trainer.params()
    fragments = exchange.partition({path: value.shape for path, value in params.items()}, 4)
    fragment = max(fragments, key=lambda paths: sum(params[p].size for p in paths))
    # compile
    for _ in range(2):
        trainer.step(batches.next())
    log(f"bench adoption: {reps} repetitions ...")
    times: dict[str, list[float]] = {
        "step": [],
        "read": [],
        "write": [],
        "read_by_walk": [],
        "write_by_walk": [],
    }

    def timed(name: str, action: Callable[[], object]) -> object:
        began = time.perf_counter()
        result = action()
        times[name].append(time.perf_counter() - began)
        return result

    for _ in range(reps):
        timed("step", lambda: trainer.step(batches.next()))
        theta = timed("read", trainer.params)
        values = {path: theta[path] + np.float32(1e-4) for path in fragment}
        del theta
        timed("write", lambda: trainer.set_params(values))
        timed("read_by_walk", lambda: flat_params(trainer.model))
        timed("write_by_walk", lambda: assign(trainer.model, values, trainer.replicated))
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    return {
        "reps": reps,
        "fragment_values": int(sum(params[p].size for p in fragment)),
        "median_ms": {name: round(value, 3) for name, value in ms.items()},
        "adoption_vs_step": round((ms["read"] + ms["write"]) / ms["step"], 4),
        "walk_adoption_vs_step": round((ms["read_by_walk"] + ms["write_by_walk"]) / ms["step"], 4),
        "walk_over_direct": round(
            (ms["read_by_walk"] + ms["write_by_walk"]) / (ms["read"] + ms["write"]), 1
        ),
    }


def summary(result: dict) -> str:
    ms = result["median_ms"]
    return (
        f"adoption: read {ms['read']:.1f} ms + write {ms['write']:.1f} ms"
        f" ({result['fragment_values']:,}-value fragment) = {result['adoption_vs_step']:.2%} of a"
        f" {ms['step']:.0f} ms step; by walking the graph {ms['read_by_walk']:.1f} +"
        f" {ms['write_by_walk']:.1f} ms = {result['walk_adoption_vs_step']:.2%}"
        f" ({result['walk_over_direct']}x; medians of {result['reps']})"
    )
