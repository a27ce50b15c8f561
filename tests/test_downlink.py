"""Compressed downlink (protocol/downlink.py): the served value, by hand; receivers rebuild it bit
for bit through the real framing and reassembly; a diff that does not apply is refused (the island's
side of that, asking again, is in test_link_receiving.py)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from dloco import protocol
from dloco.protocol import downlink

F32 = np.float32


def test_a_full_snapshot_serves_what_its_codec_decodes():
    theta = {"w": np.array([1.0, 1.0 + 2.0**-10, 3.0], F32), "empty": np.zeros((0, 4), F32)}
    served, plans = downlink.full(theta, 5, protocol.Codec("bf16"), 1 << 20)
    # zero-size tensors carry nothing
    assert served.version == 5 and set(served.tensors) == {"w"}
    # bf16 keeps 8 significant bits: 1 + 2^-10 -> 1
    np.testing.assert_array_equal(served.tensors["w"], [1.0, 1.0, 3.0])
    assert served.digest == downlink.digest({"w": np.array([1.0, 1.0, 3.0], F32)})
    assert sum(p.nbytes for p in plans) == 6


def test_a_reply_is_bf16_while_the_served_value_is_bf16_and_fp32_after_a_diff():
    """1 + 2^-10 is not a bf16 value: after a full bf16 snapshot S = [1, 1, 3] is, so a reply in
    bf16 (6 bytes) is exact; a diff then moves w[0] by about 0.001, which bf16 cannot hold next to
    1, and the reply falls back to fp32 (12 bytes) — exact either way."""
    bf16 = protocol.Codec("bf16")
    theta = {"w": np.array([1.0, 1.0 + 2.0**-10, 3.0], F32)}
    served, _ = downlink.full(theta, 1, bf16, 1 << 20)
    codec, plans = downlink.reply(served, bf16, 1 << 20)
    assert codec.name == "bf16" and sum(p.nbytes for p in plans) == 6
    served, _ = downlink.diff(
        {"w": np.array([1.001, 1.0, 3.0], F32)}, served, 2, protocol.Codec("int4", block=8), 1 << 20
    )
    # not a bf16 value
    assert (
        served.tensors["w"][0] != 1.0
        and served.tensors["w"][0].astype(np.float32).view(np.uint32) & 0xFFFF
    )
    codec, plans = downlink.reply(served, bf16, 1 << 20)
    assert codec.name == "fp32" and sum(p.nbytes for p in plans) == 12
    for codec_, plans_ in ((codec, plans), downlink.reply(served, protocol.Codec("fp32"), 1 << 20)):
        decoded = downlink._decoded(plans_, codec_, {"w": (3,)})
        assert decoded["w"].tobytes() == served.tensors["w"].tobytes()


def test_an_int8_full_snapshot_is_replied_in_int8_exactly():
    """The cluster profile's join: S_0 = int8 of the initial model, so a reply re-encodes it in int8
    (a quarter of fp32) and the receiver decodes S_0 bit for bit."""
    int8 = protocol.Codec("int8")
    theta = {
        "w": (np.random.default_rng(3).standard_normal(5000) * 0.02).astype(F32),
        "b": np.linspace(-1, 1, 300, dtype=F32),
    }
    served, _ = downlink.full(theta, 0, int8, 1 << 20)
    codec, plans = downlink.reply(served, int8, 1 << 20)
    assert codec.name == "int8" and sum(p.nbytes for p in plans) == int8.encoded_nbytes(
        5000
    ) + int8.encoded_nbytes(300)
    decoded = downlink._decoded(plans, codec, {"w": (5000,), "b": (300,)})
    assert all(decoded[p].tobytes() == served.tensors[p].tobytes() for p in theta)
    assert downlink.digest(decoded) == served.digest


def test_a_diff_carries_the_previous_diffs_error():
    """int4, one block of 8: scale = absmax / 7, q = round(x / scale).  The first diff of
    [7, 3.4, 0...] decodes to [7, 3, 0...]; the model then stands still, so the second diff is the
    first one's error [0, 0.4, 0...], which int4 carries exactly up to float32 rounding."""
    int4 = protocol.Codec("int4", block=8)
    zero, _ = downlink.full({"w": np.zeros(8, F32)}, 0, protocol.Codec("fp32"), 1 << 20)
    theta = {"w": np.array([7, 3.4, 0, 0, 0, 0, 0, 0], F32)}
    first, plans = downlink.diff(theta, zero, 1, int4, 1 << 20)
    np.testing.assert_array_equal(first.tensors["w"], [7, 3, 0, 0, 0, 0, 0, 0])
    # one record: float32 scale + 8 nibbles
    assert sum(p.nbytes for p in plans) == 4 + 4
    second, _ = downlink.diff(theta, first, 2, int4, 1 << 20)
    np.testing.assert_allclose(second.tensors["w"], theta["w"], rtol=0, atol=1e-6)
    assert (second.version, second.digest) == (2, downlink.digest(second.tensors))
    with pytest.raises(protocol.EncodeError):
        # not newer
        downlink.diff(theta, second, 2, int4, 1 << 20)
    with pytest.raises(protocol.EncodeError):
        # other tensors
        downlink.diff({"v": np.ones(8, F32)}, second, 3, int4, 1 << 20)


def test_receive_rules_by_hand():
    a = {"w": np.array([1.0, 2.0], F32)}
    held = downlink.Served(3, a, downlink.digest(a))
    change = {"w": np.array([0.5, -0.25], F32)}
    after = {"w": np.array([1.5, 1.75], F32)}
    good = downlink.digest(after)

    assert downlink.receive(None, 3, None, None, a)[1] == "full"
    assert downlink.receive(held, 2, None, 7, a) == (held, "old")
    # the value already held
    assert downlink.receive(held, 3, None, held.digest, a) == (held, "old")
    # same version, other value: a restarted merger
    replaced, outcome = downlink.receive(held, 3, None, good, after)
    assert outcome == "full" and replaced.digest == good
    # a full value is checked too
    assert downlink.receive(held, 4, None, good ^ 1, after) == (held, "mismatch")
    # a merger without diffs names no digest
    assert downlink.receive(held, 4, None, None, after)[0].digest is None

    value, outcome = downlink.receive(held, 4, 3, good, change)
    assert outcome == "diff" and value.version == 4 and value.digest == good
    np.testing.assert_array_equal(value.tensors["w"], after["w"])
    assert downlink.receive(held, 4, 3, good ^ 1, change) == (held, "mismatch")
    assert downlink.receive(held, 5, 4, good, change) == (held, "gap")
    assert downlink.receive(held, 4, 3, good, {"v": change["w"]}) == (held, "gap")
    assert downlink.receive(None, 4, 3, good, change) == (None, "missing")
    assert downlink.receive(held, 3, 2, good, change) == (held, "old")
    assert downlink.ASK_AGAIN == {"missing", "gap", "mismatch"} and downlink.ADOPT == {
        "full",
        "diff",
    }


def snapshot_frames(
    served_plans, version, codec, base=None, digest=None, seq=1, epoch=1, served=None
):
    return [
        protocol.encode(
            protocol.SnapshotChunk(
                sender="merger",
                epoch=epoch,
                seq=seq + i,
                fragment=0,
                version=version,
                chunk_index=i,
                chunk_count=len(served_plans),
                model="m",
                codec=codec,
                slices=plan.slices,
                payloads=plan.payloads,
                base_version=base,
                digest=digest,
                served=served,
            )
        )
        for i, plan in enumerate(served_plans)
    ]


# decoded at completion, or chunk by chunk as islands do; the served value in float32 or bfloat16
@pytest.mark.parametrize("stream,served_dtype", [(False, None), (True, None), (True, "bf16")])
def test_receivers_rebuild_the_served_value_bit_for_bit_through_the_wire(stream, served_dtype):
    """Sender: a full bf16 snapshot, then 20 int4 diffs of a drifting model, cut into small chunks.
    Receiver: the real decoder and reassembler, chunks in reverse order.  Same bytes every version.
    """
    rng = np.random.default_rng(0)
    theta = {"a": rng.normal(size=(64, 33)).astype(F32), "b": rng.normal(size=(1000,)).astype(F32)}
    bf16, int4 = protocol.Codec("bf16"), protocol.Codec("int4", block=64)
    served, plans = downlink.full(theta, 0, bf16, 1 << 20, served_dtype)
    held, reassembler = None, protocol.Reassembler(stream=stream)
    frames = snapshot_frames(plans, 0, bf16, digest=served.digest, served=served_dtype)
    for version in range(21):
        if version:
            theta = {p: v + 0.01 * rng.normal(size=v.shape).astype(F32) for p, v in theta.items()}
            served, plans = downlink.diff(theta, served, version, int4, 512)
            frames = snapshot_frames(
                plans,
                version,
                int4,
                base=version - 1,
                digest=served.digest,
                seq=100 * version,
                served=served_dtype,
            )
        assert len(frames) >= (1 if version == 0 else 2)
        for chunk in reversed(frames):
            assembled = reassembler.add(protocol.decode(chunk), now=0.0)
        head = assembled.header
        held, outcome = downlink.receive(
            held, head.version, head.base_version, head.digest, assembled.tensors, head.served
        )
        assert outcome == ("full" if version == 0 else "diff") and held.digest == served.digest
        for path in theta:
            assert held.tensors[path].dtype == downlink.SERVED_DTYPES[served_dtype]
            np.testing.assert_array_equal(held.tensors[path], served.tensors[path])
    # error feedback keeps the served value within one diff's error of the model after 20 diffs
    assert max(float(np.abs(served.tensors[p] - theta[p]).max()) for p in theta) < 0.01


def test_a_snapshot_header_carries_base_and_digest_only_for_diffs():
    plan = protocol.split_fragment({"w": np.ones(8, F32)}, protocol.Codec("fp32"))[0]
    full = protocol.encode(
        protocol.SnapshotChunk(
            sender="m",
            epoch=1,
            seq=1,
            fragment=0,
            version=2,
            chunk_index=0,
            chunk_count=1,
            model="m",
            codec=protocol.Codec("fp32"),
            slices=plan.slices,
            payloads=plan.payloads,
        )
    )
    # what peers before diffs sent and accept
    assert b"base_version" not in bytes(full[1]) and b"digest" not in bytes(full[1])
    decoded = protocol.decode(full)
    assert decoded.base_version is None and decoded.digest is None
    diff = snapshot_frames([plan], 2, protocol.Codec("fp32"), base=1, digest=123)[0]
    decoded = protocol.decode(diff)
    assert (decoded.base_version, decoded.digest) == (1, 123)
    header = msgpack.unpackb(bytes(diff[1]))
    for base, digest, reason in (
        (2, 5, "field_value"),
        (1, None, "field_value"),
        (1, 1 << 32, "field_value"),
    ):
        changed = {**header, "base_version": base, "digest": digest}
        if digest is None:
            del changed["digest"]
        bad = [diff[0], msgpack.packb(changed), *diff[2:]]
        with pytest.raises(protocol.ProtocolError) as error:
            protocol.decode(bad)
        assert error.value.reason == reason
        # and the encoder never emits it
        with pytest.raises(protocol.EncodeError, match="refused by its receivers"):
            snapshot_frames([plan], 2, protocol.Codec("fp32"), base=base, digest=digest)


def test_a_bfloat16_served_value_is_rounded_after_each_snapshot_the_next_diff_carries_it():
    """bf16 keeps 8 significant bits: next to 1 its step is 2^-7 = 0.0078125.  fp32 diffs (no
    codec error) of a model moving 0.003 a version: S = bf16(1 + 0.003) = 1 (below half a step);
    the next diff is then 0.006, S = bf16(1.006) = 1.0078125; then 0.009 - 0.0078125 = 0.0011875,
    S = bf16(1.0089...) = 1.0078125 again.  S stays within half a step of the model."""
    fp32 = protocol.Codec("fp32")
    served, _ = downlink.full({"w": np.array([1.0, 3.0], F32)}, 0, fp32, 1 << 20, "bf16")
    assert served.tensors["w"].dtype == downlink.SERVED_DTYPES["bf16"]
    held = []
    for version in (1, 2, 3):
        theta = {"w": np.array([1.0 + 0.003 * version, 3.0], F32)}
        served, plans = downlink.diff(theta, served, version, fp32, 1 << 20)
        held.append(float(served.tensors["w"][0]))
        assert served.tensors["w"].nbytes == 4
    assert held == [1.0, 1.0078125, 1.0078125]
    assert served.digest == downlink.digest(
        {"w": np.array([1.0078125, 3.0], downlink.SERVED_DTYPES["bf16"])}
    )
    # a receiver applying the last diff to the bf16 value it held computes the same bytes
    before = {"w": np.array([1.0078125, 3.0], F32).astype(downlink.SERVED_DTYPES["bf16"])}
    change = downlink._decoded(plans, fp32, {"w": (2,)})
    received, outcome = downlink.receive(
        downlink.Served(2, before, None), 3, 2, served.digest, change, "bf16"
    )
    assert outcome == "diff" and received.tensors["w"].tobytes() == served.tensors["w"].tobytes()
    # replied exactly in bf16 (4 bytes), not fp32 (8), when int8 cannot hold it
    codec, plans = downlink.reply(served, protocol.Codec("int8"), 1 << 20)
    assert codec.name == "bf16" and sum(p.nbytes for p in plans) == 4


def test_served_comes_only_with_a_digest_and_names_bf16():
    plan = protocol.split_fragment({"w": np.ones(8, F32)}, protocol.Codec("fp32"))[0]
    frames = snapshot_frames([plan], 2, protocol.Codec("fp32"), base=1, digest=7, served="bf16")[0]
    assert protocol.decode(frames).served == "bf16"
    header = msgpack.unpackb(bytes(frames[1]))
    for changed in ({**header, "served": "fp16"}, {**header, "served": 1}):
        with pytest.raises(protocol.ProtocolError) as error:
            protocol.decode([frames[0], msgpack.packb(changed), *frames[2:]])
        assert error.value.reason == "field_value"
    with pytest.raises(protocol.EncodeError, match="refused by its receivers"):
        snapshot_frames([plan], 2, protocol.Codec("fp32"), served="bf16")


def test_the_senders_diff_moves_the_served_value_in_place_a_tensor_at_a_time():
    """The merger's side of a diff of eight 1 MiB tensors through 64 KiB chunks: its served value is
    what a receiver decodes from the chunks and adds, bit for bit; the served arrays are updated
    where they lie; and what the diff allocates is the encodings plus about one tensor's change and
    decoding (tracemalloc sees numpy's buffers), not the fragment twice."""
    import tracemalloc

    rng = np.random.default_rng(11)
    shapes = {f"t{i}": (256, 1024) for i in range(8)}
    theta = {p: rng.standard_normal(s).astype(F32) for p, s in shapes.items()}
    int4 = protocol.Codec("int4")
    served, _ = downlink.full(
        {p: v + rng.standard_normal(v.shape).astype(F32) for p, v in theta.items()},
        0,
        protocol.Codec("fp32"),
        1 << 16,
    )
    before = {p: v.copy() for p, v in served.tensors.items()}
    arrays = {p: id(v) for p, v in served.tensors.items()}
    tracemalloc.start()
    new, plans = downlink.diff(theta, served, 1, int4, 1 << 16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    received = downlink.apply(before, downlink._decoded(plans, int4, shapes))
    assert all(new.tensors[p].tobytes() == received[p].tobytes() for p in shapes)
    assert new.digest == downlink.digest(received) and new.version == 1
    assert {p: id(v) for p, v in new.tensors.items()} == arrays
    tensor, fragment = 1 << 20, 8 << 20
    encodings = sum(p.nbytes for p in plans)
    assert peak < encodings + 3 * tensor < fragment


def test_a_diff_that_cannot_be_encoded_leaves_the_served_value_whole():
    """A NaN in the last tensor: every tensor is encoded before any served array moves."""
    served, _ = downlink.full(
        {"a": np.zeros(8, F32), "b": np.zeros(8, F32)}, 0, protocol.Codec("fp32"), 1 << 20
    )
    with pytest.raises(protocol.EncodeError):
        downlink.diff(
            {"a": np.ones(8, F32), "b": np.array([np.nan] + [1.0] * 7, F32)},
            served,
            1,
            protocol.Codec("int8", block=8),
            1 << 20,
        )
    assert not served.tensors["a"].any() and not served.tensors["b"].any()


@pytest.mark.parametrize("served_dtype", [None, "bf16"])
@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_the_compiled_diff_gives_the_bytes_of_encoding_the_change_in_numpy(
    name, served_dtype, monkeypatch
):
    """protocol/code_loops.py against the numpy path (the change encoded by `Codec.encode`, its
    decoding added, the sum rounded to bfloat16 by ml_dtypes): the same payloads and served
    value, for tensors of whole blocks, of a partial last block, smaller than a block, and
    unchanged (scale 0)."""
    rng, codec = np.random.default_rng(5), protocol.Codec(name, block=64)
    shapes = {"a": (100, 64), "b": (1013,), "c": (5,), "z": (64,)}
    theta = {p: rng.standard_normal(s).astype(F32) for p, s in shapes.items()}
    theta["z"][:] = 0
    start = {p: v + rng.standard_normal(v.shape).astype(F32) * F32(0.01) for p, v in theta.items()}
    start["z"][:] = 0
    diffs = []
    for compiled in (True, False):
        monkeypatch.setattr(downlink, "_compiled", lambda codec, on=compiled: on)
        held = downlink.held_as({p: v.copy() for p, v in start.items()}, served_dtype)
        served = downlink.Served(0, held, 0)
        diffs.append(downlink.diff(theta, served, 1, codec, 1 << 12))
    (new, plans), (expected, expected_plans) = diffs
    assert [bytes(p) for plan in plans for p in plan.payloads] == [
        bytes(p) for plan in expected_plans for p in plan.payloads
    ]
    assert all(new.tensors[p].tobytes() == expected.tensors[p].tobytes() for p in shapes)
    assert new.digest == expected.digest


def test_a_compiled_diff_too_large_for_its_codec_leaves_the_served_value_whole():
    """int8's largest scale is FLT_MAX / 128: a change of 3.39e38 needs 3.39e38 / 127, above it."""
    served, _ = downlink.full(
        {"a": np.zeros(8, F32), "b": np.zeros(8, F32)}, 0, protocol.Codec("fp32"), 1 << 20
    )
    with pytest.raises(protocol.EncodeError, match="too large"):
        downlink.diff(
            {"a": np.ones(8, F32), "b": np.full(8, 3.39e38, F32)},
            served,
            1,
            protocol.Codec("int8", block=8),
            1 << 20,
        )
    assert not served.tensors["a"].any() and not served.tensors["b"].any()
