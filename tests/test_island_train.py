"""Real JAX training on the real corpus, small: data shards, loss going down, NaN stop, devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dloco.island import bytelm, data
from dloco.island.config import ModelConfig, TrainConfig
from dloco.island.train import DivergedError, flat_params

TINY = ModelConfig(width=32, depth=1, heads=2, context=32)


@pytest.fixture(scope="module")
def corpus():
    return data.load()


def test_shards_are_disjoint_deterministic_and_share_one_eval_split(corpus):
    shards, evaluation, test = data.split(corpus, 3)
    total = sum(s.size for s in shards) + evaluation.size + test.size
    assert total == corpus.tokens_N.size and evaluation.size == pytest.approx(
        0.025 * total, rel=0.01
    )
    ends = [np.shares_memory(a, b) for i, a in enumerate(shards) for b in shards[i + 1 :]]
    assert not any(ends)
    again = data.load()
    # the stdlib: hundreds of files
    assert again.digest == corpus.digest and corpus.files > 100
    a, b = (
        data.Batches(shards[1], 4, 32, seed=0, island=1),
        data.Batches(shards[1], 4, 32, seed=0, island=1),
    )
    assert np.array_equal(a.next(), b.next())
    assert not np.array_equal(
        data.Batches(shards[1], 4, 32, 0, 1).next(), data.Batches(shards[1], 4, 32, 0, 2).next()
    )


def test_any_folder_of_text_is_a_corpus_and_tiny_ones_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 2000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# title\n" * 1000)
    corpus = data.load(tmp_path)
    assert corpus.files == 2 and corpus.tokens_N.size > 30_000
    (tmp_path / "small.txt").write_text("x")
    with pytest.raises(data.CorpusError, match="at least"):
        data.load(tmp_path / "small.txt")
    with pytest.raises(data.CorpusError, match="does not exist"):
        data.load(tmp_path / "missing")


def test_training_lowers_the_held_out_loss(corpus):
    shards, evaluation, _ = data.split(corpus, 1)
    trainer = bytelm.trainer(TINY, TrainConfig(batch=8, lr=1e-2, warmup=5, max_steps=60))
    batches, held_out = (
        data.Batches(shards[0], 8, 32, 0, 0),
        data.eval_batches(evaluation, 8, 32, 4),
    )
    before = trainer.evaluate(held_out)
    for _ in range(60):
        trainer.step(batches.next())
    after = trainer.evaluate(held_out)
    assert before > 5.0 and after < before - 1.5


def test_a_step_updates_in_place_and_never_under_a_held_view(corpus):
    """The step's parameters and optimizer state are donated: no second copy of the state.  A host
    view taken before a step keeps the values it showed (that buffer is copied, not overwritten)."""
    shards, _, _ = data.split(corpus, 1)
    trainer = bytelm.trainer(TINY, TrainConfig(batch=4))
    batches = data.Batches(shards[0], 4, 32, 0, 0)
    trainer.step(batches.next())
    before = trainer.model.head.kernel[...].unsafe_buffer_pointer()
    trainer.step(batches.next())
    assert trainer.model.head.kernel[...].unsafe_buffer_pointer() == before
    view = trainer.params()["head/kernel"]
    held = view.copy()
    trainer.step(batches.next())
    assert np.array_equal(view, held)
    assert not np.array_equal(trainer.params()["head/kernel"], held)


def test_params_read_and_write_the_live_model_across_steps(corpus):
    """params() and set_params() go to the parameters' Variables directly: after steps they still
    see what a traversal of the model sees, and a subset written is what the next step trains."""
    shards, _, _ = data.split(corpus, 1)
    trainer = bytelm.trainer(TINY, TrainConfig(batch=4))
    batches = data.Batches(shards[0], 4, 32, 0, 0)
    for _ in range(2):
        trainer.step(batches.next())
    walked = flat_params(trainer.model)
    assert list(trainer.params()) == list(walked)
    assert all(np.array_equal(trainer.params()[p], walked[p]) for p in walked)
    written = {"head/kernel": np.full(walked["head/kernel"].shape, 0.01, np.float32)}
    trainer.set_params(written)
    assert np.array_equal(flat_params(trainer.model)["head/kernel"], written["head/kernel"])
    assert np.array_equal(trainer.params()["blocks/0/up/kernel"], walked["blocks/0/up/kernel"])
    trainer.step(batches.next())
    after = flat_params(trainer.model)
    assert np.array_equal(trainer.params()["head/kernel"], after["head/kernel"])
    assert not np.array_equal(after["head/kernel"], written["head/kernel"])


def test_nan_stops_the_island_with_a_clear_error(corpus):
    shards, _, _ = data.split(corpus, 1)
    trainer = bytelm.trainer(TINY, TrainConfig(batch=4))
    params = trainer.params()
    trainer.set_params({"head/kernel": np.full(params["head/kernel"].shape, np.nan, np.float32)})
    with pytest.raises(DivergedError, match="nothing from this state is published"):
        trainer.step(data.Batches(shards[0], 4, 32, 0, 0).next())


RUN_STEPS = """
import json, sys
import jax
from dloco.island import bytelm, data
from dloco.island.config import ModelConfig, TrainConfig

corpus = data.load(); shards, _, _ = data.split(corpus, 1)
trainer = bytelm.trainer(
    ModelConfig(width=32, depth=1, heads=2, context=32), TrainConfig(batch=8, lr=1e-2, warmup=2)
)
batches = data.Batches(shards[0], 8, 32, 0, 0)
losses = [trainer.step(batches.next())[0] for _ in range(5)]
print(json.dumps({"devices": len(jax.devices()), "losses": losses}))
"""


def run_with_devices(count: int) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", RUN_STEPS],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# two training processes of 20 s: -m e2e keeps the default run within its budget
@pytest.mark.e2e
def test_four_devices_give_the_loss_of_one_for_the_same_global_batch():
    one, four = run_with_devices(1), run_with_devices(4)
    assert (one["devices"], four["devices"]) == (1, 4)
    assert np.allclose(one["losses"], four["losses"], rtol=1e-4, atol=1e-5), (one, four)
