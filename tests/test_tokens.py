"""Token files: the memory-mapped reader against hand-written files, `dloco tokenize` end to end
(bytes and a byte-level BPE trained here), and an island training on a token file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dloco.island import data, tokenizing

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "16", "--batch", "4"]


def dloco(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", *args], capture_output=True, text=True, timeout=timeout
    )


def write_sidecar(path, **fields) -> None:
    data.sidecar_path(path).write_text(json.dumps(fields))


@pytest.mark.timeout(10)
def test_a_raw_uint16_file_is_mapped_not_read_its_vocab_from_the_sidecar_or_the_largest_id(
    tmp_path,
):
    # largest id 999
    ids = (np.arange(12_000) * 7 % 1000).astype("<u2")
    path = tmp_path / "train.bin"
    ids.tofile(path)
    corpus = data.load_tokens(path)
    assert isinstance(corpus.tokens_N, np.memmap) and corpus.tokens_N.dtype == np.uint16
    assert (
        np.array_equal(corpus.tokens_N, ids)
        and corpus.vocab == 1000
        and corpus.files == 1
        and corpus.root == str(path)
    )
    assert len(corpus.digest) == 64
    write_sidecar(
        path,
        dtype="uint16",
        vocab=4096,
        tokens=12_000,
        tokenizer="bpe",
        files=3,
        source_digest="ab",
    )
    again = data.load_tokens(path)
    # the sidecar's source is part of it
    assert again.vocab == 4096 and again.files == 3 and again.digest != corpus.digest
    # the same file read as text: bytes
    assert data.load(tmp_path / "train.bin").vocab == 256


@pytest.mark.timeout(10)
def test_uint32_ids_from_an_npy_array_or_a_bin_whose_sidecar_says_so(tmp_path):
    # largest id 89,991: needs uint32
    ids = np.arange(10_000, dtype=np.uint32) * 9
    np.save(tmp_path / "ids.npy", ids)
    corpus = data.load_tokens(tmp_path / "ids.npy")
    assert isinstance(corpus.tokens_N, np.memmap) and corpus.tokens_N.dtype == np.uint32
    assert np.array_equal(corpus.tokens_N, ids) and corpus.vocab == 89_992
    ids.astype("<u4").tofile(tmp_path / "ids32.bin")
    write_sidecar(tmp_path / "ids32.bin", dtype="uint32", vocab=100_000, tokens=10_000)
    corpus = data.load_tokens(tmp_path / "ids32.bin")
    assert (
        corpus.tokens_N.dtype == np.uint32
        and np.array_equal(corpus.tokens_N, ids)
        and corpus.vocab == 100_000
    )


@pytest.mark.timeout(10)
def test_shards_batches_and_eval_windows_of_a_token_file_are_the_hand_computed_slices(tmp_path):
    """Ids equal to their position make every window readable: it is its start and the next ids."""
    np.arange(20_000, dtype="<u2").tofile(tmp_path / "t.bin")
    corpus = data.load_tokens(tmp_path / "t.bin")
    # cut at int(20,000 * 0.95) = 19,000; two shards of 9,500
    shards, evaluation, test = data.split(corpus, 2)
    assert [(int(s[0]), s.size) for s in shards] == [(0, 9_500), (9_500, 9_500)]
    # the held-out 1,000 in halves: validation, then test
    assert (int(evaluation[0]), evaluation.size) == (19_000, 500)
    assert (int(test[0]), test.size) == (19_500, 500)
    # slices stay mapped
    assert isinstance(shards[1], np.memmap)
    batch = data.Batches(shards[1], 3, 8, seed=5, island=1).next()
    starts = np.random.default_rng([5, 1]).integers(0, 9_500 - 9, size=3)
    assert batch.dtype == np.int32 and np.array_equal(batch, 9_500 + starts[:, None] + np.arange(9))
    # six starts, evenly from 0 to 500 - 10
    windows = data.eval_batches(evaluation, 2, 8, 3)
    assert [w.shape for w in windows] == [(2, 9)] * 3
    assert np.array_equal(
        np.concatenate(windows),
        19_000 + np.array([0, 98, 196, 294, 392, 490])[:, None] + np.arange(9),
    )


def _write(tmp_path, name: str, array: np.ndarray, **sidecar):
    path = tmp_path / name
    np.save(path, array) if name.endswith(".npy") else path.write_bytes(array.tobytes())
    if sidecar:
        write_sidecar(path, **sidecar)
    return path


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "name,array,sidecar,message",
    [
        (
            "odd.bin",
            np.zeros(20_001, np.uint8),
            {},
            "20001 bytes, not a multiple of 2 (uint16 ids)",
        ),
        (
            "odd32.bin",
            np.zeros(40_002, np.uint8),
            {"dtype": "uint32", "vocab": 10, "tokens": 10_000},
            "not a multiple of 4 (uint32 ids)",
        ),
        ("short.bin", np.zeros(5_000, "<u2"), {}, "holds 5000 tokens; at least 10,000 are needed"),
        ("short.npy", np.zeros(9_999, "<u4"), {}, "holds 9999 tokens; at least 10,000 are needed"),
        (
            "square.npy",
            np.zeros((200, 100), "<u2"),
            {},
            "shape (200, 100); token ids are a 1-D array",
        ),
        ("floats.npy", np.zeros(20_000, np.float32), {}, "holds float32 values"),
        ("big_endian.npy", np.zeros(20_000, ">u2"), {}, "little-endian uint16 or uint32"),
        (
            "cut.bin",
            np.zeros(20_000, "<u2"),
            {"dtype": "uint16", "vocab": 256, "tokens": 30_000},
            "holds 20000 tokens but its sidecar",
        ),
        (
            "mixed.npy",
            np.zeros(20_000, "<u2"),
            {"dtype": "uint32", "vocab": 256, "tokens": 20_000},
            "holds uint16 ids but its sidecar",
        ),
        (
            "int8.bin",
            np.zeros(20_000, "<u2"),
            {"dtype": "int8", "vocab": 256, "tokens": 20_000},
            "one of uint16, uint32, got 'int8'",
        ),
        (
            "wide.bin",
            np.zeros(20_000, "<u2"),
            {"dtype": "uint16", "vocab": 70_000, "tokens": 20_000},
            "vocab must be in [1, 65536] for uint16",
        ),
        (
            "count.bin",
            np.zeros(20_000, "<u2"),
            {"dtype": "uint16", "vocab": True, "tokens": 20_000},
            "vocab must be an int >= 0, got True",
        ),
        (
            "partial.bin",
            np.zeros(20_000, "<u2"),
            {"dtype": "uint16"},
            "must be an object with dtype, vocab and tokens",
        ),
    ],
)
def test_a_bad_token_file_is_a_corpus_error_that_names_the_problem(
    tmp_path, name, array, sidecar, message
):
    with pytest.raises(
        data.CorpusError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        data.load_tokens(_write(tmp_path, name, array, **sidecar))


@pytest.mark.timeout(10)
def test_a_missing_file_or_a_sidecar_that_is_not_json_is_refused(tmp_path):
    with pytest.raises(data.CorpusError, match="does not exist"):
        data.load_tokens(tmp_path / "nothing.bin")
    np.zeros(20_000, "<u2").tofile(tmp_path / "t.bin")
    (tmp_path / "t.json").write_text("{dtype")
    with pytest.raises(data.CorpusError, match="t.json is not JSON"):
        data.load_tokens(tmp_path / "t.bin")


def test_the_sidecar_round_trips_and_the_dtype_fits_the_vocabulary():
    info = data.TokenFileInfo(
        dtype="uint16",
        vocab=512,
        tokens=10,
        tokenizer="bpe",
        source_digest="ab",
        files=2,
        bytes=40,
        tokenizer_file="x.json",
    )
    assert data.TokenFileInfo.from_json(info.to_json(), "here") == info
    assert [data.dtype_for(v) for v in (256, 65_536, 65_537, 100_000)] == [
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]
    assert data.sidecar_path("d/train.bin").as_posix() == "d/train.json"
    assert tokenizing.tokenizer_path("d/train.bin").as_posix() == "d/train.tokenizer.json"


@pytest.mark.parametrize(
    "text,limit,pieces",
    [
        ("ab\ncd\nef\n", 4, ["ab\n", "cd\n", "ef\n"]),
        ("ab\ncd\nef\n", 6, ["ab\ncd\n", "ef\n"]),
        # no newline in reach: cut at the limit
        ("abcdefgh\n", 3, ["abc", "def", "gh\n"]),
        ("short", 10, ["short"]),
        ("", 10, [""]),
    ],
)
def test_long_texts_are_cut_after_newlines(text, limit, pieces):
    assert tokenizing.line_pieces(text, limit) == pieces and "".join(pieces) == text


@pytest.mark.parametrize(
    "tokenizer,vocab,message",
    [
        ("words", None, "tokenizer must be one of bytes, bpe, got 'words'"),
        ("bytes", 300, "vocabulary of 256, got --vocab 300"),
        ("bpe", 100, "at most 2147483648 ids, got 100"),
    ],
)
def test_tokenizer_settings_are_checked(tokenizer, vocab, message):
    with pytest.raises(data.CorpusError, match=message):
        tokenizing.TokenizeConfig(tokenizer, vocab)


def _text_folder(tmp_path):
    source = tmp_path / "text"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("the quick brown fox\n" * 400)
    (source / "sub" / "b.md").write_bytes("# h\u00e9llo w\u00f6rld \u2603\n".encode() * 300)
    # not a text suffix
    (source / "skipped.bin").write_bytes(b"\x00" * 100)
    return source


@pytest.mark.timeout(60)
def test_tokenize_bytes_writes_exactly_the_bytes_a_text_corpus_holds(tmp_path):
    source = _text_folder(tmp_path)
    out = tmp_path / "out" / "train.bin"
    run = dloco("tokenize", str(source), "--out", str(out), timeout=60)
    assert run.returncode == 0, run.stderr
    expected = (
        (source / "a.txt").read_bytes() + b"\n" + (source / "sub" / "b.md").read_bytes() + b"\n"
    )
    assert np.array_equal(np.fromfile(out, "<u2"), np.frombuffer(expected, np.uint8))
    sidecar = json.loads((tmp_path / "out" / "train.json").read_text())
    assert sidecar == {
        "dtype": "uint16",
        "vocab": 256,
        "tokens": len(expected),
        "tokenizer": "bytes",
        "source_digest": data.load(source).digest,
        "files": 2,
        "bytes": len(expected),
        "tokenizer_file": "",
    }
    assert (
        f"{len(expected):,} tokens" in run.stdout
        and "1.000 bytes/token" in run.stdout
        and "encoded 2/2 files" in run.stderr
    )
    # no temporary file, no tokenizer
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.bin", "train.json"]
    corpus = data.load_tokens(out)
    assert (
        np.array_equal(corpus.tokens_N, data.load(source).tokens_N)
        and corpus.vocab == 256
        and corpus.files == 2
    )


@pytest.mark.timeout(120)
def test_tokenize_bpe_trains_here_and_its_ids_decode_to_the_text_exactly(tmp_path):
    from tokenizers import Tokenizer

    source = _text_folder(tmp_path)
    root, files = data.text_files(None)
    copied = 0
    # about 200 KB of the stdlib, whatever this Python's files weigh
    for file in files:
        if copied >= 200_000:
            break
        shutil.copy(file, source / f"{len(list(source.iterdir())):03d}_{file.name}")
        copied += file.stat().st_size
    out = tmp_path / "bpe.bin"
    run = dloco(
        "tokenize",
        str(source),
        "--out",
        str(out),
        "--tokenizer",
        "bpe",
        "--vocab",
        "512",
        timeout=110,
    )
    assert run.returncode == 0, run.stderr
    sidecar = json.loads((tmp_path / "bpe.json").read_text())
    ids = np.fromfile(out, "<u2")
    assert (
        sidecar["vocab"] == 512
        and sidecar["dtype"] == "uint16"
        and sidecar["tokenizer"] == "bpe"
        and sidecar["tokens"] == ids.size
    )
    assert (
        sidecar["tokenizer_file"] == "bpe.tokenizer.json" and "trained bpe: 512 ids" in run.stderr
    )
    # fewer tokens than bytes: it compresses
    assert ids.max() < 512 and ids.size < sidecar["bytes"] / 2
    text = data.load(source).tokens_N.tobytes().decode()
    assert (
        Tokenizer.from_file(str(tmp_path / sidecar["tokenizer_file"])).decode(ids.tolist()) == text
    )
    assert data.load_tokens(out).vocab == 512


@pytest.mark.timeout(30)
def test_a_tokenize_cut_short_leaves_no_half_file(tmp_path):
    source = _text_folder(tmp_path)
    out = tmp_path / "t.bin"

    def stop(line: str) -> None:
        if line.startswith("encoded"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tokenizing.tokenize(source, out, tokenizing.TokenizeConfig("bytes"), stop)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["text"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,message",
    [
        (("--out", "t.txt"), "must name a .bin file"),
        (("--out", "t.bin", "--vocab", "300"), "vocabulary of 256"),
        (("/nonexistent", "--out", "t.bin"), "/nonexistent does not exist"),
    ],
)
def test_tokenize_errors_exit_2_with_the_reason(tmp_path, args, message):
    run = dloco(
        "tokenize", *[str(tmp_path / a) if a.startswith("t.") else a for a in args], timeout=60
    )
    assert (
        run.returncode == 2
        and "dloco tokenize: " in run.stderr
        and message in run.stderr
        and "Traceback" not in run.stderr
    )


@pytest.mark.timeout(180)
def test_an_island_trains_on_a_token_file(tmp_path):
    out = tmp_path / "train.bin"
    report = tokenizing.tokenize(_text_folder(tmp_path), out, tokenizing.TokenizeConfig("bytes"))
    assert report.tokens == report.bytes_in > 10_000
    run = dloco(
        "island",
        "--standalone",
        "--tokens",
        str(out),
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        *TINY,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    task = next(json.loads(line) for line in run.stdout.splitlines() if '"event": "task"' in line)
    assert (
        f"on {out} (" in task["name"]
        and f" files, {report.tokens:,} tokens, vocabulary 256," in task["name"]
    ), task
    assert np.isfinite(json.loads(run.stdout.strip().splitlines()[-1])["eval_loss"])
    both = dloco("island", "--standalone", "--tokens", str(out), "--corpus", str(tmp_path), *TINY)
    assert both.returncode == 2 and "--tokens" in both.stderr and "--corpus" in both.stderr
