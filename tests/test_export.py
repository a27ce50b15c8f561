"""A run's global model out of its run directory: `dloco export` (safetensors, bit for bit the
merger's checkpoint), `dloco sample` (text, deterministic in its seed), the report's closing sample,
and the byte LM's sampler against continuations computed by hand from the model's logits.

The run directory is a real one but for the islands: the task record and initial model `dloco up`
writes, and a merger's write-ahead log and checkpoints written by MergerCore and checkpoint.save
after folds of pseudo-random deltas."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, safe_open

from dloco import protocol
from dloco.analysis import export, sampling
from dloco.analysis.globalmodel import build_task
from dloco.analysis.report import read_exit_codes
from dloco.analysis.runinfo import RunDirError, RunTask
from dloco.cli import main
from dloco.cluster import config as cluster_config
from dloco.cluster.records import run_task
from dloco.island import bytelm, tokenizing
from dloco.island.config import ModelConfig
from dloco.island.model import ByteLM
from dloco.island.task import TaskError
from dloco.island.train import assign, flat_params
from dloco.merger import checkpoint
from dloco.merger.config import MergeConfig, MergerConfig
from dloco.merger.core import MergerCore
from dloco.merger.recovery import checkpoint_dir, wal_dir
from dloco.merger.wal import WriteAheadLog
from tests.merger_helpers import assemble, delta_chunks

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n"


def cluster_file(folder: Path, corpus: Path) -> Path:
    path = folder / "cluster.toml"
    path.write_text(
        "[model]\nwidth = 32\ndepth = 1\nheads = 2\ncontext = 32\nbatch = 8\ncorpus ="
        f' "{corpus}"\n\n[sync]\nfragments = 2\n\n[[regions]]\nname = "a"\n\n[[regions]]\nname ='
        ' "b"\n'
    )
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with two checkpoints: after a fold of fragment 0, then after one of fragment
    1."""
    root = tmp_path_factory.mktemp("export")
    corpus = root / "corpus.py"
    corpus.write_text(CODE * 200)
    config = cluster_config.load(cluster_file(root, corpus))
    run_dir = root / "run"
    run_dir.mkdir()
    task = run_task(config)
    task.write(run_dir)
    params = flat_params(build_task(task).model)
    np.savez(run_dir / "init.npz", **params)
    wal = WriteAheadLog(wal_dir(run_dir / "merger"), fsync="never")
    core = MergerCore(
        MergerConfig(MergeConfig(max_staleness=2)),
        protocol.model_fingerprint(params),
        protocol.partition({p: a.shape for p, a in params.items()}, 2),
        params,
        log=wal,
    )
    saved = []
    for fragment in (0, 1):
        for i, island in enumerate(("a", "b")):
            chunks = delta_chunks(
                core.fragments[fragment],
                island,
                1 + fragment,
                fragment,
                0,
                seed=10 * fragment + i,
                params=params,
                first_seq=1 + fragment,
                max_chunk_bytes=1 << 20,
            )
            core.submit(assemble(chunks), now=float(fragment))
        for ready in core.due(now=fragment + 100.0)[0]:
            core.fold(ready)
        saved.append(checkpoint.save(checkpoint_dir(run_dir / "merger"), core, wal.next_index))
    wal.close()
    return SimpleNamespace(
        dir=run_dir,
        config=config,
        task=task,
        init=params,
        checkpoints=saved,
        versions=[s.version for s in core.states],
    )


def checkpoint_params(path: Path) -> dict[str, np.ndarray]:
    return {
        p: np.frombuffer(e["data"], dtype=np.dtype(e["dtype"])).reshape(e["shape"])
        for fragment in checkpoint.read(path)["fragments"]
        for p, e in fragment["params"].items()
    }


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


# ---- pure parts
# --------------------------------------------------------------------------------------


def test_a_checkpoints_content_becomes_flat_float32_parameters_byte_for_byte():
    a, b = np.arange(6, dtype="<f4").reshape(2, 3), np.array([-0.0, np.float32(1e-45)], dtype="<f4")
    saved = {
        "fragments": [
            {"params": {"x/a": {"dtype": "<f4", "shape": [2, 3], "data": a.tobytes()}}},
            {"params": {"y/b": {"dtype": "<f4", "shape": [2], "data": b.tobytes()}}},
        ]
    }
    flat = export.params_of(saved)
    assert (
        sorted(flat) == ["x/a", "y/b"]
        and flat["x/a"].dtype == np.float32
        and flat["x/a"].shape == (2, 3)
    )
    assert (bits(flat["y/b"]) == [0x80000000, 1]).all() and (flat["x/a"] == a).all()


def test_the_metadata_names_the_run_the_checkpoint_and_the_task():
    model = export.GlobalModel(
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}, 57, (3, 2), "abc"
    )
    task = RunTask(
        "dloco.island.bytelm:task", {"width": 32, "corpus": "/c"}, seed=7, batch=8, islands=2
    )
    assert export.metadata(Path("/runs/x"), model, task) == {
        "format": "dloco-global-model/1",
        "run_dir": "/runs/x",
        "checkpoint": "57",
        "digest": "abc",
        "fragment_versions": "[3, 2]",
        "parameters": "10",
        "task": "dloco.island.bytelm:task",
        "task_options": '{"corpus": "/c", "width": 32}',
        "seed": "7",
    }


def test_the_run_task_record_reads_back_and_a_bad_one_is_named(tmp_path):
    task = RunTask("x.py:task", {"k": 1.5, "flag": True, "name": "n"}, seed=3, batch=4, islands=5)
    task.write(tmp_path)
    assert RunTask.read(tmp_path) == task
    (tmp_path / "task.json").write_text(
        '{"task": "x.py:task", "options": {}, "seed": "3", "batch": 4, "islands": 5}'
    )
    with pytest.raises(RunDirError, match="task.json must be an object with task"):
        RunTask.read(tmp_path)
    with pytest.raises(RunDirError, match="has no task.json.*--config"):
        RunTask.read(tmp_path / "elsewhere")


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


# ---- the byte LM's sampler
# ---------------------------------------------------------------------------


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


# ---- a run directory
# ---------------------------------------------------------------------------------


def test_export_writes_the_latest_checkpoint_bit_for_bit_with_its_metadata(run, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run.dir), "--out", str(out)]) == 0
    assert "dloco export: wrote" in capsys.readouterr().out
    loaded, expected = load_file(str(out)), checkpoint_params(run.checkpoints[-1])
    assert sorted(loaded) == sorted(expected) == sorted(run.init)
    for path in expected:
        assert (
            loaded[path].dtype == np.float32 and (bits(loaded[path]) == bits(expected[path])).all()
        ), path
    # the folds moved it from the initial model
    assert any(not np.array_equal(loaded[p], run.init[p]) for p in loaded)
    with safe_open(str(out), "np") as handle:
        meta = handle.metadata()
    assert (
        meta["checkpoint"] == str(int(run.checkpoints[-1].stem))
        and json.loads(meta["fragment_versions"]) == run.versions
    )
    assert (
        meta["task"] == "dloco.island.bytelm:task"
        and json.loads(meta["task_options"])["width"] == 32
    )
    assert meta["parameters"] == str(sum(a.size for a in run.init.values())) and meta[
        "run_dir"
    ] == str(run.dir.resolve())
    # no temporary file left
    assert not [p for p in tmp_path.iterdir() if p.name != "model.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    # as any new file, not safetensors' 0600
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_picks_a_checkpoint_by_its_record_and_names_the_ones_there(run, tmp_path, capsys):
    first = int(run.checkpoints[0].stem)
    out = tmp_path / "first.safetensors"
    assert main(["export", str(run.dir), "--checkpoint", str(first), "--out", str(out)]) == 0
    loaded, expected = load_file(str(out)), checkpoint_params(run.checkpoints[0])
    assert all((bits(loaded[p]) == bits(expected[p])).all() for p in expected)
    assert main(["export", str(run.dir), "--checkpoint", "999", "--out", str(out)]) == 2
    records = ", ".join(str(int(p.stem)) for p in run.checkpoints)
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"has no checkpoint at record 999; it has {records}")
    )


def test_export_errors_exit_2_and_say_what_is_wrong(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    # prepared, never checkpointed
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    run.task.write(fresh)
    cases = [
        ([str(empty), "--out", str(tmp_path / "m.st")], "is not a run directory"),
        ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "m.st")], "is not a directory"),
        ([str(fresh), "--out", str(tmp_path / "m.st")], "has no checkpoint of the merger yet"),
        ([str(run.dir), "--out", str(tmp_path / "no" / "such" / "m.st")], "cannot write"),
        ([str(run.dir), "--out", str(tmp_path)], "is a directory"),
    ]
    for args, message in cases:
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("dloco export: ") and message in err, err


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


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_real_run_ends_its_report_with_a_sample_and_exports_its_final_model(tmp_path):
    """`dloco up` (two islands, 20 steps each), then the commands a user runs on its directory."""
    import subprocess
    import sys

    from tests.cluster_helpers import small_profile

    (tmp_path / "c.toml").write_text(
        small_profile(400, 10, '[[regions]]\nname = "a"\n[[regions]]\nname = "b"\n', max_steps=20)
    )
    run_dir = tmp_path / "run"

    def dloco(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dloco", *args], capture_output=True, text=True, timeout=500
        )

    up = dloco("up", "--config", str(tmp_path / "c.toml"), "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stdout[-2000:]
    report = (run_dir / "report.md").read_text()
    sample = report[report.index("## Sample") :].splitlines()
    assert (
        "checkpoint at record" in sample[2]
        and sample[4] == "```text"
        and sample[5].startswith("def ")
        and sample[-1] == "```"
    )
    assert dloco("export", str(run_dir), "--out", str(tmp_path / "m.safetensors")).returncode == 0
    with np.load(run_dir / "init.npz") as init:
        assert sorted(load_file(str(tmp_path / "m.safetensors"))) == sorted(init.files)
    twice = [
        dloco("sample", str(run_dir), "--prompt", "import ", "--length", "40", "--seed", "1")
        for _ in range(2)
    ]
    assert (
        twice[0].returncode == 0
        and twice[0].stdout == twice[1].stdout
        and twice[0].stdout.startswith("import ")
    )
