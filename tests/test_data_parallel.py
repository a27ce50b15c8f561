"""Data parallelism as the quality suite's `sync-dp` baseline trains it (suites/inprocess.py): one
AdamW step on the all-reduced gradient, every replica the same parameters and optimizer state; and
the corpus's three disjoint splits that its figures read."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dloco.cluster import config as cluster_config
from dloco.cluster.sections import ModelSection
from dloco.island import data
from dloco.island.config import TrainConfig
from dloco.island.task import TaskContext, build
from dloco.island.train import Trainer
from dloco.suites import inprocess

TINY = {"width": 16, "depth": 1, "heads": 2, "context": 16}
BATCH = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """200 kB of real text (the start of the default corpus): small splits, quick to evaluate
    whole."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(data.load().tokens_N[:200_000].tobytes())
    return str(path)


def tasks(corpus: str, islands: int, seed: int = 0) -> list:
    options = {**TINY, "corpus": corpus}
    return [
        build("dloco.island.bytelm:task", TaskContext(i, islands, seed, BATCH, 100, options))
        for i in range(islands)
    ]


def trainer(task, batch: int) -> Trainer:
    return Trainer(task.model, task.loss, TrainConfig(batch=batch, warmup=0, schedule="constant"))


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_an_all_reduce_of_two_islands_is_one_optimizer_on_their_concatenated_batch(corpus):
    islands, replicas_of = tasks(corpus, 2), tasks(corpus, 2)
    replicas = [trainer(t, BATCH) for t in replicas_of]
    single = trainer(tasks(corpus, 1)[0], 2 * BATCH)
    for _ in range(4):
        batches = [next(t.batches) for t in islands]
        inprocess.all_reduce_step(replicas, batches)
        single.step(inprocess.concatenate(batches))
    # every replica: the same parameters and the same AdamW state, bit for bit
    first, second = replicas[0].params(), replicas[1].params()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    states = [leaves(nnx.state(r.optimizer)) for r in replicas]
    assert len(states[0]) > 3 and all(np.array_equal(a, b) for a, b in zip(*states, strict=True))
    # and the one optimizer on the global batch, to float rounding (the mean of two gradients)
    one = single.params()
    for key in first:
        np.testing.assert_allclose(first[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_averaging_parameters_after_separate_adamw_steps_is_not_data_parallelism(corpus):
    """What `sync-avg` does (local AdamW, H = 1): each island's own step, then the mean of the
    parameters.  After one step from the same start it already differs from the all-reduce."""
    islands = tasks(corpus, 2)
    batches = [next(t.batches) for t in islands]
    local = [trainer(t, BATCH) for t in tasks(corpus, 2)]
    for t, batch in zip(local, batches, strict=True):
        t.step(batch)
    averaged = {k: (local[0].params()[k] + local[1].params()[k]) / 2 for k in local[0].params()}
    replicas = [trainer(t, BATCH) for t in tasks(corpus, 2)]
    inprocess.all_reduce_step(replicas, batches)
    reduced = replicas[0].params()
    worst = max(float(np.max(np.abs(averaged[k] - reduced[k]))) for k in reduced)
    # Adam's first step moves each value by about lr (3e-3) along its gradient's sign: where the
    # islands' signs differ, averaging cancels what the all-reduce keeps
    assert worst > 1e-3


def test_sync_dp_in_one_process_trains_to_its_budget_and_reports_the_whole_splits(corpus):
    base = cluster_config.load()
    config = dataclasses.replace(
        base.with_mode("sync-dp").with_tokens(4 * BATCH * 16 * 6),
        model=ModelSection(
            width=16, depth=1, heads=2, context=16, batch=BATCH, lr=6e-3, corpus=corpus
        ),
        eval_every=2,
    )
    done = inprocess.train_sync_dp(config)
    # one step on the four islands' batches at once: 4 x 4 sequences x 16 tokens a step
    assert done.rounds == 6 and done.cluster_tokens == config.tokens
    assert [p["step"] for p in done.curve] == [2, 4, 6]
    assert done.lr == 6e-3 and done.seed == 0
    assert set(done.final) == {"validation", "test"}
    assert all(np.isfinite(v) and v < done.before for v in done.final.values())


def test_sync_dp_runs_in_one_process_only():
    from dloco.cluster import launcher
    from dloco.protocol.errors import ConfigError

    config = cluster_config.load().with_mode("sync-dp")
    with pytest.raises(ConfigError, match="one process only.*sync-avg"):
        launcher.run(config, __import__("pathlib").Path("/nonexistent/never-made"))


@pytest.mark.parametrize("islands", [1, 3, 4])
def test_the_splits_are_disjoint_from_each_other_and_from_every_shard(islands):
    corpus = data.load()
    split = data.split(corpus, islands)
    parts = [*split.shards, split.validation, split.test]
    # views of one array, in order, end to end: every token in exactly one part
    base = corpus.tokens_N.__array_interface__["data"][0]
    starts = [p.__array_interface__["data"][0] - base for p in parts]
    ends = [start + p.size for start, p in zip(starts, parts, strict=True)]
    assert starts[0] == 0 and ends[-1] == corpus.tokens_N.size
    assert all(end == start for end, start in zip(ends, starts[1:]))
    assert all(p.size > 0 for p in parts)
    # the held-out 5 % in halves
    assert abs(split.validation.size - split.test.size) <= 1
    assert split.validation.size + split.test.size == pytest.approx(
        0.05 * corpus.tokens_N.size, abs=2
    )


def test_a_whole_split_predicts_each_token_once():
    tokens_N = np.arange(1000, dtype=np.uint8)
    batches = data.whole_split(tokens_N, 4, 10)
    # 99 windows of 11 tokens start 10 apart: 24 batches of 4, the last 3 windows in a 25th
    assert [b.shape for b in batches] == [(4, 11)] * 24 + [(3, 11)]
    windows = np.concatenate(batches)
    predicted = np.concatenate([w[1:] for w in windows])
    assert np.array_equal(predicted, np.arange(1, 991, dtype=np.int32) % 256)
    with pytest.raises(data.CorpusError, match="fewer than one sequence"):
        data.whole_split(tokens_N[:10], 4, 10)


def test_a_whole_split_is_a_mean_over_windows_not_over_batches(corpus):
    (task,) = tasks(corpus, 1)
    t = trainer(task, BATCH)
    windows = np.concatenate(data.whole_split(np.arange(400, dtype=np.uint8), 5, 16))
    per_window = [t.evaluate([w[None]]) for w in windows]
    uneven = [windows[:5], windows[5:10], windows[10:12]]
    assert len(windows) == 24 and t.evaluate_whole(uneven + [windows[12:]]) == pytest.approx(
        float(np.mean(per_window)), rel=1e-5
    )
