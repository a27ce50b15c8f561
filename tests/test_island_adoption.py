"""The island loop's adoption of global fragments that arrive between its sends, with real JAX
training on the real corpus and an in-process link that plays the merger's part (no sockets):
which work the next delta carries."""

from __future__ import annotations

import numpy as np
import pytest

from dloco.island import bytelm, data
from dloco.island.config import ModelConfig, SyncConfig, TrainConfig
from dloco.island.loop import IslandLoop
from dloco.island.metrics import MetricsWriter

TINY = ModelConfig(width=32, depth=1, heads=2, context=32)
TRAIN = TrainConfig(batch=4, eval_every=10_000, max_steps=8)


class ScriptedLink:
    """Takes the island's deltas; hands it `snapshot` (fragment 0 at `version`) once, after
    `at_step` steps."""

    def __init__(self, loop_steps: list[int], at_step: int, version: int = 1) -> None:
        self.bytes_sent = self.bytes_received = 0
        self.unfolded: dict[int, int] = {}
        self.published: list[tuple[int, int, dict, int, int]] = []
        # (fragment, version) of each rebase_unsent
        self.rebases: list[tuple[int, int]] = []
        self.snapshot: dict[str, np.ndarray] | None = None
        self.loop_steps, self.at_step, self.version = loop_steps, at_step, version

    def publish(self, fragment, base_version, delta, steps, tokens) -> None:
        self.published.append(
            (fragment, base_version, {p: v.copy() for p, v in delta.items()}, steps, tokens)
        )

    def rebase_unsent(self, fragment, version) -> None:
        self.rebases.append((fragment, version))

    def snapshots(self):
        if self.snapshot is not None and self.loop_steps[0] >= self.at_step:
            snapshot, self.snapshot = self.snapshot, None
            return [(0, self.version, snapshot)]
        return []


@pytest.fixture(scope="module")
def corpus_parts():
    shards, evaluation, _ = data.split(data.load(), 1)
    return shards[0], data.eval_batches(evaluation, 4, 32, 1)


def run(corpus_parts, adoption: str, snapshot_of_start: bool) -> ScriptedLink:
    """P = 1, H = 8: fragment 0 (the whole model) is sent after step 8.  After step 5 the link
    delivers version 1 of it, equal to the model the island started from (nothing folded yet)."""
    shard, evaluation = corpus_parts
    trainer = bytelm.trainer(TINY, TRAIN)
    start = trainer.params()
    steps = [0]
    link = ScriptedLink(steps, at_step=5)
    if snapshot_of_start:
        link.snapshot = {p: v.copy() for p, v in start.items()}
    loop = IslandLoop(
        trainer,
        data.Batches(shard, 4, 32, 0, 0),
        evaluation,
        TRAIN,
        SyncConfig(fragments=1, interval=8, adoption=adoption),
        MetricsWriter(None),
        link=link,
        count=bytelm.count_tokens,
    )
    exchange = loop._exchange

    def counting(step: int) -> None:
        steps[0] = step
        exchange(step)

    loop._exchange = counting
    loop.run(8)
    return link


@pytest.mark.timeout(240)
def test_a_snapshot_between_sends_keeps_the_islands_work_with_rebase_and_drops_it_with_replace(
    corpus_parts,
):
    undisturbed = run(corpus_parts, "rebase", snapshot_of_start=False)
    rebased = run(corpus_parts, "rebase", snapshot_of_start=True)
    replaced = run(corpus_parts, "replace", snapshot_of_start=True)
    ((_, base0, delta0, steps0, tokens0),) = undisturbed.published
    ((_, base1, delta1, steps1, tokens1),) = rebased.published
    ((_, base2, delta2, steps2, tokens2),) = replaced.published
    # rebase: the same 8 steps of work, now based on version 1 (a snapshot equal to the start moves
    # nothing but rounding: start + (theta - start) is theta to within an ulp; 3e-8 here, deltas
    # ~1e-3)
    assert (base0, steps0, tokens0) == (0, 8, 8 * 4 * 32) and (base1, steps1, tokens1) == (
        1,
        8,
        8 * 4 * 32,
    )
    for path in delta0:
        np.testing.assert_allclose(delta1[path], delta0[path], rtol=1e-3, atol=1e-6)
    # rebase also tells the link, whose outbox rebases an unsent delta of the fragment
    assert rebased.rebases == [(0, 1)] and replaced.rebases == []
    # replace: the first 5 steps are thrown away; the delta carries 3 steps of work
    assert (base2, steps2, tokens2) == (1, 3, 3 * 4 * 32)

    def norm(delta):
        return float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in delta.values())))

    # 0.105 vs 0.165 here (the learning rate is still warming up)
    assert norm(delta2) < 0.8 * norm(delta0)


def test_rebase_puts_the_unsent_progress_on_the_newest_of_several_arrivals(corpus_parts):
    """Two versions of a fragment arriving together: the newest is taken, once, and the island's
    progress since its anchor goes on top of it: theta = Theta_2 + (theta - anchor)."""
    shard, evaluation = corpus_parts
    trainer = bytelm.trainer(TINY, TRAIN)
    loop = IslandLoop(
        trainer,
        data.Batches(shard, 4, 32, 0, 0),
        evaluation,
        TRAIN,
        SyncConfig(fragments=2, interval=8),
        MetricsWriter(None),
        count=bytelm.count_tokens,
    )
    fragment = 0
    paths = list(loop.progress[fragment].anchor)
    anchor = {p: loop.progress[fragment].anchor.value(p).copy() for p in paths}
    # progress since the anchor
    for _ in range(3):
        trainer.step(loop.batches.next())
    loop.progress[fragment].steps, loop.progress[fragment].tokens = 3, 384
    theta = trainer.params()
    older = {p: anchor[p] + 1.0 for p in paths}
    newer = {p: anchor[p] - 2.0 for p in paths}
    other = {p: v for p, v in theta.items() if p not in paths}
    loop._adopt([(fragment, 1, older), (fragment, 2, newer), (fragment, 1, older)])
    after = trainer.params()
    for p in paths:
        np.testing.assert_allclose(after[p], newer[p] + (theta[p] - anchor[p]), rtol=0, atol=1e-6)
    # the other fragment is untouched
    for p, v in other.items():
        np.testing.assert_array_equal(after[p], v)
    progress = loop.progress[fragment]
    assert (progress.version, progress.steps, progress.tokens) == (2, 3, 384)
    assert all(np.array_equal(progress.anchor.value(p), newer[p]) for p in paths)
    # an old version arriving late changes nothing
    loop._adopt([(fragment, 1, older)])
    assert all(np.array_equal(trainer.params()[p], after[p]) for p in paths)


def test_an_adoption_right_after_a_send_keeps_what_holding_the_anchor_rounded_off(corpus_parts):
    """A blocking island adopts right after its send, with no steps unsent: theta - anchor is then
    the int8 rounding of its progress (exchange.advance), which the rebase keeps on top of the new
    value, so that the next delta carries it (overwriting theta would lose it every round)."""
    shard, evaluation = corpus_parts
    trainer = bytelm.trainer(TINY, TRAIN)
    link = ScriptedLink([0], at_step=10**9)
    loop = IslandLoop(
        trainer,
        data.Batches(shard, 4, 32, 0, 0),
        evaluation,
        TRAIN,
        SyncConfig(fragments=2, interval=8),
        MetricsWriter(None),
        link=link,
        count=bytelm.count_tokens,
    )
    # progress of a size int8 rounds off visibly (a few steps of a warming-up rate round to ulps)
    rng = np.random.default_rng(0)
    base = loop.progress[0].anchor.base
    trainer.set_params(
        {p: v + 0.05 * rng.standard_normal(v.shape, np.float32) for p, v in base.items()}
    )
    loop.progress[0].steps, loop.progress[0].tokens = 3, 384
    loop._send([0])
    anchor, theta = loop.progress[0].anchor, trainer.params()
    rounding = {p: theta[p] - anchor.value(p) for p in anchor}
    assert max(float(np.abs(r).max()) for r in rounding.values()) > 1e-4
    newer = {p: anchor.base[p] - 2.0 for p in anchor}
    loop._adopt([(0, 1, newer)])
    after = trainer.params()
    for p in anchor:
        np.testing.assert_allclose(after[p], newer[p] + rounding[p], rtol=0, atol=1e-6)
    progress = loop.progress[0]
    assert progress.anchor.offset is None and (progress.version, progress.steps) == (1, 0)


def test_a_leaving_island_sends_every_fragments_unsent_work_once(corpus_parts):
    """P = 2, H = 8: fragment 0 goes out at step 4 (and would at 12), fragment 1 at step 8.
    Stopping after step 10, the flush sends fragment 0's 6 steps and fragment 1's 2, each from its
    last send.
    """
    shard, evaluation = corpus_parts
    trainer = bytelm.trainer(TINY, TRAIN)
    link = ScriptedLink([0], at_step=10**9)
    loop = IslandLoop(
        trainer,
        data.Batches(shard, 4, 32, 0, 0),
        evaluation,
        TRAIN,
        SyncConfig(fragments=2, interval=8),
        MetricsWriter(None),
        link=link,
        count=bytelm.count_tokens,
    )
    loop.run(10)
    assert [(f, steps) for f, _, _, steps, _ in link.published] == [(0, 4), (1, 8)]
    anchors = {f: loop.progress[f].anchor.values() for f in (0, 1)}
    theta = trainer.params()
    assert loop.flush() == 2
    assert [(f, steps, tokens) for f, _, _, steps, tokens in link.published[2:]] == [
        (0, 6, 6 * 4 * 32),
        (1, 2, 2 * 4 * 32),
    ]
    # each is the change since the last send: what holding the anchor rounded off is in it too,
    # so the deltas sent add up to the change since the fragment's base up to the anchor now
    # held, whose rounding goes out with the next delta (exchange.advance)
    for fragment, _, delta, _, _ in link.published[2:]:
        anchor = loop.progress[fragment].anchor
        for p, v in delta.items():
            np.testing.assert_allclose(v, anchors[fragment][p] - theta[p], rtol=0, atol=1e-3)
            np.testing.assert_array_equal(v, anchors[fragment][p] - anchor.value(p))
            sent = sum(d[p] for f, _, d, _, _ in link.published if f == fragment)
            np.testing.assert_allclose(sent, anchor.base[p] - anchor.value(p), rtol=0, atol=1e-6)
    # nothing is sent twice
    assert loop.flush() == 0 and len(link.published) == 4
