"""Chunking and reassembly: bounded chunks, any order, duplicates, inconsistency, eviction."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dloco import protocol
from dloco.protocol import Codec, ProtocolError, Reassembler, decode, encode, message_key
from dloco.protocol.reassembly import CHUNK_OVERHEAD_BYTES, SLICE_OVERHEAD_BYTES
from tests.conftest import delta_messages, make_fragment

FRAGMENT = make_fragment()


def wire(messages):
    """What a receiver sees: the messages after encode -> bytes -> decode."""
    return [decode([bytes(f) for f in encode(m)]) for m in messages]


@pytest.mark.parametrize("name", protocol.CODEC_NAMES)
@pytest.mark.parametrize("max_chunk_bytes", [260, 1000, 4096, 1 << 20])
def test_chunks_respect_the_budget_and_tile_every_tensor(name, max_chunk_bytes):
    codec = Codec(name)
    if max_chunk_bytes < codec.record_nbytes:
        with pytest.raises(protocol.EncodeError):
            protocol.split_fragment(FRAGMENT, codec, max_chunk_bytes)
        return
    plans = protocol.split_fragment(FRAGMENT, codec, max_chunk_bytes)
    covered = {path: 0 for path in FRAGMENT}
    for plan in plans:
        assert 0 < plan.nbytes <= max_chunk_bytes
        for item, payload in zip(plan.slices, plan.payloads):
            assert item.start % codec.granule == 0 and payload.nbytes == codec.encoded_nbytes(
                item.count
            )
            # in order, no gap, no overlap
            assert item.start == covered[item.path]
            covered[item.path] += item.count
    assert covered == {path: a.size for path, a in FRAGMENT.items()}


@pytest.mark.parametrize("name", protocol.CODEC_NAMES)
def test_reassembly_equals_whole_tensor_decode(name):
    codec = Codec(name)
    # several chunks
    chunks = wire(delta_messages(FRAGMENT, codec, max_chunk_bytes=100 if codec.sparse else 700))
    reassembler = Reassembler()
    results = [r for m in chunks if (r := reassembler.add(m, 0.0))]
    assert len(chunks) > 1 and len(results) == 1
    for path, x in FRAGMENT.items():
        expected = codec.decode(codec.encode(x.reshape(-1)), x.size).reshape(x.shape)
        assert results[0].tensors[path].shape == x.shape
        assert np.array_equal(results[0].tensors[path], expected)


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(12)), st.lists(st.integers(0, 11), max_size=8))
def test_any_order_with_duplicates_completes_exactly_once(order, duplicates):
    # 4 records of 132 B per chunk
    chunks = wire(delta_messages(FRAGMENT, Codec("int4"), max_chunk_bytes=600))
    assert len(chunks) == 12
    reassembler = Reassembler()
    arrivals = [chunks[i] for i in order]
    for i in duplicates:
        arrivals.insert(i, chunks[i])
    # late duplicates after completion
    arrivals += [chunks[0], chunks[-1]]
    completed = [r for chunk in arrivals if (r := reassembler.add(chunk, 0.0))]
    assert len(completed) == 1
    assert completed[0].seqs == tuple(range(1, 13))
    assert (
        reassembler.stats.duplicates == len(duplicates) + 2
        and len(reassembler) == 0
        and reassembler.held_bytes == 0
    )


def test_inconsistent_chunks_are_rejected_and_state_kept():
    chunks = wire(delta_messages(FRAGMENT, Codec("int8"), max_chunk_bytes=2000))
    reassembler = Reassembler()
    assert reassembler.add(chunks[0], 0.0) is None
    other_base = dataclasses.replace(chunks[1], base_version=99)
    wrong_shape = dataclasses.replace(
        chunks[1],
        slices=tuple(dataclasses.replace(s, shape=(1, *s.shape)) for s in chunks[1].slices),
    )
    overlapping = dataclasses.replace(
        chunks[1], slices=chunks[0].slices, payloads=chunks[0].payloads
    )
    for bad in (other_base, wrong_shape, overlapping):
        with pytest.raises(ProtocolError) as info:
            reassembler.add(bad, 0.0)
        assert info.value.reason == "inconsistent"
    assert reassembler.stats.inconsistent == 3
    completed = [r for chunk in chunks[1:] if (r := reassembler.add(chunk, 0.0))]
    # the good chunks still complete the delta
    assert len(completed) == 1


def test_a_chunk_count_that_lies_is_caught_at_completion():
    chunks = wire(delta_messages(FRAGMENT, Codec("fp32"), max_chunk_bytes=4000))
    short = [dataclasses.replace(c, chunk_count=2) for c in chunks[:2]]
    reassembler = Reassembler()
    reassembler.add(short[0], 0.0)
    with pytest.raises(ProtocolError, match="values after all chunks arrived") as info:
        reassembler.add(short[1], 0.0)
    assert info.value.reason == "inconsistent"


def test_a_failed_tiling_check_forgets_the_message_so_chunks_sent_again_are_reassembled_afresh():
    """§7: a message that fails the tiling check is dropped whole and not remembered as
    delivered."""
    chunks = wire(delta_messages(FRAGMENT, Codec("fp32"), max_chunk_bytes=4000))
    short = [dataclasses.replace(c, chunk_count=2) for c in chunks[:2]]
    reassembler = Reassembler()
    # sent again, the same faulty chunks are refused again, never silently dropped
    for attempt in (1, 2):
        assert reassembler.add(short[0], 0.0) is None
        with pytest.raises(ProtocolError):
            reassembler.add(short[1], 0.0)
        assert reassembler.stats.inconsistent == attempt and reassembler.stats.duplicates == 0
        assert (
            not reassembler.delivered(message_key(short[0]))
            and len(reassembler) == 0
            and reassembler.held_bytes == 0
        )
    # the whole message, resent
    completed = [r for chunk in chunks if (r := reassembler.add(chunk, 0.0))]
    assert len(completed) == 1 and reassembler.delivered(completed[0].key)


def test_a_repeated_chunk_index_is_ignored_only_when_it_is_the_same_chunk():
    """§7: same index, same slices (checksums included): a duplicate; anything else:
    inconsistent."""
    chunks = wire(delta_messages(FRAGMENT, Codec("int8"), max_chunk_bytes=2000))
    reassembler = Reassembler()
    reassembler.add(chunks[0], 0.0)
    assert reassembler.add(chunks[0], 0.0) is None and reassembler.stats.duplicates == 1
    other_slices = dataclasses.replace(chunks[1], chunk_index=0)
    first = chunks[0].slices[0]
    other_bytes = dataclasses.replace(
        chunks[0], slices=(dataclasses.replace(first, crc32=first.crc32 ^ 1), *chunks[0].slices[1:])
    )
    for bad in (other_slices, other_bytes):
        with pytest.raises(ProtocolError) as info:
            reassembler.add(bad, 0.0)
        assert info.value.reason == "inconsistent"
    assert reassembler.stats.inconsistent == 2 and reassembler.stats.duplicates == 1
    completed = [r for chunk in chunks[1:] if (r := reassembler.add(chunk, 0.0))]
    # the chunk held first stands
    assert len(completed) == 1


def test_checks_run_in_the_written_order():
    """§7: delivered key, whole-message fields, repeated index, budget, then slices."""
    chunks = wire(delta_messages(FRAGMENT, Codec("fp32"), max_chunk_bytes=4000))
    reassembler = Reassembler(max_bytes=cost(chunks[0]) + cost(chunks[1]) - 1)
    reassembler.add(chunks[0], 0.0)
    overlapping_other_base = dataclasses.replace(
        chunks[1], base_version=99, slices=chunks[0].slices, payloads=chunks[0].payloads
    )
    with pytest.raises(ProtocolError, match="whole-message fields"):
        reassembler.add(overlapping_other_base, 0.0)
    # the index is held: not a budget matter
    with pytest.raises(ProtocolError, match="claim index"):
        reassembler.add(dataclasses.replace(chunks[1], chunk_index=0), 0.0)
    # over the budget and overlapping: the budget first
    with pytest.raises(ProtocolError) as info:
        reassembler.add(
            dataclasses.replace(chunks[1], slices=chunks[0].slices, payloads=chunks[1].payloads),
            0.0,
        )
    assert info.value.reason == "reassembly_budget"
    done = Reassembler()
    (small,) = wire(delta_messages({"w": np.ones(4, np.float32)}, Codec("fp32")))
    done.add(small, 0.0)
    # a delivered key: ignored, unchecked
    assert done.add(dataclasses.replace(small, base_version=99), 0.0) is None


def test_incomplete_messages_are_evicted_after_the_ttl():
    chunks = wire(delta_messages(FRAGMENT, Codec("int4"), max_chunk_bytes=1100))
    reassembler = Reassembler(ttl_s=5.0)
    # nothing more arrives
    reassembler.add(chunks[0], now=100.0)
    assert reassembler.evict(now=104.0) == [] and len(reassembler) == 1
    assert len(reassembler.evict(now=105.5)) == 1
    assert (
        len(reassembler) == 0 and reassembler.held_bytes == 0 and reassembler.stats.evicted_ttl == 1
    )


def cost(chunk) -> int:
    return (
        sum(p.nbytes for p in chunk.payloads)
        + CHUNK_OVERHEAD_BYTES
        + SLICE_OVERHEAD_BYTES * len(chunk.slices)
    )


def test_memory_budget_evicts_the_least_recently_extended_partial():
    first = wire(delta_messages(FRAGMENT, Codec("fp32"), max_chunk_bytes=4000, delta_id=1))
    second = wire(delta_messages(FRAGMENT, Codec("fp32"), max_chunk_bytes=4000, delta_id=2))
    reassembler = Reassembler(
        max_bytes=sum(cost(c) for c in (first[0], first[1], second[0], second[1])) - 1
    )
    reassembler.add(first[0], 0.0)
    reassembler.add(second[0], 0.5)
    # first is now the most recently extended
    reassembler.add(first[1], 1.0)
    # needs room: second's own older chunk stays, first is evicted
    reassembler.add(second[1], 1.5)
    assert reassembler.stats.evicted_memory == 1 and [key[3] for key in reassembler._partials] == [
        2
    ]
    assert reassembler.held_bytes == cost(second[0]) + cost(second[1]) <= reassembler.max_bytes


def test_a_sender_past_its_share_evicts_its_own_partials_not_others():
    """Budget for three first chunks in all, two per sender: a's third partial evicts a's oldest,
    and b's partial, older than both, stays."""

    def chunk(sender, delta_id):
        return wire(
            delta_messages(
                FRAGMENT, Codec("fp32"), max_chunk_bytes=4000, sender=sender, delta_id=delta_id
            )
        )[0]

    one = cost(chunk("a", 1))
    reassembler = Reassembler(max_bytes=3 * one, max_sender_bytes=2 * one)
    reassembler.add(chunk("b", 1), 0.0)
    for delta_id in (1, 2, 3):
        reassembler.add(chunk("a", delta_id), 1.0 + delta_id)
    assert [(key[0], key[3]) for key in reassembler._partials] == [("b", 1), ("a", 2), ("a", 3)]
    assert reassembler.stats.evicted_memory == 1 and reassembler.sender_bytes == {
        "a": 2 * one,
        "b": one,
    }
    # a message alone past the sender's share is refused
    with pytest.raises(ProtocolError) as info:
        Reassembler(max_bytes=3 * one, max_sender_bytes=one - 1).add(chunk("a", 1), 0.0)
    assert info.value.reason == "reassembly_budget"


def test_a_message_larger_than_the_budget_is_refused_not_held():
    chunks = wire(delta_messages(FRAGMENT, Codec("fp32"), max_chunk_bytes=4000))
    reassembler = Reassembler(max_bytes=cost(chunks[0]) + cost(chunks[1]) - 1)
    reassembler.add(chunks[0], 0.0)
    with pytest.raises(ProtocolError) as info:
        reassembler.add(chunks[1], 0.0)
    assert (
        info.value.reason == "reassembly_budget"
        and reassembler.held_bytes == 0
        and len(reassembler) == 0
    )


def test_many_tiny_slices_cost_their_overhead_and_stay_linear():
    x = {"w": np.arange(20_000, dtype=np.float32)}
    plan = protocol.split_fragment(x, Codec("fp32"))[0]
    (whole,) = plan.slices
    slices = [dataclasses.replace(whole, start=i, count=1) for i in range(20_000)]
    payloads = [plan.payloads[0][4 * i : 4 * i + 4] for i in range(20_000)]
    reassembler = Reassembler(max_bytes=1 << 30)
    chunks = [
        protocol.DeltaChunk(
            sender="a",
            epoch=1,
            seq=k + 1,
            delta_id=1,
            fragment=0,
            base_version=0,
            chunk_index=k,
            chunk_count=20,
            steps=1,
            tokens=1,
            model="m",
            codec=Codec("fp32"),
            slices=tuple(slices[k::20]),
            payloads=tuple(payloads[k::20]),
        )
        # interleaved: worst case for span bookkeeping
        for k in range(20)
    ]
    done = [r for c in chunks if (r := reassembler.add(c, 0.0))]
    assert np.array_equal(done[0].tensors["w"], x["w"])
    with pytest.raises(ProtocolError, match="reassembly budget"):
        # 1000 slices cost more than their 4 kB of payload
        Reassembler(max_bytes=1000 * SLICE_OVERHEAD_BYTES).add(chunks[0], 0.0)


def test_the_ttl_runs_from_the_latest_chunk():
    chunks = wire(delta_messages(FRAGMENT, Codec("int4"), max_chunk_bytes=600))
    reassembler = Reassembler(ttl_s=10.0)
    for t, chunk in zip([0.0, 9.0, 18.0, 27.0], chunks[:4]):
        assert reassembler.add(chunk, t) is None
    assert reassembler.stats.evicted_ttl == 0 and len(reassembler) == 1


def test_completed_keys_are_remembered_in_bounded_memory():
    reassembler = Reassembler(remember=3)
    for delta_id in range(1, 6):
        small = {"w": np.ones(4, dtype=np.float32)}
        (chunk,) = wire(delta_messages(small, Codec("fp32"), delta_id=delta_id))
        assert reassembler.add(chunk, 0.0) is not None
    assert len(reassembler._done) == 3


def test_snapshots_reassemble_by_fragment_version_and_base():
    plans = protocol.split_fragment(FRAGMENT, Codec("bf16"), 3000)
    chunks = wire(
        [
            protocol.SnapshotChunk(
                sender="merger",
                epoch=1,
                seq=i + 1,
                fragment=1,
                version=8,
                chunk_index=i,
                chunk_count=len(plans),
                model="m",
                codec=Codec("bf16"),
                slices=p.slices,
                payloads=p.payloads,
            )
            for i, p in enumerate(plans)
        ]
    )
    reassembler = Reassembler()
    results = [r for c in reversed(chunks) if (r := reassembler.add(c, 0.0))]
    # a full snapshot: no base
    assert len(results) == 1 and results[0].key == ("merger", 1, "snapshot", 1, 8, None)
    for path, x in FRAGMENT.items():
        assert np.allclose(results[0].tensors[path], x, rtol=2**-8, atol=0)


def test_model_fingerprint_depends_on_structure_only():
    same_structure = {path: np.zeros_like(a) for path, a in FRAGMENT.items()}
    assert protocol.model_fingerprint(FRAGMENT) == protocol.model_fingerprint(same_structure)
    assert protocol.model_fingerprint(FRAGMENT) == protocol.model_fingerprint(
        {p: (a.shape, "float32") for p, a in FRAGMENT.items()}
    )
    renamed = {**FRAGMENT, "head/bias": np.zeros(2, dtype=np.float32)}
    assert protocol.model_fingerprint(FRAGMENT) != protocol.model_fingerprint(renamed)


def test_partition_balances_bytes_deterministically():
    shapes = {"a": (100,), "b": (60,), "c": (50,), "d": (40,), "e": (10,)}
    # LPT by hand: a(100)->0, b(60)->1, c(50)->1 (60<100), d(40)->0? loads 100 vs 110 -> 0, e(10)->1
    # (110 vs 140)
    assert protocol.partition(shapes, 2) == [["a", "d"], ["b", "c", "e"]]
    assert protocol.partition(dict(reversed(list(shapes.items()))), 2) == [
        ["a", "d"],
        ["b", "c", "e"],
    ]
    assert protocol.partition(shapes, 1) == [["a", "b", "c", "d", "e"]]
    with pytest.raises(protocol.EncodeError):
        protocol.partition(shapes, 6)
    with pytest.raises(protocol.EncodeError):
        protocol.partition(shapes, 0)


@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_a_fragment_already_encoded_is_cut_into_the_same_chunks(name):
    """Error feedback hands split_fragment encodings (protocol.Encoded), not values: the chunks are
    those of the values themselves, and bytes of the wrong length are refused."""
    codec = Codec(name)
    fragment = {p: v.astype(np.float32) for p, v in FRAGMENT.items()}
    encoded = {
        p: protocol.Encoded(codec.encode(v.reshape(-1)), v.shape) for p, v in fragment.items()
    }
    plans = protocol.split_fragment(fragment, codec, 1000)
    assert [(c.slices, [bytes(p) for p in c.payloads]) for c in plans] == [
        (c.slices, [bytes(p) for p in c.payloads])
        for c in protocol.split_fragment(encoded, codec, 1000)
    ]
    path = sorted(fragment)[0]
    cut = dict(encoded, **{path: protocol.Encoded(encoded[path].data[:-1], fragment[path].shape)})
    with pytest.raises(protocol.EncodeError, match="must be"):
        protocol.split_fragment(cut, codec, 1000)
