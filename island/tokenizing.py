"""`dloco tokenize`: a file or folder of text to a token file that an island reads
(`data.load_tokens`).

The text is the same selection as a text corpus (`data.text_files`: default the stdlib sources),
concatenated in the same order with one newline after each file, so a `bytes` token file holds
exactly the ids `data.load` would.  `bpe` trains a byte-level BPE (HuggingFace `tokenizers`) on
that text, here, with no download: every byte is in its alphabet, so any text encodes and decoding
gives it back exactly.  The trained tokenizer is saved as FILE.tokenizer.json beside FILE.bin so
that ids can be turned back into text later.

Ids are written as they are made, one batch of files at a time, never all held in a list; one file
is in memory at a time, as `data.load` reads it.  A file longer than `PIECE_CHARS` is encoded in
line-aligned pieces.  Everything is written to a temporary file first and renamed, so a crash
leaves no half file; the sidecar FILE.json is written last and names the token count, so a token
file whose write was cut short between the renames is refused by `load_tokens`.

(Named tokenizing, not tokenize: a module next to a script must not shadow the stdlib's `tokenize`.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from dloco.island import data
from dloco.island.data import CorpusError

TOKENIZERS = ("bytes", "bpe")
DEFAULT_BPE_VOCAB = 4096
# a longer file is encoded in line-aligned pieces of about this many characters
PIECE_CHARS = 1 << 20
# text per encode_batch call and per progress line
BATCH_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class TokenizeConfig:
    # "bytes": each byte is an id; "bpe": a byte-level BPE trained on the source
    tokenizer: str = "bytes"
    # bpe: the vocabulary to train (default 4096); bytes: 256 or None
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise CorpusError(
                f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}"
            )
        if self.tokenizer == "bytes" and self.vocab not in (None, 256):
            raise CorpusError(
                f"the bytes tokenizer has a vocabulary of 256, got --vocab {self.vocab}"
            )
        if (
            self.tokenizer == "bpe"
            and self.vocab is not None
            and not 256 <= self.vocab <= data.MAX_VOCAB
        ):
            raise CorpusError(
                f"a byte-level BPE vocabulary holds the 256 bytes and at most {data.MAX_VOCAB} ids,"
                f" got {self.vocab}"
            )

    @property
    def target_vocab(self) -> int:
        return 256 if self.tokenizer == "bytes" else self.vocab or DEFAULT_BPE_VOCAB


@dataclasses.dataclass(frozen=True)
class TokenizeReport:
    out: str
    tokenizer: str
    tokens: int
    # text bytes encoded: the files and one newline after each
    bytes_in: int
    files: int
    # the trained vocabulary (a small source can give fewer ids than asked for)
    vocab: int
    dtype: str
    seconds: float
    # bpe: files that were not UTF-8, encoded with U+FFFD in place of their bad bytes
    lossy_files: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_in / self.tokens if self.tokens else 0.0

    def summary(self) -> str:
        lossy = (
            f"; {self.lossy_files} files not UTF-8, their bad bytes replaced"
            if self.lossy_files
            else ""
        )
        return (
            f"wrote {self.out}: {self.tokens:,} tokens ({self.dtype}, {self.tokenizer}, vocab"
            f" {self.vocab}) from {self.bytes_in:,} bytes in {self.files} files,"
            f" {self.bytes_per_token:.3f} bytes/token, {self.seconds:.1f} s{lossy}"
        )


def tokenizer_path(out: str | Path) -> Path:
    """FILE.tokenizer.json, beside FILE.bin."""
    return Path(out).with_suffix(".tokenizer.json")


def line_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """`text` cut into consecutive pieces of at most about `limit` characters, each ending after a
    newline where the stretch has one; ''.join(pieces) == text.  Encoding pieces instead of a whole
    file bounds the encoder's memory; a cut between lines changes at most the merges across that one
    boundary."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit) + 1
        cut = cut if cut > start else start + limit
        pieces.append(text[start:cut])
        start = cut
    return pieces + [text[start:]] if start < len(text) or not pieces else pieces


def decode_text(raw: bytes) -> tuple[str, bool]:
    """(text, whether bytes were lost): BPE encodes strings, and a file that is not UTF-8 gets
    U+FFFD."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


# Over 60 lines: one token file written in its order: the old sidecar removed first, then the
# tokenizer, the ids, and the sidecar last, so that a crash never leaves a sidecar beside other ids.
def tokenize(
    src: str | Path | None,
    out: str | Path,
    config: TokenizeConfig,
    progress: Callable[[str], None] = lambda line: None,
) -> TokenizeReport:
    """Write `out` (FILE.bin), its sidecar FILE.json and, for bpe, FILE.tokenizer.json; report the
    figures. `progress` receives one line per batch of files."""
    started, out = time.monotonic(), Path(out)
    if out.suffix != ".bin":
        raise CorpusError(f"--out must name a .bin file (its sidecar is FILE.json), got {out}")
    root, files = data.text_files(src)
    if not files:
        raise CorpusError(f"no text files under {root}")
    total = sum(file.stat().st_size + 1 for file in files)
    progress(f"{len(files)} files, {total / 1e6:.1f} MB of text under {root}")
    out.parent.mkdir(parents=True, exist_ok=True)
    sidecar = data.sidecar_path(out)
    # First: a crash later leaves a token file without a sidecar, never an old sidecar (or old ids)
    # beside a new tokenizer.
    sidecar.unlink(missing_ok=True)
    encoder = None
    if config.tokenizer == "bpe":
        encoder = _train_bpe(files, config.target_vocab, progress)
        _replace(tokenizer_path(out), lambda handle: handle.write(encoder.to_str().encode()))
    vocab = encoder.get_vocab_size() if encoder is not None else 256
    dtype = data.dtype_for(vocab)
    listing, counts = hashlib.sha256(), {"tokens": 0, "bytes": 0, "lossy": 0}

    def write_ids(handle: BinaryIO) -> None:
        writer = _BatchWriter(handle, encoder, data.TOKEN_DTYPES[dtype], counts)
        for index, file in enumerate(files, 1):
            raw = file.read_bytes()
            # as data.load hashes it: the same source, the same digest
            listing.update(data.listing_line(root, file, len(raw)))
            if writer.add(raw + b"\n") or index == len(files):
                writer.flush()
                megabytes = f"{counts['bytes'] / 1e6:.1f}/{total / 1e6:.1f} MB"
                progress(
                    f"encoded {index}/{len(files)} files, {megabytes}, {counts['tokens']:,} tokens"
                )

    _replace(out, write_ids)
    info = data.TokenFileInfo(
        dtype=dtype,
        vocab=vocab,
        tokens=counts["tokens"],
        tokenizer=config.tokenizer,
        source_digest=listing.hexdigest(),
        files=len(files),
        bytes=counts["bytes"],
        tokenizer_file=tokenizer_path(out).name if encoder is not None else "",
    )
    _replace(sidecar, lambda handle: handle.write(info.to_json().encode()))
    return TokenizeReport(
        str(out),
        config.tokenizer,
        info.tokens,
        info.bytes,
        len(files),
        vocab,
        dtype,
        time.monotonic() - started,
        counts["lossy"],
    )


class _BatchWriter:
    """Collects text until BATCH_BYTES, then appends its ids to the file: bytes as they are, bpe
    through one `encode_batch` call (the encoder's threads share the work)."""

    def __init__(self, handle: BinaryIO, encoder, dtype: np.dtype, counts: dict[str, int]) -> None:
        self.handle, self.encoder, self.dtype, self.counts = handle, encoder, dtype, counts
        self.pending: list[bytes] = []
        self.size = 0

    def add(self, raw: bytes) -> bool:
        """Queue one file's text; True once a batch is full."""
        self.pending.append(raw)
        self.size += len(raw)
        self.counts["bytes"] += len(raw)
        return self.size >= BATCH_BYTES

    def flush(self) -> None:
        if self.encoder is None:
            for raw in self.pending:
                self._write(np.frombuffer(raw, dtype=np.uint8))
        else:
            pieces = []
            for raw in self.pending:
                text, lossy = decode_text(raw)
                self.counts["lossy"] += lossy
                pieces += line_pieces(text)
            for encoding in self.encoder.encode_batch(pieces, add_special_tokens=False):
                self._write(np.asarray(encoding.ids, dtype=np.int64))
        self.pending, self.size = [], 0

    def _write(self, ids_N: np.ndarray) -> None:
        ids_N.astype(self.dtype).tofile(self.handle)
        self.counts["tokens"] += ids_N.size


def _train_bpe(files: list[Path], vocab: int, progress: Callable[[str], None]):
    """A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, no special tokens) trained on the
    files."""
    # only this command needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    encoder = Tokenizer(models.BPE())
    encoder.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    encoder.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        show_progress=False,
        special_tokens=[],
        # all 256 bytes, seen or not
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def texts() -> Iterator[str]:
        read = 0
        for index, file in enumerate(files, 1):
            raw = file.read_bytes() + b"\n"
            yield from line_pieces(decode_text(raw)[0])
            read += len(raw)
            if read >= BATCH_BYTES or index == len(files):
                progress(f"training bpe (vocab {vocab}): read {index}/{len(files)} files")
                read = 0

    started = time.monotonic()
    encoder.train_from_iterator(texts(), trainer=trainer)
    progress(f"trained bpe: {encoder.get_vocab_size()} ids in {time.monotonic() - started:.1f} s")
    return encoder


def _replace(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file in the same folder, then rename it over `path`: all or
    nothing."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
