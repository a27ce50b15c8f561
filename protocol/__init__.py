"""The wire protocol between islands, broker and merger: messages, framing, codecs, chunking.

Numpy, msgpack and (for the snapshot diff's compiled loops, code_loops.py) numba: this package
imports neither zmq nor jax.  PROTOCOL.md is the specification; this package is its reference
implementation.

    frames = protocol.encode(message)      # [topic, header, *payloads]; send with copy=False
    message = protocol.decode(frames)      # raises protocol.ProtocolError, and nothing else
"""

from dloco.protocol.assembly import Assembled, message_key
from dloco.protocol.chunking import (
    DEFAULT_MAX_CHUNK_BYTES,
    ChunkPlan,
    Encoded,
    model_fingerprint,
    split_fragment,
)
from dloco.protocol.encoding import encode
from dloco.protocol.error_feedback import compensate, quantize_with_feedback
from dloco.protocol.errors import DlocoError, EncodeError, ProtocolError
from dloco.protocol.fragments import partition
from dloco.protocol.framing import decode, peek_sender
from dloco.protocol.limits import DEFAULT_LIMITS, Limits, subscribable
from dloco.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    STREAM_KINDS,
    Ack,
    Cursor,
    DeltaChunk,
    DeltaResult,
    Heartbeat,
    Hello,
    Kind,
    Message,
    ResendRequest,
    SnapshotChunk,
    SnapshotRequest,
    TensorSlice,
)
from dloco.protocol.quantization import CODEC_NAMES, DEFAULT_BLOCK, Codec, CodedTensor
from dloco.protocol.reassembly import Reassembler

__all__ = [
    "Encoded",
    "CodedTensor",
    "CODEC_NAMES",
    "DEFAULT_BLOCK",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "STREAM_KINDS",
    "Ack",
    "Assembled",
    "ChunkPlan",
    "Codec",
    "Cursor",
    "DeltaChunk",
    "DeltaResult",
    "DlocoError",
    "EncodeError",
    "Heartbeat",
    "Hello",
    "Kind",
    "Limits",
    "Message",
    "ProtocolError",
    "Reassembler",
    "ResendRequest",
    "SnapshotChunk",
    "SnapshotRequest",
    "TensorSlice",
    "compensate",
    "decode",
    "encode",
    "message_key",
    "model_fingerprint",
    "partition",
    "peek_sender",
    "quantize_with_feedback",
    "split_fragment",
    "subscribable",
]
