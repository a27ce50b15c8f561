"""The corpus: real text, no download.  Deterministic disjoint shards per island, a shared eval split.

Default: the Python standard library sources of the running interpreter (`*.py` under
``sysconfig.get_paths()["stdlib"]``, minus test/, tests/, idlelib/, site-packages/), about 11 MB of
code written by others.  Any file or folder of text works (`--corpus PATH`).  Files are read in
sorted relative-path order; the sha256 of the list (path and size per line) is logged so runs
are comparable.  The last `eval_fraction` of the concatenated bytes is the eval split; the rest
is cut into `islands` contiguous, disjoint shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from protocol.errors import DlocoError

_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
TEXT_SUFFIXES = {".py", ".txt", ".rst", ".md", ".c", ".h", ".html", ".tex", ""}


class CorpusError(DlocoError):
    """The corpus cannot be read or is too small."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    tokens_N: np.ndarray  # uint8, all files concatenated
    files: int
    digest: str  # sha256 of the sorted (path, size) list
    root: str


def default_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load(path: str | Path | None = None) -> Corpus:
    root = Path(path) if path is not None else default_root()
    if not root.exists():
        raise CorpusError(f"corpus path {root} does not exist")
    if root.is_file():
        files = [root]
    else:
        suffixes = {".py"} if path is None else TEXT_SUFFIXES
        files = []
        for folder, subfolders, names in os.walk(root):  # skipped folders are never entered (site-packages is large)
            subfolders[:] = [name for name in subfolders if name not in _SKIP_DIRS]
            files += [Path(folder) / name for name in names if Path(name).suffix in suffixes and (Path(folder) / name).is_file()]
        files.sort()
    listing, chunks = hashlib.sha256(), []
    for file in files:
        data = file.read_bytes()
        listing.update(f"{file.relative_to(root) if root.is_dir() else file.name}\t{len(data)}\n".encode())
        chunks.append(data)
        chunks.append(b"\n")
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if tokens.size < 10_000:
        raise CorpusError(f"corpus {root} holds {tokens.size} bytes; at least 10,000 are needed")
    return Corpus(tokens, len(files), listing.hexdigest(), str(root))


def split(corpus: Corpus, islands: int, eval_fraction: float = 0.05) -> tuple[list[np.ndarray], np.ndarray]:
    """(train shards, one per island; eval split shared by all)."""
    n = corpus.tokens_N.size
    cut = int(n * (1 - eval_fraction))
    train, evaluation = corpus.tokens_N[:cut], corpus.tokens_N[cut:]
    bounds = np.linspace(0, cut, islands + 1).astype(np.int64)
    return [train[bounds[i] : bounds[i + 1]] for i in range(islands)], evaluation


class Batches:
    """Random windows of `context + 1` bytes from one shard; deterministic in (seed, island)."""

    def __init__(self, shard: np.ndarray, batch: int, context: int, seed: int, island: int) -> None:
        if shard.size <= context + 1:
            raise CorpusError(f"shard of {shard.size} bytes is shorter than one sequence of {context + 1}")
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
    """Fixed, evenly spaced windows of the eval split: every island evaluates on the same bytes."""
    total = batch * count
    starts = np.linspace(0, evaluation.size - context - 2, total).astype(np.int64)
    windows = np.stack([evaluation[s : s + context + 1] for s in starts]).astype(np.int32)
    return [windows[i * batch : (i + 1) * batch] for i in range(count)]
