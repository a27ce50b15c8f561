"""Text out of a run's global model: `dloco sample` (deterministic in its seed, the argmax at
temperature 0), the report's closing sample, how token ids become text, and the byte LM's sampler
against continuations computed by hand from the model's logits."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dloco.analysis import sampling
from dloco.analysis.globalmodel import build_task
from dloco.analysis.report import read_exit_codes
from dloco.analysis.runinfo import RunTask
from dloco.cli import main
from dloco.island import bytelm, tokenizing
from dloco.island.config import ModelConfig
from dloco.island.model import ByteLM
from dloco.island.task import TaskError
from dloco.island.train import assign
from tests.run_dir_helpers import CODE, checkpoint_params, make_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with two checkpoints: after a fold of fragment 0, then after one of fragment
    1."""
    return make_run(tmp_path_factory.mktemp("sample"))


def test_byte_ids_decode_with_errors_replaced_and_a_fence_no_line_can_close():
    assert sampling.bytes_decode([104, 105, 0xFF, 300, 0xC3, 0xA9]) == "hi\ufffd\ufffd\u00e9"
    assert sampling.fenced("a\n```\nb\x00\r\n") == ["````text", "a", "```", "b\ufffd", "````"]
    assert sampling.fenced("plain") == ["```text", "plain", "```"]


def test_the_exit_codes_are_read_from_the_tables_not_from_a_sample(tmp_path):
    (tmp_path / "report.md").write_text(
        "run, planned length 10 s\n## Islands\n\n| region | exit |\n|---|---|\n| a | 0 |\n\n##"
        " Sample\n\n````text\n## Islands\n| b | x |\n```\n````\n"
    )
    assert read_exit_codes(tmp_path) == (10.0, {"a": 0})


def test_a_token_file_says_how_its_ids_become_text(tmp_path):
    assert sampling.codec_for({}) is sampling.BYTES
    text = tmp_path / "text.py"
    text.write_text(CODE * 300)
    tokenizing.tokenize(text, tmp_path / "bytes.bin", tokenizing.TokenizeConfig("bytes"))
    assert sampling.codec_for({"tokens": str(tmp_path / "bytes.bin")}) is sampling.BYTES
    tokenizing.tokenize(text, tmp_path / "bpe.bin", tokenizing.TokenizeConfig("bpe", 300))
    bpe = sampling.codec_for({"tokens": str(tmp_path / "bpe.bin")})
    ids = bpe.encode("def add(a, b):")
    assert (
        bpe.decode(ids) == "def add(a, b):" and len(ids) < len("def add(a, b):") and max(ids) >= 256
    )
    (tmp_path / "bpe.json").unlink()
    with pytest.raises(sampling.SampleError, match="sidecar is missing"):
        sampling.codec_for({"tokens": str(tmp_path / "bpe.bin")})


@pytest.fixture(scope="module")
def tiny():
    """A byte LM with a context of 8, and its last position's logits for a sequence (compiled: eager
    calls take seconds each)."""
    model = ByteLM(ModelConfig(vocab=256, width=16, depth=1, heads=2, context=8), nnx.Rngs(3))
    last_logits = nnx.jit(lambda model, tokens_1xT: model(tokens_1xT)[0, -1])
    return model, lambda tokens: np.asarray(last_logits(model, jnp.asarray([tokens])))


def test_temperature_zero_is_the_argmax_continuation_and_top_k_one_is_greedy(tiny):
    model, last_logits = tiny
    prompt, tokens = [100, 101, 102], [100, 101, 102]
    # past the context of 8: the window slides
    for _ in range(12):
        tokens.append(int(np.argmax(last_logits(tokens[-8:]))))
    greedy = tokens[3:]
    assert bytelm.sample(model, np.array(prompt), 12, temperature=0).tolist() == greedy
    assert (
        bytelm.sample(model, np.array(prompt), 12, temperature=0.8, top_k=1, seed=5).tolist()
        == greedy
    )
    seeded = bytelm.sample(model, np.array(prompt), 12, temperature=1.0, top_k=3, seed=1)
    assert (
        seeded.tolist()
        == bytelm.sample(model, np.array(prompt), 12, temperature=1.0, top_k=3, seed=1).tolist()
    )
    assert (
        seeded.tolist()
        != bytelm.sample(model, np.array(prompt), 12, temperature=1.0, top_k=3, seed=2).tolist()
    )
    # among the prompt's 3 likeliest
    assert int(seeded[0]) in set(np.argsort(-last_logits(prompt))[:3].tolist())
    for bad, message in (
        ([], "at least one token"),
        ([65, 256], "token id 256"),
        ([65], "temperature must be >= 0"),
    ):
        with pytest.raises(TaskError, match=message):
            bytelm.generate(
                model, np.array(bad, dtype=np.int64), temperature=-1.0 if bad == [65] else 1.0
            )


def test_the_time_budget_cuts_a_sample_short(tiny):
    model, _ = tiny
    ticks = iter(range(100))
    got = sampling.continue_text(
        model,
        sampling.BYTES,
        "ab",
        10,
        0.0,
        None,
        0,
        budget_s=2.5,
        clock=lambda: float(next(ticks)),
    )
    assert (
        got.cut and len(got.ids) == 3 and got.prompt_ids == [97, 98] and got.text.startswith("ab")
    )


def test_sample_prints_text_the_same_for_a_seed_and_the_argmax_at_temperature_zero(run, capsys):
    def sample(*extra: str) -> str:
        assert main(["sample", str(run.dir), "--prompt", "def ", "--length", "24", *extra]) == 0
        return capsys.readouterr().out

    once, again, other = sample("--seed", "3"), sample("--seed", "3"), sample("--seed", "4")
    assert once == again and once.startswith("def ") and len(once) > len("def \n") and other != once
    model = sampling.model_for(run.task, checkpoint_params(run.checkpoints[-1]))
    greedy = bytelm.sample(model, np.frombuffer(b"def ", np.uint8), 24, temperature=0)
    assert (
        sample("--temperature", "0")
        == sampling.bytes_decode(list(b"def ") + greedy.tolist()) + "\n"
    )


def test_sample_needs_the_built_in_lm_and_a_run_directory(run, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    RunTask("mytask.py:task", {}, seed=0, batch=8, islands=1).write(other)
    assert main(["sample", str(other), "--prompt", "x"]) == 2
    assert "dloco sample: sampling needs the built-in LM" in capsys.readouterr().err
    assert main(["sample", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    first, *rest = sorted(run.init)
    with pytest.raises(sampling.SampleError, match=f"builds: this task's model has {first} "):
        sampling.model_for(run.task, {path: run.init[path] for path in rest})


def test_the_report_ends_with_a_sample_or_says_why_there_is_none(run):
    model = build_task(run.task).model
    trainer = SimpleNamespace(model=model, set_params=lambda params: assign(model, params))
    lines = sampling.report_lines(run.task, run.dir, trainer)
    assert (
        lines[0] == "## Sample"
        and "checkpoint at record" in lines[2]
        and lines[4] == "```text"
        and lines[5].startswith("def ")
    )
    assert lines[-2] == "```"
    broken = RunTask(
        run.task.task, {**run.task.options, "tokens": str(run.dir / "missing.bin")}, 0, 8, 2
    )
    assert sampling.report_lines(broken, run.dir, trainer)[2].startswith(
        "No sample: SampleError: the run trained on the token file"
    )
    assert sampling.report_lines(RunTask("x.py:task", {}, 0, 8, 2), run.dir, trainer) == []
