"""A run's token budget: the inner schedule decays over the cluster's tokens (island/schedule.py),
which the merger counts from heartbeats backed by deltas (merger/state/trained_tokens.py) and tells
in every ack (PROTOCOL.md §6.1).  Values by hand; then a merger and two islands, one at half
speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dloco import protocol
from dloco.cluster import config as cluster_config
from dloco.cluster.ports import free_ports
from dloco.cluster.sections import Region
from dloco.cluster.topology import commands
from dloco.island import schedule
from dloco.island.config import TrainConfig
from dloco.island.train import Trainer
from dloco.merger.state.trained_tokens import TrainedTokens
from dloco.protocol.errors import ConfigError
from tests.conftest import header_of, reason_of, with_header
from tests.merger_process_helpers import TINY, start_bound_merger, start_connected_island


@pytest.mark.parametrize(
    ("tokens", "budget", "p", "rate"),
    [
        (0, 1000, 0.0, 1.0),
        # cos(pi/4) = sqrt(1/2): 0.868198
        (250, 1000, 0.25, 0.1 + 0.45 * (1 + math.sqrt(0.5))),
        # half-way: the mean of 1 and the floor
        (500, 1000, 0.5, 0.55),
        (1000, 1000, 1.0, 0.1),
        # past the budget: the floor, not below it
        (5000, 1000, 1.0, 0.1),
    ],
)
def test_the_decay_at_given_cluster_tokens(tokens, budget, p, rate):
    assert schedule.progress(tokens, budget) == p
    assert schedule.decay(schedule.progress(tokens, budget)) == pytest.approx(rate, abs=1e-12)


def test_fast_and_slow_islands_at_the_same_cluster_tokens_take_the_same_rate():
    """The view is the merger's count, or an island's own tokens where it has heard less: so a fast
    island (3,000 tokens of its own) and a slow one (1,000) that heard 6,000 are at one point."""
    fast, slow = schedule.cluster_view(6000, 3000), schedule.cluster_view(6000, 1000)
    assert fast == slow == 6000
    # standalone, or before any ack
    assert schedule.cluster_view(0, 1000) == 1000
    with pytest.raises(ValueError):
        schedule.progress(10, 0)


class Line(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(4))


def test_the_trainers_step_is_scaled_by_the_decay():
    """AdamW's first step moves each weight by lr * (sign(g) + weight_decay * w): with lr 0.01,
    w = 1 and the decay at p = 0.5 (0.55), by 0.0055 * 1.01."""
    config = TrainConfig(batch=1, lr=0.01, warmup=0, budget_tokens=1000)
    trainer = Trainer(Line(), lambda model, batch: (model.w[...] * batch).sum(), config)
    trainer.set_rate_scale(schedule.decay(schedule.progress(500, 1000)))
    trainer.step(np.ones((1, 4), np.float32))
    np.testing.assert_allclose(trainer.params()["w"], 1 - 0.0055 * 1.01, rtol=1e-5)
    trainer.set_rate_scale(0.0)
    before = trainer.params()["w"].copy()
    trainer.step(np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(trainer.params()["w"], before)


def test_without_a_budget_the_rate_scale_is_refused():
    trainer = Trainer(
        Line(), lambda model, batch: (model.w[...] * batch).sum(), TrainConfig(batch=1)
    )
    with pytest.raises(protocol.DlocoError, match="token budget"):
        trainer.set_rate_scale(0.5)


def test_the_merger_counts_claims_only_as_far_as_deltas_back_them():
    count = TrainedTokens()
    # before any delta: not a life yet
    count.heartbeat("a", 1, 10**6)
    assert count.total == 0 and not count.lives
    count.delta("a", 1, 0, 100)
    count.delta("a", 1, 1, 100)
    # fragment 0 is the most covered: 200 trained at its last send
    count.delta("a", 1, 0, 100)
    assert count.total == 200
    # within one round (the largest delta, 100) of what deltas back
    count.heartbeat("a", 1, 250)
    assert count.total == 250
    # a claim past it counts as 200 + 100
    count.heartbeat("a", 1, 2**60)
    assert count.total == 300
    # the largest claim stays
    count.heartbeat("a", 1, 5)
    assert count.total == 300
    # a's next life: both count
    count.delta("a", 2, 0, 40)
    count.delta("b", 7, 0, 60)
    assert count.total == 300 + 40 + 60


def test_one_keys_claimed_tokens_count_at_most_a_few_times_the_other_islands():
    count = TrainedTokens()
    # alone in fragment 0: what it claims
    count.delta("a", 1, 0, 2**40)
    count.delta("a", 1, 0, 2**40)
    assert count.total == 2**41
    # b's 100 per delta there: a's two deltas count 4 x 100 each; b's in full
    count.delta("b", 1, 0, 100)
    assert count.total == 800 + 100
    # a's heartbeat claim: at most one more delta in hand, within its limit (400)
    count.heartbeat("a", 1, 2**60)
    assert count.total == 1200 + 100
    # islands within 4x of each other (batch, interval) count in full
    honest = TrainedTokens()
    for sender, tokens in (("fast", 200), ("slow", 100), ("fast", 200), ("slow", 100)):
        honest.delta(sender, 1, 0, tokens)
    assert honest.total == 400 + 200


def test_heartbeat_and_ack_carry_tokens_and_refuse_a_bad_count():
    beat = protocol.Heartbeat(sender="a", epoch=1, seq=3, stream=0, tokens=123_456)
    ack = protocol.Ack(sender="merger", epoch=2, seq=9, cursors=(), results=(), tokens=2**40)
    for message in (beat, ack):
        assert protocol.decode([bytes(f) for f in protocol.encode(message)]) == message
    for message in (beat, ack):
        frames, header = header_of(message)
        for bad in (-1, 1.5, "7", None, True):
            assert reason_of(with_header(frames, {**header, "tokens": bad})) == "field_value"
        del header["tokens"]
        assert reason_of(with_header(frames, header)) == "missing_field"


def test_a_budget_reaches_every_island_in_every_mode_and_refuses_a_second_bound():
    base = cluster_config.ClusterConfig(regions=(Region("a"), Region("b", slowdown=2.0)))
    for mode in ("decoupled", "sync-diloco", "sync-dp"):
        cluster = base.with_mode(mode).with_tokens(50_000)
        lines = commands(cluster, _addresses(), "run")
        for name in ("a", "b"):
            flags = [str(x) for x in lines[name]]
            assert flags[flags.index("--budget-tokens") + 1] == "50000", mode
    assert "--budget-tokens" not in [str(x) for x in commands(base, _addresses(), "run")["a"]]
    with pytest.raises(ConfigError, match="give one"):
        cluster_config.ClusterConfig(regions=base.regions, max_steps=100, tokens=1000)


def _addresses():
    from dloco.cluster.topology import Addresses

    return Addresses(("1", "2", "3", "4"), "5")


# a merger process and two training islands: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_merger_and_two_islands_one_at_half_speed_follow_one_budget(tmp_path):
    init = tmp_path / "init.npz"
    subprocess.run(
        [sys.executable, "-m", "dloco", "island", "--write-init", str(init), *TINY],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # two islands' tokens: 80 steps of 8 x 32
    ports, steps, budget = free_ports(3), 80, 2 * 80 * 8 * 32
    # islands of seconds: the first folds' wait for a second island could outlast one's run
    merger = start_bound_merger(tmp_path, init, ports, "--cold-wait", "0")
    islands = []
    try:
        for i, slowdown in enumerate(("1", "2")):
            islands.append(
                start_connected_island(
                    tmp_path,
                    i,
                    ports,
                    *["--max-steps", str(steps), "--budget-tokens", str(budget)],
                    *["--slowdown", slowdown, "--eval-every", "1000", "--interval", "4"],
                )
            )
        summaries = [
            json.loads(p.communicate(timeout=240)[0].decode().strip().splitlines()[-1])
            for p in islands
        ]
    finally:
        for p in [*islands, merger]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    for summary in summaries:
        assert summary["acks"].get("folded", 0) == summary["deltas_sent"] > 0, summary
    # Every delta was folded, so at the last fold the merger had heard every step of both: its
    # count is exactly what they trained (each island's last send covers its last step).
    folds = [json.loads(line) for line in open(tmp_path / "merger.log") if '"fold"' in line]
    assert folds[-1]["cluster_tokens"] == budget
    assert [f["cluster_tokens"] for f in folds] == sorted(f["cluster_tokens"] for f in folds)
    seen = []
    for i in range(2):
        lines = [json.loads(line) for line in open(tmp_path / f"isl-{i}.jsonl")]
        stepped = [e for e in lines if e.get("step", 0) > 0]
        progress = [e["budget_progress"] for e in stepped]
        assert progress == sorted(progress) and 0 < progress[-1] <= 1
        # never behind its own work
        assert all(p >= e["tokens"] / budget - 1e-6 for p, e in zip(progress, stepped))
        seen.append(max(p - e["tokens"] / budget for p, e in zip(progress, stepped)))
    # the islands overlap in time, so at least one of them took the other's work into its schedule
    assert max(seen) > 4 * 8 * 32 / budget


def test_a_global_model_worse_than_its_start_or_every_island_is_reported_loudly():
    from dloco.analysis.report import warnings

    assert warnings(6.0, 2.0, {"a": 2.5, "b": 1.9}) == [] and warnings(6.0, None, {}) == []
    lines = warnings(1.144, 1.613, {"a": 0.74, "b": 1.09})
    assert lines[0] == "## WARNING: the global model"
    assert "worse than it started: held-out loss 1.144 → 1.613" in lines[2]
    assert "worse than every island's last held-out loss (a 0.740, b 1.090)" in lines[3]
    # worse than every island only: one finding
    assert len(warnings(6.0, 2.6, {"a": 2.5, "b": 2.4})) == 5
