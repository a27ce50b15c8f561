"""The sparse codecs topk2/topk4 (protocol/sparse.py, PROTOCOL.md §5) against hand-derived bytes
and their stated properties; the merger's fold from their records is in
tests/test_merger_coded.py."""

from __future__ import annotations

import numpy as np
import pytest

from dloco.island.config import ConfigError, SyncConfig
from dloco.merger.config import SnapshotConfig
from dloco.protocol import Codec, EncodeError, ProtocolError
from dloco.protocol.error_feedback import compensate, quantize_with_feedback


def test_the_worked_example_of_protocol_md():
    x = np.full(128, 0.25, np.float32)
    x[3], x[9], x[20], x[127] = 4.0, -1.0, 2.5, -3.0
    encoded = Codec("topk2", 128).encode(x)
    assert encoded.tobytes().hex(" ") == "00 00 00 40 03 09 14 7f c9"
    decoded = Codec("topk2", 128).decode(encoded, 128)
    assert {int(i): float(decoded[i]) for i in np.flatnonzero(decoded)} == {
        3: 4.0,
        9: -2.0,
        20: 2.0,
        127: -4.0,
    }


@pytest.mark.parametrize(
    "name,block", [("topk2", 128), ("topk2", 256), ("topk4", 256), ("topk4", 1024)]
)
@pytest.mark.parametrize("size", [1, 100, 256, 3 * 1024 + 17])
def test_sizes_kept_values_and_error(name, block, size):
    codec, rng = Codec(name, block), np.random.default_rng(size)
    x = (rng.standard_normal(size) * 3).astype(np.float32)
    encoded = codec.encode(x)
    assert encoded.size == codec.encoded_nbytes(size) == -(-size // block) * codec.record_nbytes
    codec.validate(encoded, size)
    decoded = codec.decode(encoded, size)
    M = 2 if name == "topk2" else 8
    for b in range(0, size, block):
        xb, db = x[b : b + block], decoded[b : b + block]
        kept = np.flatnonzero(db)
        assert len(kept) == min(block // 32, len(xb))
        # the kept values are the largest, and the rest decode to 0
        if len(xb) > len(kept):
            assert np.abs(xb[kept]).min() >= np.abs(np.delete(xb, kept)).max()
        scale = np.abs(xb).max() / M
        assert np.all(np.sign(db[kept]) == np.sign(xb[kept]))
        # at or above the smallest level: within half a step
        big = np.abs(xb[kept]) >= scale
        assert np.all(np.abs(db[kept] - xb[kept])[big] <= scale / 2 * (1 + 1e-6))
    # a decoded value encodes to the same bytes
    np.testing.assert_array_equal(codec.encode(decoded), encoded)


def test_a_block_of_zeros_is_flushed_and_decodes_to_zero():
    codec = Codec("topk4", 256)
    encoded = codec.encode(np.zeros(256, np.float32))
    assert (
        encoded[:4].tobytes() == bytes(4)
        and list(encoded[4:12]) == list(range(8))
        and not encoded[12:].any()
    )
    assert not codec.decode(encoded, 256).any()


@pytest.mark.parametrize(
    "indices,ok",
    [
        ((3, 9, 20, 127), True),
        ((3, 3, 20, 127), False),
        ((9, 3, 20, 127), False),
        ((3, 9, 20, 128), False),
    ],
)
def test_validate_wants_strictly_increasing_indices_below_the_block(indices, ok):
    record = np.concatenate(
        [np.frombuffer(np.float32(1.0).tobytes(), np.uint8), np.array([*indices, 0], np.uint8)]
    )
    if ok:
        Codec("topk2", 128).validate(record, 128)
    else:
        with pytest.raises(ProtocolError) as info:
            Codec("topk2", 128).validate(record, 128)
        assert info.value.reason == "sparse_index"
    wide = np.concatenate(
        [
            np.frombuffer(np.float32(1.0).tobytes(), np.uint8),
            np.arange(16, dtype="<u2").view(np.uint8),
            np.zeros(4, np.uint8),
        ]
    )
    # block > 256: uint16 indices
    Codec("topk2", 512).validate(wide, 512)
    wide[4 + 30 : 4 + 32] = np.array([512], "<u2").view(np.uint8)
    with pytest.raises(ProtocolError):
        Codec("topk2", 512).validate(wide, 512)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, -0.0, 1.8e38])
def test_validate_rejects_bad_scales(scale):
    record = np.concatenate(
        [np.frombuffer(np.float32(scale).tobytes(), np.uint8), np.array([0, 1, 2, 3, 0], np.uint8)]
    )
    with pytest.raises(ProtocolError) as info:
        Codec("topk2", 128).validate(record, 128)
    assert info.value.reason == "non_finite"


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(EncodeError, match="at least 128"):
        Codec("topk2", 64)
    with pytest.raises(EncodeError, match="non-finite"):
        Codec("topk2", 128).encode(np.full(128, np.nan, np.float32))
    with pytest.raises(ConfigError, match="error_feedback"):
        SyncConfig(codec="topk2")
    with pytest.raises(ConfigError, match="block >= 128"):
        SyncConfig(codec="topk4", error_feedback=True, block=64)
    SyncConfig(codec="topk2", error_feedback=True)
    with pytest.raises(ConfigError, match="diverged"):
        SnapshotConfig(snapshot_diff_codec="topk2")


def test_with_error_feedback_nothing_is_lost_for_good():
    """The running sum of what was sent tracks the running sum of what was meant within the last
    residual, which stays bounded; without feedback the gap grows with every round."""
    codec, rng = Codec("topk2", 256), np.random.default_rng(7)
    residual, sent, meant, plain = (
        None,
        np.zeros(4096, np.float32),
        np.zeros(4096, np.float32),
        np.zeros(4096, np.float32),
    )
    gaps = []
    for _ in range(60):
        delta = (rng.standard_normal(4096) * 1e-2).astype(np.float32)
        encoded, residual = quantize_with_feedback(delta, residual, codec)
        sent += codec.decode(encoded, 4096)
        plain += codec.decode(codec.encode(delta), 4096)
        meant += delta
        np.testing.assert_allclose(sent + residual, meant, atol=1e-5)
        gaps.append(np.linalg.norm(meant - sent))
    # bounded
    assert max(gaps[30:]) < 1.5 * max(gaps[:30])
    assert np.linalg.norm(meant - plain) > 3 * gaps[-1]


def test_ties_go_to_the_higher_index_so_a_tail_block_with_zeros_encodes_again_to_the_same_bytes():
    """127 values, two of them nonzero, block 128 (keep 4): the padding value (index 127) and the
    highest zero in range (126) fill the other two places; a decoded vector encodes to the same
    bytes.
    """
    codec = Codec("topk2", 128)
    d = np.zeros(127, np.float32)
    d[16], d[92] = -3.0, 1.0
    encoded = codec.encode(d)
    assert list(encoded[4:8]) == [16, 92, 126, 127]
    decoded = codec.decode(encoded, 127)
    # the kept zero decodes to +scale (error feedback carries it)
    assert sorted(np.flatnonzero(decoded)) == [16, 92, 126]
    np.testing.assert_array_equal(codec.encode(decoded), encoded)
    sent, kept = compensate({"w": d}, {}, codec)
    # what goes out is what feedback counted
    np.testing.assert_array_equal(codec.decode(codec.encode(sent["w"]), 127), sent["w"])
