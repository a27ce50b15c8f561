"""PROTOCOL.md where a second implementation, written from it alone, once differed from the
reference (D1-D7), each with the text and the code checked to agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from dloco import protocol
from dloco.merger.log import records
from dloco.merger.replication.wire import FIELDS
from dloco.protocol import downlink, shards
from dloco.protocol.sparse import SPARSE_BITS

ROOT = Path(__file__).resolve().parent.parent
SPEC = (ROOT / "PROTOCOL.md").read_text(encoding="utf-8")


def test_d1_a_kept_negative_zero_carries_the_sign_bit_and_decodes_to_minus_scale():
    # k = 4 values kept per block
    codec = protocol.Codec("topk2", 128)
    x = np.zeros(128, np.float32)
    x[3] = 4.0
    # a tie among zeros goes to the higher index: kept
    x[127] = -0.0
    decoded = np.empty(128, np.float32)
    codec.decode(codec.encode(x), 128, out=decoded)
    # scale a / M = 4 / 2; m = 1, sign bit set
    assert decoded[3] == 4.0 and decoded[127] == -2.0
    # kept +0.0: +scale
    assert decoded[126] == 2.0 and decoded[125] == 2.0
    assert "1 for a negative value, and for −0.0" in SPEC
    assert "a kept −0.0 to `−scale`" in SPEC
    assert set(SPARSE_BITS) == {"topk2", "topk4"}


def test_d2_a_full_snapshot_whose_digest_differs_is_not_used_and_is_asked_for_again():
    value = {"w": np.arange(4, dtype=np.float32)}
    held = downlink.Served(
        3, {"w": np.zeros(4, np.float32)}, downlink.digest({"w": np.zeros(4, np.float32)})
    )
    kept, outcome = downlink.receive(held, 5, None, downlink.digest(value) ^ 1, value)
    assert (outcome, kept) == ("mismatch", held)
    _, outcome = downlink.receive(held, 5, None, downlink.digest(value), value)
    assert outcome == "full"
    assert "checks it over the decoded value" in SPEC


def _constructed(folder: str) -> set[str]:
    """Message classes whose constructor a package calls (protocol.X(...) or X(...))."""
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_d3_islands_send_heartbeats_and_answer_resends_the_merger_does_neither():
    island, merger = _constructed("island"), _constructed("merger")
    assert "Heartbeat" in island and "ResendRequest" not in island
    assert "ResendRequest" in merger and "Heartbeat" not in merger
    # optional, and the reference processes send none
    assert "Hello" not in island | merger
    for line in (
        "the merger sends none",
        "islands never send one, and a merger ignores one sent to it",
        (
            "The merger keeps no retransmit buffer, sends no heartbeat and ignores a\n  `resend`"
            " addressed to it"
        ),
    ):
        assert line in SPEC, line


def test_d4_a_chunk_refused_at_check_5_evicts_nothing():
    """The budget makes room only for a chunk that passed every check: an overlapping chunk of a new
    message, which would need another message evicted, leaves that message alone."""
    plan = protocol.split_fragment({"w": np.ones(64, np.float32)}, protocol.Codec("fp32"))[0]
    model = protocol.model_fingerprint({"w": np.ones(64, np.float32)})

    def chunk(delta_id, slices, payloads, count=2):
        return protocol.DeltaChunk(
            sender="a",
            epoch=1,
            seq=delta_id,
            delta_id=delta_id,
            fragment=0,
            base_version=0,
            chunk_index=0,
            chunk_count=count,
            steps=1,
            tokens=1,
            model=model,
            codec=protocol.Codec("fp32"),
            slices=slices,
            payloads=payloads,
        )

    half = protocol.TensorSlice("w", "float32", (64,), 0, 32, 0)
    first = chunk(1, (half,), (np.ones(32, np.float32),))
    cost = 32 * 4 + 4096 + 1024
    reassembler = protocol.Reassembler(max_bytes=cost + cost // 2, decode=False)
    assert reassembler.add(first, 0.0) is None and reassembler.held_bytes == cost
    overlapping = chunk(2, (half, half), (np.ones(32, np.float32), np.ones(32, np.float32)))
    with pytest.raises(protocol.ProtocolError) as refused:
        reassembler.add(overlapping, 0.0)
    # message 1 is still held
    assert refused.value.reason == "inconsistent" and reassembler.held_bytes == cost
    whole = chunk(3, plan.slices, plan.payloads, count=1)
    # a good chunk does make room: message 1 evicted
    assert reassembler.add(whole, 0.0) is not None
    assert reassembler.held_bytes == 0 and reassembler.stats.evicted_memory == 1
    assert "Only a chunk that passes all five is charged" in SPEC


def test_d5_shards_of_a_merger_named_x_are_x_and_x_dot_i():
    assert shards.names("X", 3) == ["X", "X.1", "X.2"]
    assert [shards.shard_name("X" if i == 0 else f"X.{i}", i, 3) for i in range(3)] == [
        "X",
        "X.1",
        "X.2",
    ]
    assert "`X` for shard 0, `X.I` for shard I > 0" in SPEC


def test_d6_the_replication_stream_is_given_field_by_field():
    section = SPEC[SPEC.index("## 12.") : SPEC.index("## 13.")]
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| (.*?) \|[^|]*\|$", section, re.M)
    }
    for kind, fields in FIELDS.items():
        listed = set(re.findall(r"`(\w+)` \(", rows[kind.decode()]))
        assert listed == set(fields), (kind, listed, set(fields))
    for record_type in (
        records.GENESIS,
        records.DELTA,
        records.FOLD,
        records.CURSORS,
        records.TERM,
    ):
        assert f"| `{record_type}` |" in section, record_type
    assert "64 lower-case hex digits" in section and "`lease_s` (seconds)" in section
    assert "seconds an int or float ≥ 0 and finite" in section


@pytest.mark.parametrize(
    "message",
    [
        protocol.Heartbeat(sender="a b", epoch=1, seq=1),
        protocol.ResendRequest(
            sender="merger", epoch=1, seq=1, target="a", target_epoch=1, ranges=((0, 1),)
        ),
        protocol.Heartbeat(sender="a", epoch=1, seq=1, stream=1024),
        protocol.Ack(sender="m", epoch=1, seq=1, cursors=(), results=(), tokens=-1),
    ],
    ids=["sender-with-space", "resend-range-from-0", "heartbeat-stream-1024", "negative-tokens"],
)
def test_d7_the_encoder_refuses_what_its_decoder_would(message):
    with pytest.raises(protocol.EncodeError, match="refused by its receivers"):
        protocol.encode(message)
