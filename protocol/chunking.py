"""Cut a fragment (a flat ``{path: array}`` mapping) into self-describing chunks, and the model
fingerprint both ends compare.

Each tensor is encoded once with the codec; a chunk is a list of (slice, payload) pairs whose
payloads are zero-copy views of those encodings.  Tensors are taken in sorted path order and may
span chunks; slice boundaries fall on the codec's granule (a whole block for the int codecs), so
every slice decodes on its own.  Zero-size tensors carry no values and are left out.

Greedy fill (PROTOCOL.md §7): each slice takes as many granules as the chunk has payload room for,
up to the rest of its tensor; a new chunk begins when the current one has less room than one
granule, holds `Limits.max_slices` slices, or has no header room left for the next slice map.
Header room is counted with an upper bound per slice map (`slice_header_bound`) against the header
limit less `HEADER_RESERVE_BYTES` for the other fields, so no chunk is ever refused by a decoder
with the default limits: not for its slice count, nor its header size, nor its payload size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping

import numpy as np

from dloco.protocol.errors import EncodeError
from dloco.protocol.limits import DEFAULT_LIMITS, PATH, Limits
from dloco.protocol.messages import TENSOR_DTYPES, TensorSlice
from dloco.protocol.quantization import Codec

DEFAULT_MAX_CHUNK_BYTES = 1 << 20
# Header bytes kept for every field but `slices`: at their largest (identifiers of 64 characters,
# uint64 values) a delta's or a snapshot's other fields and the slices array's own length prefix
# take under 500 bytes.
HEADER_RESERVE_BYTES = 1024


def slice_header_bound(path: str, ndim: int) -> int:
    """Most bytes one slice map can take in a msgpack header: 88 plus the path's bytes plus 9 per
    dimension.  88 = map prefix 1, the seven keys 43, path string prefix 3, dtype string 9, shape
    array prefix 1, start, count and nbytes as uint64 27, crc32 as uint32 5."""
    return 88 + len(path.encode()) + 9 * ndim


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The tensor content of one chunk: payloads[i] is the encoding of slices[i]."""

    slices: tuple[TensorSlice, ...]
    payloads: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payloads)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A float32 tensor already encoded with the fragment's codec (error feedback encodes each to
    know what it leaves out): `split_fragment` packs these bytes as they are, so the sender never
    holds the fragment's decoded value."""

    data: np.ndarray
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def dtype_name(array: np.ndarray) -> str:
    name = np.dtype(array.dtype).name
    if name not in TENSOR_DTYPES:
        raise EncodeError(f"tensor dtype {name} is not one of {TENSOR_DTYPES}")
    return name


def split_fragment(
    tensors: Mapping[str, np.ndarray | Encoded],
    codec: Codec,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    limits: Limits = DEFAULT_LIMITS,
) -> list[ChunkPlan]:
    """Encode every tensor with `codec` and pack the encodings into chunks of ≤ max_chunk_bytes
    payload bytes that a decoder with `limits` accepts (the greedy fill of the module docstring)."""
    _check_chunk_bytes(codec, max_chunk_bytes, limits)
    header_room = limits.max_header_bytes - HEADER_RESERVE_BYTES
    # values per indivisible unit
    unit_values = codec.granule
    unit_bytes = codec.encoded_nbytes(unit_values)
    chunks: list[ChunkPlan] = []
    slices: list[TensorSlice] = []
    payloads: list[memoryview] = []
    room, header_used = max_chunk_bytes, 0
    for path in sorted(tensors):
        array = tensors[path]
        if not isinstance(array, Encoded):
            array = np.asarray(array)
        if array.size == 0:
            continue
        dtype = "float32" if isinstance(array, Encoded) else dtype_name(array)
        shape = tuple(int(d) for d in array.shape)
        bound = _slice_bound(path, shape, header_room, limits)
        if isinstance(array, Encoded):
            encoded_U = memoryview(_checked(array, codec))
        else:
            encoded_U = memoryview(codec.encode(np.asarray(array, dtype=np.float32).reshape(-1)))
        start = 0
        while start < array.size:
            if (
                room < unit_bytes
                or len(slices) == limits.max_slices
                or header_used + bound > header_room
            ):
                chunks.append(ChunkPlan(tuple(slices), tuple(payloads)))
                slices, payloads, room, header_used = [], [], max_chunk_bytes, 0
            count = min((room // unit_bytes) * unit_values, array.size - start)
            offset = (start // unit_values) * unit_bytes
            nbytes = codec.encoded_nbytes(count)
            slices.append(
                TensorSlice(path=path, dtype=dtype, shape=shape, start=start, count=count)
            )
            payloads.append(encoded_U[offset : offset + nbytes])
            room -= nbytes
            header_used += bound
            start += count
    if slices:
        chunks.append(ChunkPlan(tuple(slices), tuple(payloads)))
    if len(chunks) > limits.max_chunks:
        raise EncodeError(f"{len(chunks)} chunks exceed the decoders' limit of {limits.max_chunks}")
    return chunks


def _check_chunk_bytes(codec: Codec, max_chunk_bytes: int, limits: Limits) -> None:
    """Refuse a chunk size below one `codec` record or above the decoders' payload limit."""
    if max_chunk_bytes < codec.record_nbytes:
        raise EncodeError(
            f"max_chunk_bytes={max_chunk_bytes} is smaller than one {codec.name} record"
            f" ({codec.record_nbytes} bytes)"
        )
    if max_chunk_bytes > limits.max_payload_bytes:
        raise EncodeError(
            f"max_chunk_bytes={max_chunk_bytes} exceeds the decoders' payload limit of"
            f" {limits.max_payload_bytes}"
        )


def _slice_bound(path: str, shape: tuple[int, ...], header_room: int, limits: Limits) -> int:
    """Header bytes one slice of the tensor may take; refuse a tensor that no decoder accepts or
    whose slice map would not fit a chunk's header."""
    _check_tensor(path, shape, limits)
    bound = slice_header_bound(path, len(shape))
    if bound > header_room:
        raise EncodeError(
            f"a slice map of {path} may take {bound} header bytes, more than the {header_room}"
            " a chunk has for slices"
        )
    return bound


def _check_tensor(path: str, shape: tuple[int, ...], limits: Limits) -> None:
    """Refuse a tensor that no decoder with `limits` would accept in a slice map."""
    if len(path) > limits.max_path_len or not PATH.fullmatch(path):
        raise EncodeError(
            f"tensor path {path[:80]!r} must match {PATH.pattern} and be at most"
            f" {limits.max_path_len} characters"
        )
    if len(shape) > limits.max_ndim or math.prod(shape) > limits.max_tensor_values:
        raise EncodeError(
            f"tensor {path} of shape {shape} has more than {limits.max_ndim} dimensions or"
            f" {limits.max_tensor_values} values"
        )


def model_fingerprint(tensors: Mapping[str, np.ndarray | tuple[tuple[int, ...], str]]) -> str:
    """16 hex digits of sha256 over sorted (path, shape, dtype): equal iff the structures match.

    Values may be arrays or ``(shape, dtype_name)`` pairs, so a process can fingerprint a model it
    has not materialised.
    """
    digest = hashlib.sha256()
    for path in sorted(tensors):
        value = tensors[path]
        shape, dtype = (
            (value.shape, np.dtype(value.dtype).name) if hasattr(value, "shape") else value
        )
        digest.update(f"{path}|{','.join(map(str, shape))}|{dtype}\n".encode())
    return digest.hexdigest()[:16]


def _checked(encoded: Encoded, codec: Codec) -> np.ndarray:
    """The bytes of an Encoded tensor, flat, if they are as long as its values' encoding."""
    data = np.asarray(encoded.data, np.uint8).reshape(-1)
    expected = codec.encoded_nbytes(encoded.size)
    if data.size != expected:
        raise EncodeError(
            f"an encoded tensor of {encoded.size} values must be {expected} bytes of {codec.name},"
            f" got {data.size}"
        )
    return data
