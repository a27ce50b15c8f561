"""Property-based fuzzing of `decode`: whatever the frames, the only exception is ProtocolError.

Over 10,000 cases in the default run: random frame lists, byte-level mutations of valid messages,
and structured mutations of valid headers (a field replaced by an arbitrary msgpack value,
dropped, or added), across every message kind.
"""

from __future__ import annotations

import os

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dloco.protocol import ProtocolError, decode, encode
from tests.conftest import one_of_each_kind

VALID = [[bytes(f) for f in encode(m)] for m in one_of_each_kind()]


def fuzz(examples: int) -> settings:
    """Settings for `examples` cases, times DLOCO_FUZZ_SCALE (default 1) for longer hunts."""
    return settings(
        max_examples=examples * int(os.environ.get("DLOCO_FUZZ_SCALE", "1")),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def decode_or_protocol_error(frames) -> None:
    try:
        decode(frames)
    except ProtocolError as error:
        assert error.reason and str(error)


@fuzz(2500)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_frames(frames):
    decode_or_protocol_error(frames)


@fuzz(3000)
@given(
    st.sampled_from(range(len(VALID))),
    st.integers(0, 1 << 30),
    st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_byte_flips_in_header_and_payload(which, frame_pick, flips):
    frames = list(VALID[which])
    index = 1 + frame_pick % (len(frames) - 1)
    data = bytearray(frames[index])
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    frames[index] = bytes(data)
    decode_or_protocol_error(frames)


@fuzz(1500)
@given(
    st.sampled_from(range(len(VALID))),
    st.integers(0, 1 << 30),
    st.integers(0, 3),
    st.binary(max_size=16),
)
def test_truncated_dropped_or_extra_frames(which, pick, action, extra):
    frames = list(VALID[which])
    index = pick % len(frames)
    if action == 0:
        frames[index] = frames[index][: pick % (len(frames[index]) + 1)]
    elif action == 1:
        del frames[index]
    elif action == 2:
        frames.insert(index, extra)
    else:
        frames.append(frames[index])
    decode_or_protocol_error(frames)


def _mutate(header, path, value, action):
    """Replace, drop or add the field named by `path` (a list of keys/indices) inside the header."""
    node = header
    for step in path[:-1]:
        node = node[step]
    last = path[-1]
    if action == "drop" and isinstance(node, dict):
        node.pop(last, None)
    elif action == "add" and isinstance(node, dict):
        node[f"{last}_x"] = value
    else:
        node[last] = value


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for key, child in node.items():
            yield (*prefix, key)
            yield from _paths(child, (*prefix, key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield (*prefix, index)
            yield from _paths(child, (*prefix, index))


@fuzz(4000)
@given(
    st.sampled_from(range(len(VALID))),
    st.integers(0, 1 << 30),
    msgpack_values,
    st.sampled_from(["replace", "drop", "add"]),
)
def test_structured_header_mutations(which, pick, value, action):
    frames = list(VALID[which])
    header = msgpack.unpackb(frames[1])
    paths = list(_paths(header))
    _mutate(header, paths[pick % len(paths)], value, action)
    try:
        frames[1] = msgpack.packb(header)
    except (OverflowError, ValueError, TypeError):
        return
    decode_or_protocol_error(frames)
