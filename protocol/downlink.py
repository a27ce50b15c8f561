"""Compressed downlink: snapshots that carry a fragment's *change*, quantized, not its whole value.

The merger keeps, per fragment, the *served value* S: bit for bit what a receiver of every snapshot
so far holds.  A full snapshot in codec c serves ``S_v = decode_c(encode_c(Theta_v))``.  A diff
snapshot from version b to v carries ``encode_d(Theta_v - S_b)`` and serves
``S_v = S_b + decode_d(encode_d(Theta_v - S_b))``, so one diff's quantization error is carried into
the next diff (error feedback by construction) and S stays within one diff's error of the global
model instead of drifting.  Every snapshot from a merger that sends diffs carries ``digest(S_v)``;
a receiver that applied a diff to anything but ``S_b`` (a diff lost on the bus, a restarted merger)
sees the digest differ and asks for the value again (catch-up, sent exact: fp32, or the full
snapshots' codec while S is exactly representable in it).

Both ends decode with `protocol.assembly.decode_slices` and add in float32 numpy, so the served
value is the same bytes on every machine.  A merger may serve S in bfloat16 (a snapshot's
``served = "bf16"``): every value of S is then rounded to it (nearest, ties to even) after each
snapshot, ``S_v = bf16(S_b + decode_d(...))``, computed in float32 first; the next diff carries
what the rounding left out, as it carries the codec's error.  Half the memory on both ends; the
digest is then over S's bfloat16 bytes (half the bytes to checksum).  Pure numpy: no sockets, no
clocks.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from dloco.protocol.assembly import decode_slices
from dloco.protocol.checksum import crc32
from dloco.protocol.chunking import ChunkPlan, Encoded, split_fragment
from dloco.protocol.errors import EncodeError
from dloco.protocol.quantization import Codec

# What a receiver makes of a snapshot (`receive`): adopt the value, ignore it, or ask again.
ADOPT = frozenset({"full", "diff"})
ASK_AGAIN = frozenset({"missing", "gap", "mismatch"})


# what the served value is held in, by a snapshot's `served` (None: float32)
SERVED_DTYPES = {None: np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}


def held_as(tensors: dict[str, np.ndarray], served: str | None) -> dict[str, np.ndarray]:
    """Float32 `tensors` as a receiver holds them under `served`: themselves, or each rounded to
    bfloat16 (a tensor at a time: its float32 array is let go of as its copy is made)."""
    dtype = SERVED_DTYPES[served]
    for path in list(tensors):
        if tensors[path].dtype != dtype:
            tensors[path] = tensors.pop(path).astype(dtype)
    return tensors


@dataclasses.dataclass(frozen=True)
class Served:
    """The value of one fragment a receiver holds at `version` (float32 tensors as decoded, or
    bfloat16 under ``served = "bf16"``)."""

    version: int
    tensors: Mapping[str, np.ndarray]
    # None: a full snapshot from a merger that sends no diffs (nothing to check against)
    digest: int | None


# values a tensor in another dtype is read as float32 at a time, for its digest (1 MiB: cache-sized)
DIGEST_PIECE = 1 << 18
# bfloat16 arrays are in the machine's byte order; the digest takes their bytes little-endian
_LITTLE = sys.byteorder == "little"


def digest(tensors: Mapping[str, np.ndarray]) -> int:
    """CRC-32 over each tensor's path (UTF-8) and its values as held, in sorted path order
    (PROTOCOL.md §3.3): a bfloat16 tensor's 2-byte values, any other's float32 (little-endian
    both; a tensor in another dtype converted a piece at a time into one reused buffer, no float32
    copy of it)."""
    crc, buffer = 0, None
    for path in sorted(tensors):
        crc = crc32(path.encode(), crc)
        flat = np.asarray(tensors[path]).reshape(-1)
        if flat.dtype == np.dtype("<f4") or (flat.dtype == SERVED_DTYPES["bf16"] and _LITTLE):
            crc = crc32(memoryview(np.ascontiguousarray(flat).view(np.uint8)), crc)
            continue
        if buffer is None:
            buffer = np.empty(DIGEST_PIECE, np.uint32)
        for start in range(0, flat.size, DIGEST_PIECE):
            part = flat[start : start + DIGEST_PIECE]
            if part.dtype == SERVED_DTYPES["bf16"]:
                crc = crc32(part.view(np.uint16).astype("<u2").tobytes(), crc)
                continue
            out = buffer[: part.size]
            out.view("<f4")[...] = part
            crc = crc32(memoryview(out).cast("B"), crc)
    return crc


def _decoded(
    plans: list[ChunkPlan], codec: Codec, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    return decode_slices(
        codec,
        shapes,
        ((item, payload) for plan in plans for item, payload in zip(plan.slices, plan.payloads)),
    )


def _carried(theta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors a snapshot carries: float32, zero-size ones left out (they carry no values)."""
    return {path: np.asarray(value, np.float32) for path, value in theta.items() if np.size(value)}


def full(
    theta: Mapping[str, np.ndarray],
    version: int,
    codec: Codec,
    max_chunk_bytes: int,
    served: str | None = None,
) -> tuple[Served, list[ChunkPlan]]:
    """A full snapshot of `theta` in `codec`: its chunks and the value its receivers will hold
    (in `served`'s dtype)."""
    carried = _carried(theta)
    plans = split_fragment(carried, codec, max_chunk_bytes)
    held = _decoded(plans, codec, {path: value.shape for path, value in carried.items()})
    held = held_as(held, served)
    return Served(version, held, digest(held)), plans


def diff(
    theta: Mapping[str, np.ndarray],
    served: Served,
    version: int,
    codec: Codec,
    max_chunk_bytes: int,
) -> tuple[Served, list[ChunkPlan]]:
    """A diff snapshot taking receivers from `served` to (about) `theta` at `version`.

    The sender's side, a tensor at a time: each change is encoded as soon as it is made, and the
    served value moves on in place (`served`'s arrays become the new value's), so no copy of the
    fragment is ever made: a tensor's change and its decoding are the only temporaries.  Every
    tensor is encoded before any served array changes, so a refused encoding leaves `served`
    whole.  The served value keeps its dtype (bfloat16: each sum rounded to it)."""
    carried = _carried(theta)
    if set(carried) != set(served.tensors) or version <= served.version:
        raise EncodeError(
            f"a diff needs the served tensors and a newer version (served {served.version}, asked"
            f" {version})"
        )
    if _compiled(codec):
        return _diff_compiled(carried, served, version, codec, max_chunk_bytes)
    encoded = {}
    for path in sorted(carried):
        change = np.subtract(carried[path], served.tensors[path], dtype=np.float32)
        encoded[path] = Encoded(codec.encode(change.reshape(-1)), change.shape)
        del change
    plans = split_fragment(encoded, codec, max_chunk_bytes)
    held = {path: _writable(value) for path, value in served.tensors.items()}
    _add_decoded(held, plans, codec)
    return Served(version, held, digest(held)), plans


def _compiled(codec: Codec) -> bool:
    """Whether `diff` takes the compiled loops (protocol/code_loops.py): a dense int codec."""
    return codec.blockwise and not codec.sparse


def _diff_compiled(carried, served: Served, version: int, codec: Codec, max_chunk_bytes: int):
    """`diff` in two compiled passes a tensor: its change's records straight from theta and the
    served value, then (once every tensor is encoded) their decoding added to it; the same bytes
    as encoding the change and adding its decoding in numpy, without the change in memory."""
    # here, not at the top: a receiver (an island) never diffs, and need not load the compiler
    from dloco.protocol import code_loops

    encoded = {
        path: Encoded(
            code_loops.encode_change(
                carried[path], np.asarray(served.tensors[path]), codec.bits, codec.block
            ).reshape(-1),
            carried[path].shape,
        )
        for path in sorted(carried)
    }
    plans = split_fragment(encoded, codec, max_chunk_bytes)
    held = {path: _contiguous(_writable(value)) for path, value in served.tensors.items()}
    for path, value in held.items():
        records = encoded[path].data.reshape(-1, codec.record_nbytes)
        code_loops.add_decoded(value, records, codec.bits, codec.block)
    return Served(version, held, digest(held)), plans


def _contiguous(value: np.ndarray) -> np.ndarray:
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


def _writable(value: np.ndarray) -> np.ndarray:
    return value if value.flags.writeable else np.array(value)


def _add_decoded(held: dict[str, np.ndarray], plans: list[ChunkPlan], codec: Codec) -> None:
    """held += the change `plans` carry, decoded slice by slice as a receiver decodes them
    (`decode_slices`) and added in float32 a tensor at a time, the sum rounded to held's dtype as
    `apply` rounds it (tensors are whole in consecutive slices: `split_fragment` packs them in
    path order)."""
    pieces = [
        (item, payload) for plan in plans for item, payload in zip(plan.slices, plan.payloads)
    ]
    start = 0
    while start < len(pieces):
        path = pieces[start][0].path
        end = start
        while end < len(pieces) and pieces[end][0].path == path:
            end += 1
        value = held[path]
        change = decode_slices(codec, {path: value.shape}, pieces[start:end])[path]
        np.add(value, change, out=value, dtype=np.float32)
        start = end


def reply(served: Served, preferred: Codec, max_chunk_bytes: int) -> tuple[Codec, list[ChunkPlan]]:
    """A point-to-point reply carrying `served` exactly: in `preferred` (the full snapshots' codec)
    when that gives back S bit for bit — as it does until the first diff after a full snapshot in
    it, e.g. for every island joining at the start (bf16: half the bytes) — otherwise in bf16
    when S is held in it, else in fp32."""
    tensors = dict(served.tensors)
    if preferred.name != "fp32":
        plans = split_fragment(tensors, preferred, max_chunk_bytes)
        decoded = _decoded(plans, preferred, {path: value.shape for path, value in tensors.items()})
        if all(
            np.array_equal(
                decoded[path].view(np.uint32), np.asarray(value, np.float32).view(np.uint32)
            )
            for path, value in tensors.items()
        ):
            return preferred, plans
    exact = Codec(
        "bf16" if all(v.dtype == SERVED_DTYPES["bf16"] for v in tensors.values()) else "fp32"
    )
    return exact, split_fragment(tensors, exact, max_chunk_bytes)


def apply(
    held: Mapping[str, np.ndarray], change: dict[str, np.ndarray], served: str | None = None
) -> dict[str, np.ndarray]:
    """held + change in float32, added into `change`'s arrays (they become the new value: a diff
    costs no third copy of its fragment), then held as `served` says (bfloat16: rounded, a
    tensor at a time, each float32 sum let go of as it is replaced in `change`, which is
    returned)."""
    for path in held:
        np.add(held[path], change[path], out=change[path], dtype=np.float32)
    return held_as(change, served)


def receive(
    held: Served | None,
    version: int,
    base_version: int | None,
    expected: int | None,
    tensors: dict[str, np.ndarray],
    served: str | None = None,
) -> tuple[Served | None, str]:
    """What a receiver holds after a complete snapshot, and what happened:
    ``full`` / ``diff``: a newer value, adopt it; ``old``: nothing newer, ignore it;
    ``missing`` (a diff, no value held), ``gap`` (a diff from a version not held), ``mismatch``
    (the value, or the diff applied to the value held, does not have the digest the snapshot
    names): keep what is held and ask for the value again.  A diff's `tensors` (float32, the
    caller's own) are added to in place: they are the new value.  `served`: the snapshot's (the
    value is held in bfloat16 under "bf16", each tensor of `tensors` replaced by its rounding)."""
    if base_version is None:
        newer = held is None or version > held.version
        replaced = (
            held is not None
            and version == held.version
            and expected is not None
            and expected != held.digest
        )
        if not (newer or replaced):
            return held, "old"
        value = held_as(tensors, served)
        if expected is not None and digest(value) != expected:
            return held, "mismatch"
        return Served(version, dict(value), expected), "full"
    if held is not None and version <= held.version:
        return held, "old"
    if held is None:
        return held, "missing"
    if base_version != held.version or set(tensors) != set(held.tensors):
        return held, "gap"
    value = apply(held.tensors, tensors, served)
    if digest(value) != expected:
        return held, "mismatch"
    return Served(version, dict(value), expected), "diff"
