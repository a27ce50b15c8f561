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
value is the same bytes on every machine.  Pure numpy: no sockets, no clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dloco.protocol.assembly import decode_slices
from dloco.protocol.checksum import crc32
from dloco.protocol.chunking import ChunkPlan, Encoded, split_fragment
from dloco.protocol.errors import EncodeError
from dloco.protocol.quantization import Codec

# What a receiver makes of a snapshot (`receive`): adopt the value, ignore it, or ask again.
ADOPT = frozenset({"full", "diff"})
ASK_AGAIN = frozenset({"missing", "gap", "mismatch"})


@dataclasses.dataclass(frozen=True)
class Served:
    """The value of one fragment a receiver holds at `version` (float32 tensors, as decoded)."""

    version: int
    tensors: Mapping[str, np.ndarray]
    # None: a full snapshot from a merger that sends no diffs (nothing to check against)
    digest: int | None


def digest(tensors: Mapping[str, np.ndarray]) -> int:
    """CRC-32 over each tensor's path (UTF-8) and float32 little-endian values, in sorted path
    order."""
    crc = 0
    for path in sorted(tensors):
        crc = crc32(path.encode(), crc)
        crc = crc32(memoryview(np.ascontiguousarray(tensors[path], dtype="<f4")).cast("B"), crc)
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
    theta: Mapping[str, np.ndarray], version: int, codec: Codec, max_chunk_bytes: int
) -> tuple[Served, list[ChunkPlan]]:
    """A full snapshot of `theta` in `codec`: its chunks and the value its receivers will hold."""
    carried = _carried(theta)
    plans = split_fragment(carried, codec, max_chunk_bytes)
    held = _decoded(plans, codec, {path: value.shape for path, value in carried.items()})
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
    whole."""
    carried = _carried(theta)
    if set(carried) != set(served.tensors) or version <= served.version:
        raise EncodeError(
            f"a diff needs the served tensors and a newer version (served {served.version}, asked"
            f" {version})"
        )
    encoded = {}
    for path in sorted(carried):
        change = np.subtract(carried[path], served.tensors[path], dtype=np.float32)
        encoded[path] = Encoded(codec.encode(change.reshape(-1)), change.shape)
        del change
    plans = split_fragment(encoded, codec, max_chunk_bytes)
    held = {path: _writable(value) for path, value in served.tensors.items()}
    _add_decoded(held, plans, codec)
    return Served(version, held, digest(held)), plans


def _writable(value: np.ndarray) -> np.ndarray:
    return value if value.flags.writeable else np.array(value, dtype=np.float32)


def _add_decoded(held: dict[str, np.ndarray], plans: list[ChunkPlan], codec: Codec) -> None:
    """held += the change `plans` carry, decoded slice by slice as a receiver decodes them
    (`decode_slices`) and added in float32 a tensor at a time (tensors are whole in consecutive
    slices: `split_fragment` packs them in path order)."""
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
    it, e.g. for every island joining at the start (bf16: half the bytes) — otherwise in fp32."""
    tensors = dict(served.tensors)
    if preferred.name != "fp32":
        plans = split_fragment(tensors, preferred, max_chunk_bytes)
        decoded = _decoded(plans, preferred, {path: value.shape for path, value in tensors.items()})
        if all(
            np.array_equal(decoded[path].view(np.uint32), value.view(np.uint32))
            for path, value in tensors.items()
        ):
            return preferred, plans
    fp32 = Codec("fp32")
    return fp32, split_fragment(tensors, fp32, max_chunk_bytes)


def apply(
    held: Mapping[str, np.ndarray], change: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """held + change in float32, added into `change`'s arrays (they become the new value: a diff
    costs no third copy of its fragment)."""
    return {
        path: np.add(held[path], change[path], out=change[path], dtype=np.float32) for path in held
    }


def receive(
    held: Served | None,
    version: int,
    base_version: int | None,
    expected: int | None,
    tensors: Mapping[str, np.ndarray],
) -> tuple[Served | None, str]:
    """What a receiver holds after a complete snapshot, and what happened:
    ``full`` / ``diff``: a newer value, adopt it; ``old``: nothing newer, ignore it;
    ``missing`` (a diff, no value held), ``gap`` (a diff from a version not held), ``mismatch``
    (the value, or the diff applied to the value held, does not have the digest the snapshot
    names): keep what is held and ask for the value again.  A diff's `tensors` (float32, the
    caller's own) are added to in place: they are the new value."""
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
        if expected is not None and digest(tensors) != expected:
            return held, "mismatch"
        return Served(version, dict(tensors), expected), "full"
    if held is not None and version <= held.version:
        return held, "old"
    if held is None:
        return held, "missing"
    if base_version != held.version or set(tensors) != set(held.tensors):
        return held, "gap"
    value = apply(held.tensors, tensors)
    if digest(value) != expected:
        return held, "mismatch"
    return Served(version, value, expected), "diff"
