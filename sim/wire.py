"""Bytes on the wire in the simulator: a fragment's values in a codec, chunked and framed, and the
model cut into fragments; per fragment, what a delta, a published snapshot, a joining island's
download and a rejoining island's weigh.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from dloco.island.config import SyncConfig
from dloco.protocol import Codec
from dloco.sim.scenario import Scenario

# msgpack header and frame overhead per chunk (measured: protocol.encode of a delta chunk)
CHUNK_HEADER_BYTES = 300
# payload bytes per chunk
CHUNK_BYTES = SyncConfig.chunk_bytes


def wire_bytes(values: int, codec: Codec) -> int:
    """Bytes on the wire of `values` values in `codec`, chunked."""
    payload = codec.encoded_nbytes(values)
    return payload + CHUNK_HEADER_BYTES * max(1, math.ceil(payload / CHUNK_BYTES))


def fragment_sizes(params: int, fragments: int) -> list[int]:
    """Values per fragment: the model cut into P nearly equal parts (protocol.partition balances by
    bytes)."""
    return [params // fragments + (1 if p < params % fragments else 0) for p in range(fragments)]


class WireSizes(NamedTuple):
    """Per fragment, bytes on the wire."""

    # a delta, in the scenario's codec
    delta: list[int]
    # a published snapshot (a diff, or the whole fragment)
    snapshot: list[int]
    # the whole fragment in the snapshot codec: a joining island's first download
    full: list[int]
    # what a rejoining island downloads
    rejoin: list[int]


def wire_sizes(scenario: Scenario) -> WireSizes:
    """What each message of each fragment weighs: measured (`scenario.wire`, from calibration) or
    from the codecs."""
    sizes = fragment_sizes(scenario.params, scenario.fragments)
    snapshots = scenario.snapshots
    if scenario.wire is not None:
        delta, snapshot, full = (list(column) for column in zip(*scenario.wire))
    else:
        codec = Codec(scenario.codec, scenario.block)
        delta = [wire_bytes(n, codec) for n in sizes]
        full = [wire_bytes(n, Codec(snapshots.snapshot_codec, scenario.block)) for n in sizes]
        diff = snapshots.snapshot_diff_codec
        snapshot = (
            full if diff == "none" else [wire_bytes(n, Codec(diff, scenario.block)) for n in sizes]
        )
    # a rejoining island gets the served value exactly: fp32 once diffs have moved it off the full
    # codec (downlink.reply)
    fp32 = [wire_bytes(n, Codec("fp32")) for n in sizes]
    rejoin = full if snapshots.snapshot_diff_codec == "none" else fp32
    return WireSizes(delta, snapshot, full, rejoin)
