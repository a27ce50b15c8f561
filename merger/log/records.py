"""Write-ahead-log records: genesis, admitted delta, fold.  Pure conversions, no file access.

A delta is logged in its wire form (codec, slices, encoded payloads), 8x smaller than float32 at
int4, and decoded on replay with the same codec code as on the live path, so replay sees the
same float32 values bit for bit.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from dloco.merger.engines.sparse_xla import KERNELS_VERSION
from dloco.merger.fold.admission import Candidate
from dloco.merger.fold.merge import Contribution, FragmentState
from dloco.protocol import Assembled, Codec, CodedTensor
from dloco.protocol.assembly import records_of

GENESIS, DELTA, FOLD, CURSORS, TERM = "genesis", "delta", "fold", "cursors", "term"


def software() -> dict:
    """What the fold's bytes depend on besides the log: the fold kernels' version and jax's."""
    return {"fold_kernels": KERNELS_VERSION, "jax": jax.__version__}


def software_mismatch(genesis: dict) -> str | None:
    """Why a replay of this log may not reproduce its bytes exactly (None: same kernels and jax)."""
    logged, now = genesis.get("software"), software()
    if logged == now:
        return None
    written = (
        "software not recorded (written before the log kept it)"
        if logged is None
        else f"fold kernels v{logged.get('fold_kernels')}, jax {logged.get('jax')}"
    )
    return (
        f"log written with {written}; replaying with fold kernels v{now['fold_kernels']}, jax"
        f" {now['jax']}: folds may differ by rounding units and checkpoints may not match"
    )


def held_fragments(
    fragments: Sequence[Sequence[str]], params: Mapping[str, np.ndarray]
) -> list[bool]:
    """Which fragments `params` holds every tensor of (a merger shard is given its own only); one
    given in part is an error."""
    held = []
    for index, paths in enumerate(fragments):
        given = sum(path in params for path in paths)
        if 0 < given < len(paths):
            raise ValueError(
                f"the initial values hold {given} of fragment {index}'s {len(paths)} tensors"
            )
        held.append(given == len(paths))
    return held


def genesis_record(
    config: dict, model: str, fragments: Sequence[Sequence[str]], params: Mapping[str, np.ndarray]
) -> tuple[dict, list[tuple[memoryview, None]]]:
    """The log's first record and its blobs: one per tensor, float32 little-endian, in `tensors`
    order.  The blobs view the parameters themselves (no copy: the log writes them as they are and
    computes their CRC-32 on the way)."""
    arrays = {path: np.ascontiguousarray(np.asarray(a), dtype="<f4") for path, a in params.items()}
    return {
        "type": GENESIS,
        "config": config,
        "model": model,
        "fragments": [list(f) for f in fragments],
        "software": software(),
        # two runs from the same model and settings still have different logs (a standby follows
        # only its own)
        "run": uuid.uuid4().hex,
        "tensors": [[path, list(a.shape)] for path, a in arrays.items()],
    }, [(memoryview(a.reshape(-1)).cast("B"), None) for a in arrays.values()]


def params_from_genesis(record: dict) -> dict[str, np.ndarray]:
    """The model of a genesis record as read back (its blobs under "blobs"), viewed where it lies:
    read-only float32 arrays over the record's bytes, no copy.  Logs written before the blobs
    carried each tensor's bytes in a `params` map."""
    if "tensors" in record:
        pieces = [
            (path, shape, blob) for (path, shape), blob in zip(record["tensors"], record["blobs"])
        ]
    else:
        pieces = [(path, entry["shape"], entry["data"]) for path, entry in record["params"].items()]
    return {path: array_view(data, "<f4", shape) for path, shape, data in pieces}


def array_view(data, dtype, shape) -> np.ndarray:
    """An array over bytes read back (a log's or a checkpoint's blob), copied only when the bytes
    lie at an offset its dtype cannot be read aligned from."""
    array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return array if array.flags.aligned else array.copy()


def delta_record(
    assembled: Assembled, staleness: int
) -> tuple[dict, list[tuple[memoryview, int | None]]]:
    """The log record of an admitted delta and its payloads as raw blobs, each with the CRC-32 its
    frame carried (checked by decode: the log does not compute it again)."""
    first = assembled.header
    slices, blobs = [], []
    for chunk in assembled.chunks:
        for item, payload in zip(chunk.slices, chunk.payloads):
            slices.append([item.path, list(item.shape), item.start, item.count])
            blobs.append((memoryview(payload), item.crc32))
    return {
        "type": DELTA,
        "island": first.sender,
        "epoch": first.epoch,
        "delta_id": first.delta_id,
        "fragment": first.fragment,
        "base_version": first.base_version,
        "staleness": staleness,
        "steps": first.steps,
        "tokens": first.tokens,
        "codec": first.codec.name,
        "block": first.codec.block,
        "slices": slices,
    }, blobs


def _payloads(record: dict) -> list:
    # logs before blobs kept payloads in the map
    return record["blobs"] if "blobs" in record else record["payloads"]


def coded_tensors(
    codec: Codec, slices: Sequence[tuple[str, Sequence[int], int]], payloads: Sequence
) -> dict[str, CodedTensor]:
    """The records of an int-coded delta per tensor, from its (path, shape, start) slices and
    payloads: the live path (from the received chunks) and replay (from the log) both build a
    round's input with this, so both fold the same codes."""
    pieces: dict[str, tuple[tuple[int, ...], list]] = {}
    for (path, shape, start), payload in zip(slices, payloads):
        pieces.setdefault(path, (tuple(shape), []))[1].append((start, payload))
    return {
        path: CodedTensor(codec, shape, records_of(codec, parts))
        for path, (shape, parts) in pieces.items()
    }


def delta_tensors(assembled: Assembled) -> dict:
    """What the merger folds of a reassembled delta: its records for int codecs, else its float32
    tensors."""
    codec = assembled.header.codec
    if not codec.blockwise or all(isinstance(t, CodedTensor) for t in assembled.tensors.values()):
        # float32, or records a Reassembler(decode=False) built the same way
        return assembled.tensors
    slices = [
        (item.path, item.shape, item.start) for chunk in assembled.chunks for item in chunk.slices
    ]
    return coded_tensors(
        codec, slices, [payload for chunk in assembled.chunks for payload in chunk.payloads]
    )


def delta_candidate(assembled: Assembled, tensors: bool = True) -> Candidate:
    """A reassembled delta as admission sees it; `tensors` false: without them (a delta settled
    before its tensors are looked at is not decoded)."""
    head = assembled.header
    return Candidate(
        head.sender,
        head.epoch,
        head.delta_id,
        head.fragment,
        head.base_version,
        head.steps,
        head.tokens,
        head.model,
        delta_tensors(assembled) if tensors else {},
    )


def contribution_from_record(record: dict) -> Contribution:
    """The contribution as the live path admitted it (see `delta_tensors`)."""
    codec = Codec(record["codec"], record["block"])
    if codec.blockwise:
        coded = coded_tensors(
            codec,
            [(path, shape, start) for path, shape, start, _ in record["slices"]],
            _payloads(record),
        )
        return Contribution(
            record["island"],
            record["epoch"],
            record["delta_id"],
            record["staleness"],
            record["tokens"],
            record["steps"],
            coded,
        )
    tensors: dict[str, np.ndarray] = {}
    for (path, shape, start, count), payload in zip(record["slices"], _payloads(record)):
        flat = tensors.setdefault(
            path, np.empty(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
        )
        codec.decode(payload, count, out=flat[start : start + count])
    shapes = {path: shape for path, shape, _, _ in record["slices"]}
    return Contribution(
        record["island"],
        record["epoch"],
        record["delta_id"],
        record["staleness"],
        record["tokens"],
        record["steps"],
        {path: flat.reshape(shapes[path]) for path, flat in tensors.items()},
    )


def term_record(term: int, epoch: int) -> dict:
    """A standby took over (merger/replication/primary.py): records from here on are term `term`'s,
    whose messages carry `epoch`.  Changes no state: replay passes over it."""
    return {"type": TERM, "term": term, "epoch": epoch}


def cursors_record(cursors: Mapping[str, tuple[int, int]]) -> dict:
    """Stream cursors, island -> (epoch, seq): its messages up to seq are settled."""
    return {"type": CURSORS, "cursors": [[i, e, s] for i, (e, s) in sorted(cursors.items())]}


def fold_record(fragment: int, version: int, members: Sequence[tuple[str, int, int]]) -> dict:
    return {
        "type": FOLD,
        "fragment": fragment,
        "version": version,
        "members": [list(m) for m in members],
    }


def params_digest(states: Sequence[FragmentState]) -> str:
    """sha256 over every fragment's parameters (path order, float32 little-endian bytes)."""
    digest = hashlib.sha256()
    for state in states:
        for path in sorted(state.params):
            digest.update(path.encode())
            digest.update(np.ascontiguousarray(state.params[path], dtype="<f4").tobytes())
    return digest.hexdigest()
