"""The corpus: real text, no download, or a file of token ids.  Deterministic disjoint shards per
island, a shared eval split.

Default: the Python standard library sources of the running interpreter (`*.py` under
``sysconfig.get_paths()["stdlib"]``, minus test/, tests/, idlelib/, site-packages/), about 11 MB of
code written by others.  Any file or folder of text works (`--corpus PATH`); each byte is a token.
Files are read in sorted relative-path order; the sha256 of the list (path and size per line) is
logged so runs are comparable.  The last `held_out` share of the concatenated tokens is held out:
its first half is the validation split (the held-out batches every island, the evaluator and every
choice of a setting read), its second half the test split (read only for reported figures, whole).
The rest is cut into `islands` contiguous, disjoint shards.

A token file (`load_tokens`, `--tokens FILE`) is the nanoGPT convention: a flat array of token ids,
memory-mapped so that a corpus larger than RAM costs only the pages the windows touch.  FILE.bin is
raw little-endian ids without a header (uint16 unless its sidecar says uint32); FILE.npy is a 1-D
uint16 or uint32 array.  The sidecar FILE.json next to it, written by `dloco tokenize`
(island/tokenizing.py), names the dtype, the vocabulary size, the token count and the tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dloco.protocol.errors import DlocoError

_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
TEXT_SUFFIXES = {".py", ".txt", ".rst", ".md", ".c", ".h", ".html", ".tex", ""}
MIN_TOKENS = 10_000
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Batches casts windows to int32
MAX_VOCAB = 2**31
# ids per chunk when looking for the largest: 32-64 MiB at a time, never the whole file
_SCAN_CHUNK = 1 << 24


class CorpusError(DlocoError):
    """The corpus cannot be read or is too small."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    # uint8 for text (all files concatenated); uint16/uint32 memmap for a token file
    tokens_N: np.ndarray
    files: int
    # sha256 of the sorted (path, size) list; for a token file, of its name, size, dtype and source
    digest: str
    root: str
    # the number of token ids: every id is below it (a byte: 256)
    vocab: int = 256


def default_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(path: str | Path | None = None) -> tuple[Path, list[Path]]:
    """(root, the files a text corpus reads, in order): one file, or a folder's text files in sorted
    path order (`.py` only under the default root); `dloco tokenize` reads the same selection."""
    root = Path(path) if path is not None else default_root()
    if not root.exists():
        raise CorpusError(f"corpus path {root} does not exist")
    if root.is_file():
        return root, [root]
    suffixes = {".py"} if path is None else TEXT_SUFFIXES
    files = []
    # skipped folders are never entered (site-packages is large)
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIP_DIRS]
        files += [
            Path(folder) / name
            for name in names
            if Path(name).suffix in suffixes and (Path(folder) / name).is_file()
        ]
    return root, sorted(files)


def listing_line(root: Path, file: Path, size: int) -> bytes:
    """One line of the hashed file list: the path relative to the root (a single file: its name),
    its size."""
    return f"{file.relative_to(root) if root.is_dir() else file.name}\t{size}\n".encode()


def load(path: str | Path | None = None) -> Corpus:
    root, files = text_files(path)
    listing, chunks = hashlib.sha256(), []
    for file in files:
        data = file.read_bytes()
        listing.update(listing_line(root, file, len(data)))
        chunks.append(data)
        chunks.append(b"\n")
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if tokens.size < MIN_TOKENS:
        raise CorpusError(
            f"corpus {root} holds {tokens.size} bytes; at least {MIN_TOKENS:,} are needed"
        )
    return Corpus(tokens, len(files), listing.hexdigest(), str(root))


@dataclasses.dataclass(frozen=True)
class TokenFileInfo:
    """What a token file's sidecar (FILE.json) says.  `dloco tokenize` writes it; keys it does not
    know are ignored."""

    # "uint16" or "uint32", little-endian
    dtype: str
    # the number of token ids: every id is below it (trusted, not checked against the file)
    vocab: int
    # ids in the file: a file of another length was truncated or replaced
    tokens: int
    # "bytes", "bpe", or whatever wrote the file
    tokenizer: str = "unknown"
    # sha256 of the source's (path, size) list, as `load` computes it
    source_digest: str = ""
    # source files
    files: int = 1
    # text bytes the ids encode (the files and one newline after each)
    bytes: int = 0
    # bpe: the tokenizer's JSON, a file name in the sidecar's folder
    tokenizer_file: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in TOKEN_DTYPES:
            raise CorpusError(
                f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {self.dtype!r}"
            )
        for name in ("vocab", "tokens", "files", "bytes"):
            value = getattr(self, name)
            # JSON's true is not a count
            if type(value) is not int or value < 0:
                raise CorpusError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("tokenizer", "source_digest", "tokenizer_file"):
            if not isinstance(getattr(self, name), str):
                raise CorpusError(f"{name} must be a string, got {getattr(self, name)!r}")
        limit = min(int(np.iinfo(TOKEN_DTYPES[self.dtype]).max) + 1, MAX_VOCAB)
        if not 1 <= self.vocab <= limit:
            raise CorpusError(
                f"vocab must be in [1, {limit}] for {self.dtype} ids, got {self.vocab}"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> TokenFileInfo:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise CorpusError(f"sidecar {where} is not JSON: {error}") from None
        if not isinstance(fields, dict) or not {"dtype", "vocab", "tokens"} <= set(fields):
            raise CorpusError(
                f"sidecar {where} must be an object with dtype, vocab and tokens, got {text[:80]!r}"
            )
        known = {field.name for field in dataclasses.fields(cls)}
        try:
            return cls(**{key: value for key, value in fields.items() if key in known})
        except CorpusError as error:
            raise CorpusError(f"sidecar {where}: {error}") from None


def sidecar_path(path: str | Path) -> Path:
    """FILE.json, next to FILE.bin or FILE.npy."""
    return Path(path).with_suffix(".json")


def dtype_for(vocab: int) -> str:
    """The narrowest token dtype that holds ids below `vocab`."""
    return "uint16" if vocab <= 1 << 16 else "uint32"


def largest_id(tokens_N: np.ndarray) -> int:
    """The largest id, a chunk at a time: a memory-mapped file is never pulled into RAM whole."""
    return max(
        int(tokens_N[i : i + _SCAN_CHUNK].max()) for i in range(0, tokens_N.size, _SCAN_CHUNK)
    )


def load_tokens(path: str | Path) -> Corpus:
    """A token file as a Corpus whose `tokens_N` is memory-mapped.  The vocabulary is the sidecar's,
    else the largest id + 1 (one pass over the file); a raw .bin without a sidecar holds uint16
    ids."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"token file {path} does not exist")
    sidecar = sidecar_path(path)
    info = (
        TokenFileInfo.from_json(sidecar.read_text(), str(sidecar))
        if sidecar.is_file() and sidecar != path
        else None
    )
    tokens_N, dtype = (
        _open_npy(path, info, sidecar) if path.suffix == ".npy" else _open_raw(path, info)
    )
    if tokens_N.size < MIN_TOKENS:
        raise CorpusError(
            f"token file {path} holds {tokens_N.size} tokens; at least {MIN_TOKENS:,} are needed"
        )
    if info is not None and info.tokens != tokens_N.size:
        raise CorpusError(
            f"{path} holds {tokens_N.size} tokens but its sidecar {sidecar} says {info.tokens}:"
            " truncated or replaced?"
        )
    vocab = info.vocab if info is not None else largest_id(tokens_N) + 1
    if vocab > MAX_VOCAB:
        raise CorpusError(
            f"{path} holds id {vocab - 1}; the model reads ids as int32 (below {MAX_VOCAB})"
        )
    # Like a text corpus's digest, the name and size, not the content: hashing gigabytes at every
    # start is not worth it.
    listing = f"{path.name}\t{path.stat().st_size}\t{dtype}\t{info.source_digest if info else ''}\n"
    return Corpus(
        tokens_N,
        info.files if info else 1,
        hashlib.sha256(listing.encode()).hexdigest(),
        str(path),
        vocab,
    )


def _open_npy(path: Path, info, sidecar: Path) -> tuple[np.ndarray, str]:
    """A .npy token file, memory-mapped, and its dtype's name (checked against the sidecar)."""
    try:
        tokens_N = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise CorpusError(f"{path} is not a readable .npy array: {error}") from None
    if tokens_N.ndim != 1:
        raise CorpusError(
            f"{path} holds an array of shape {tokens_N.shape}; token ids are a 1-D array"
        )
    dtype = next((name for name, known in TOKEN_DTYPES.items() if tokens_N.dtype == known), None)
    if dtype is None:
        raise CorpusError(
            f"{path} holds {tokens_N.dtype} values; token ids are little-endian uint16 or uint32"
        )
    if info is not None and info.dtype != dtype:
        raise CorpusError(f"{path} holds {dtype} ids but its sidecar {sidecar} says {info.dtype}")
    return tokens_N, dtype


def _open_raw(path: Path, info) -> tuple[np.ndarray, str]:
    """A raw token file (uint16 without a sidecar), memory-mapped, and its dtype's name."""
    dtype = info.dtype if info is not None else "uint16"
    size, item = path.stat().st_size, TOKEN_DTYPES[dtype].itemsize
    if size % item:
        raise CorpusError(
            f"{path} is {size} bytes, not a multiple of {item} ({dtype} ids): truncated, or not"
            f" {dtype}?"
        )
    # np.memmap refuses an empty file: say what is wrong instead
    if size < MIN_TOKENS * item:
        raise CorpusError(
            f"token file {path} holds {size // item} tokens; at least {MIN_TOKENS:,} are needed"
        )
    tokens_N = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    return tokens_N, dtype


class Split(NamedTuple):
    """A corpus cut for training and evaluation: three disjoint ranges of its tokens."""

    # one per island, contiguous, disjoint
    shards: list[np.ndarray]
    # for every choice made while training: the islands' held-out batches
    validation: np.ndarray
    # for the reported figures only
    test: np.ndarray


def split(corpus: Corpus, islands: int, held_out: float = 0.05) -> Split:
    """The training shards, then the validation and test splits (halves of the last `held_out`
    share).  Slices: a memory-mapped corpus stays mapped."""
    n = corpus.tokens_N.size
    cut = int(n * (1 - held_out))
    middle = cut + (n - cut) // 2
    train = corpus.tokens_N[:cut]
    bounds = np.linspace(0, cut, islands + 1).astype(np.int64)
    return Split(
        [train[bounds[i] : bounds[i + 1]] for i in range(islands)],
        corpus.tokens_N[cut:middle],
        corpus.tokens_N[middle:],
    )


class Batches:
    """Random windows of `context + 1` tokens from one shard; deterministic in (seed, island)."""

    def __init__(self, shard: np.ndarray, batch: int, context: int, seed: int, island: int) -> None:
        if shard.size <= context + 1:
            raise CorpusError(
                f"shard of {shard.size} tokens is shorter than one sequence of {context + 1}"
            )
        self.shard, self.batch, self.context = shard, batch, context
        self.rng = np.random.default_rng([seed, island])

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> np.ndarray:
        return self.next()

    def next(self) -> np.ndarray:
        starts = self.rng.integers(0, self.shard.size - self.context - 1, size=self.batch)
        return np.stack([self.shard[s : s + self.context + 1] for s in starts]).astype(np.int32)


def eval_batches(evaluation: np.ndarray, batch: int, context: int, count: int) -> list[np.ndarray]:
    """Fixed, evenly spaced windows of the eval split: every island evaluates on the same tokens."""
    if count < 1:
        raise CorpusError(f"eval_batches must be at least 1, got {count}")
    if evaluation.size < context + 2:
        raise CorpusError(
            f"the validation split holds {evaluation.size} tokens, fewer than one sequence of"
            f" {context + 1}: use more data or a shorter context"
        )
    total = batch * count
    starts = np.linspace(0, evaluation.size - context - 2, total).astype(np.int64)
    windows = np.stack([evaluation[s : s + context + 1] for s in starts]).astype(np.int32)
    return [windows[i * batch : (i + 1) * batch] for i in range(count)]


def whole_split(tokens_N: np.ndarray, batch: int, context: int) -> list[np.ndarray]:
    """Every window of a split, each token predicted once: windows of `context + 1` tokens that
    start `context` apart, in batches of `batch` (the last one holds the rest).  Their mean loss is
    a mean over windows (Trainer.evaluate_whole), not over batches."""
    windows = (tokens_N.size - 1) // context
    if windows < 1:
        raise CorpusError(
            f"the split holds {tokens_N.size} tokens, fewer than one sequence of {context + 1}:"
            " use more data or a shorter context"
        )
    starts_W = np.arange(windows, dtype=np.int64) * context
    windows_WxT1 = np.stack([tokens_N[s : s + context + 1] for s in starts_W]).astype(np.int32)
    return [windows_WxT1[i : i + batch] for i in range(0, windows, batch)]
