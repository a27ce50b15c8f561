"""A coded delta's records kept as the parts they arrived in (protocol.CodedTensor): read as the
joined records, and views of the received frames after reassembly, never a joined copy."""

from __future__ import annotations

import numpy as np
import pytest

from dloco.protocol import Codec, CodedTensor, EncodeError, Reassembler, decode, encode
from tests.conftest import delta_messages, make_fragment

FRAGMENT = make_fragment()


def test_a_coded_tensor_in_parts_reads_as_the_joined_records():
    """Records of 5 blocks as parts of 2 and 3 (a delta's chunks as they arrived): the same scales,
    codes, values and norm bound as one array; parts that do not add up are refused."""
    codec = Codec("int4", 8)
    values = np.random.default_rng(4).standard_normal(37).astype(np.float32)
    records = codec.encode(values).reshape(-1, codec.record_nbytes)
    whole = CodedTensor(codec, (37,), records)
    parts = CodedTensor(codec, (37,), (records[:2].copy(), records[2:].copy()))
    assert parts.blocks == whole.blocks == 5 and len(parts.parts) == 2
    assert parts.scales.tolist() == whole.scales.tolist()
    out = np.zeros((5, 4), np.uint8)
    parts.codes_into(out)
    assert out.tobytes() == whole.codes.tobytes() == parts.codes.tobytes()
    assert (
        parts.decode().tobytes()
        == whole.decode().tobytes()
        == codec.decode(records.reshape(-1), 37).tobytes()
    )
    assert parts.squared_norm_bound() == whole.squared_norm_bound()
    # scaled part by part: the same records, never joined
    half = parts.scaled(np.float32(0.5))
    assert len(half.parts) == 2 and half.records.tobytes() == whole.scaled(0.5).records.tobytes()
    assert parts.scales.tolist() == whole.scales.tolist()
    with pytest.raises(EncodeError, match="must be uint8"):
        CodedTensor(codec, (37,), (records[:2], records[3:]))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_coded_reassembly_keeps_the_payloads_where_they_arrived(name):
    """decode=False (the merger's): a tensor's records are its chunks' payloads as parts, views of
    the received frames, no copy; they decode to the codec's values."""
    codec = Codec(name)
    frames = [[bytes(f) for f in encode(m)] for m in delta_messages(FRAGMENT, codec, 700)]
    chunks = [decode(f) for f in frames]
    reassembler = Reassembler(decode=False)
    (done,) = [r for m in chunks if (r := reassembler.add(m, 0.0))]
    payloads = [np.frombuffer(p, np.uint8) for c in chunks for p in c.payloads]
    for path, x in FRAGMENT.items():
        tensor = done.tensors[path]
        assert all(any(np.shares_memory(part, p) for p in payloads) for part in tensor.parts)
        expected = codec.decode(codec.encode(x.reshape(-1)), x.size).reshape(x.shape)
        assert np.array_equal(tensor.decode(), expected)
    assert max(len(t.parts) for t in done.tensors.values()) > 1
