"""The built-in LM as a task: its size presets have the parameter counts they claim (GPT-2 small and
medium in shape), options override a preset, and data the model has no embedding for is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dloco.island import bytelm
from dloco.island.config import MODEL_SIZES, ModelConfig
from dloco.island.model import ByteLM
from dloco.island.task import TaskContext, TaskError, build


def parameters(config: ModelConfig) -> tuple[int, int]:
    """(scalars, tensors) of the LM, from shapes alone (nothing allocated)."""
    leaves = jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: ByteLM(config, nnx.Rngs(0))), nnx.Param)
    )
    return sum(int(np.prod(leaf.shape)) for leaf in leaves), len(leaves)


def test_presets_have_the_sizes_they_claim():
    # GPT-2 small by hand: 50,257 x 768 tied embeddings, 1,024 x 768 positions, per block 2 layer
    # norms (2 x 2 x 768), qkv 768 x 2,304 and out 768 x 768 without bias, MLP 768 x 3,072 + 3,072
    # and 3,072 x 768 + 768; a final layer norm.
    block = 4 * 768 + 768 * 2304 + 768 * 768 + 768 * 3072 + 3072 + 3072 * 768 + 768
    assert parameters(bytelm.model_config({"size": "124m"})) == (
        50257 * 768 + 1024 * 768 + 12 * block + 2 * 768,
        2 + 12 * 10 + 2,
    )
    # the 0.87 M default, bytes
    assert parameters(bytelm.model_config({"size": "tiny"}))[0] == 873_216
    counts = [parameters(bytelm.model_config({"size": size}))[0] for size in MODEL_SIZES]
    assert counts == sorted(counts) and 354e6 < counts[-1] < 355e6


def test_options_override_a_preset_and_the_data_sets_the_vocabulary():
    config = bytelm.model_config({"size": "124m", "context": 128})
    assert (config.width, config.depth, config.context, config.vocab, config.tie_embeddings) == (
        768,
        12,
        128,
        50257,
        True,
    )
    # tiny takes the data's vocabulary
    assert bytelm.model_config({}, data_vocab=4096).vocab == 4096
    with pytest.raises(TaskError, match="token ids up to 4095, the model's vocabulary only 256"):
        bytelm.model_config({"vocab": 256}, data_vocab=4096)
    with pytest.raises(TaskError, match="model size must be one of"):
        bytelm.model_config({"size": "xl"})


@pytest.mark.timeout(120)
def test_the_builtin_task_refuses_unknown_options_and_gives_what_the_contract_asks(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    context = TaskContext(
        island_index=1,
        islands=2,
        seed=0,
        batch=4,
        max_steps=10,
        options={
            "corpus": str(tmp_path / "text.txt"),
            "width": 16,
            "depth": 1,
            "heads": 2,
            "context": 8,
            "eval_batches": 2,
        },
    )
    task = build("dloco.island.bytelm:task", context)
    batch = next(task.batches)
    assert batch.shape == (4, 9) and len(task.eval_batches) == 2 and task.tokens_in(batch) == 32
    assert set(task.metrics(task.model, batch)) == {"accuracy"}
    with pytest.raises(TaskError, match="has no options \\['colour'\\]"):
        build("dloco.island.bytelm:task", TaskContext(0, 1, 0, 4, 10, {"colour": "red"}))


def test_too_little_held_out_data_and_bad_counts_are_refused_by_name(tmp_path):
    from dloco.island import data

    # 12,001 tokens with the newline after the file; 5 % held out: 601, its first half validation
    (tmp_path / "small.txt").write_text("x" * 12_000)
    with pytest.raises(
        data.CorpusError,
        match="the validation split holds 300 tokens, fewer than one sequence of 1025",
    ):
        build(
            "dloco.island.bytelm:task",
            TaskContext(
                0,
                1,
                0,
                2,
                10,
                {
                    "corpus": str(tmp_path / "small.txt"),
                    "context": 1024,
                    "width": 16,
                    "depth": 1,
                    "heads": 2,
                },
            ),
        )
    for options, message in (
        ({"eval_batches": 0}, "eval_batches must be a positive int"),
        ({"corpus": 2024}, "corpus must be a path"),
    ):
        with pytest.raises(TaskError, match=message):
            build(
                "dloco.island.bytelm:task",
                TaskContext(
                    0, 1, 0, 2, 10, {"corpus": str(tmp_path / "small.txt"), "context": 8, **options}
                ),
            )


def test_parameters_keep_their_dtype_when_the_merger_sets_them():
    """float32 on the wire; a bf16 parameter stays bf16 in the model (no silent doubling, no
    recompiling)."""
    import jax.numpy as jnp

    from dloco.island.config import TrainConfig
    from dloco.island.train import Trainer

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    trainer = Trainer(model, lambda m, b: (m(b) ** 2).mean(), TrainConfig(batch=2))
    trainer.set_params({"kernel": np.full((4, 2), 0.5, np.float32)})
    assert (
        model.kernel.get_value().dtype == jnp.bfloat16
        and trainer.params()["kernel"].dtype == np.float32
    )
    np.testing.assert_array_equal(trainer.params()["kernel"], np.full((4, 2), 0.5, np.float32))
