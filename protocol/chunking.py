"""Cut a fragment (a flat ``{path: array}`` mapping) into self-describing chunks, and the model
fingerprint both ends compare.

Each tensor is encoded once with the codec; a chunk is a list of (slice, payload) pairs whose
payloads are zero-copy views of those encodings, at most ``max_chunk_bytes`` in all.  Tensors are
taken in sorted path order and may span chunks; slice boundaries fall on the codec's granule
(a whole block for the int codecs), so every slice decodes on its own.  Zero-size tensors carry no
values and are left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import numpy as np

from protocol.errors import EncodeError
from protocol.messages import TENSOR_DTYPES, TensorSlice
from protocol.quantization import Codec

DEFAULT_MAX_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The tensor content of one chunk: payloads[i] is the encoding of slices[i]."""

    slices: tuple[TensorSlice, ...]
    payloads: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payloads)


def dtype_name(array: np.ndarray) -> str:
    name = np.dtype(array.dtype).name
    if name not in TENSOR_DTYPES:
        raise EncodeError(f"tensor dtype {name} is not one of {TENSOR_DTYPES}")
    return name


def split_fragment(tensors: Mapping[str, np.ndarray], codec: Codec, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> list[ChunkPlan]:
    """Encode every tensor with `codec` and pack the encodings into chunks of ≤ max_chunk_bytes."""
    if max_chunk_bytes < codec.record_nbytes:
        raise EncodeError(f"max_chunk_bytes={max_chunk_bytes} is smaller than one {codec.name} record ({codec.record_nbytes} bytes)")
    unit_values = codec.granule  # values per indivisible unit
    unit_bytes = codec.encoded_nbytes(unit_values)
    chunks: list[ChunkPlan] = []
    slices: list[TensorSlice] = []
    payloads: list[memoryview] = []
    room = max_chunk_bytes
    for path in sorted(tensors):
        array = np.asarray(tensors[path])
        if array.size == 0:
            continue
        dtype, shape = dtype_name(array), tuple(int(d) for d in array.shape)
        encoded_U = memoryview(codec.encode(np.asarray(array, dtype=np.float32).reshape(-1)))
        start = 0
        while start < array.size:
            if room < unit_bytes:
                chunks.append(ChunkPlan(tuple(slices), tuple(payloads)))
                slices, payloads, room = [], [], max_chunk_bytes
            count = min((room // unit_bytes) * unit_values, array.size - start)
            offset = (start // unit_values) * unit_bytes
            nbytes = codec.encoded_nbytes(count)
            slices.append(TensorSlice(path=path, dtype=dtype, shape=shape, start=start, count=count))
            payloads.append(encoded_U[offset : offset + nbytes])
            room -= nbytes
            start += count
    if slices:
        chunks.append(ChunkPlan(tuple(slices), tuple(payloads)))
    return chunks


def model_fingerprint(tensors: Mapping[str, np.ndarray | tuple[tuple[int, ...], str]]) -> str:
    """16 hex digits of sha256 over sorted (path, shape, dtype): equal iff the structures match.

    Values may be arrays or ``(shape, dtype_name)`` pairs, so a process can fingerprint a model it
    has not materialised.
    """
    digest = hashlib.sha256()
    for path in sorted(tensors):
        value = tensors[path]
        shape, dtype = (value.shape, np.dtype(value.dtype).name) if hasattr(value, "shape") else value
        digest.update(f"{path}|{','.join(map(str, shape))}|{dtype}\n".encode())
    return digest.hexdigest()[:16]
