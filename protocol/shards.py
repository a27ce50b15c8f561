"""Merger shards (PROTOCOL.md §13): shard I of N folds the fragments f with f % N == I.  An island
keeps one sequenced stream per shard (the deltas of that shard's fragments), and the topics let
ZeroMQ filter by fragment at the publisher and the broker."""

from __future__ import annotations

from dloco.protocol.errors import ConfigError

# Heartbeat.stream is below this
MAX_SHARDS = 1024
# P, the fragments a model is cut into, where neither side is told (islands and mergers must agree)
DEFAULT_FRAGMENTS = 4


def shard_of(fragment: int, shards: int) -> int:
    """The shard that folds `fragment`: also the island's stream its deltas travel on."""
    return fragment % shards


def owned(shard: int, shards: int, fragments: int) -> list[int]:
    """The fragments shard `shard` of `shards` folds."""
    return list(range(shard, fragments, shards))


def names(base: str, shards: int) -> list[str]:
    """The shards' names (sender ids and key names): `base` for shard 0, `base.I` for the others,
    so one unsharded merger keeps its name."""
    return [base, *(f"{base}.{index}" for index in range(1, shards))]


def parse(text: str) -> tuple[int, int]:
    """`I/N` (--shard) as (I, N); ConfigError naming what is wrong."""
    index, slash, count = text.partition("/")
    if not (slash and index.isdigit() and count.isdigit()):
        raise ConfigError(
            "--shard must be I/N (this shard's index and the number of shards, e.g. 0/2), got"
            f" {text!r}"
        )
    index, count = int(index), int(count)
    if not 1 <= count <= MAX_SHARDS or not 0 <= index < count:
        raise ConfigError(f"--shard {text}: need 1 <= N <= {MAX_SHARDS} and 0 <= I < N")
    return index, count


def shard_name(given: str | None, shard: int, shards: int) -> str:
    """A merger's name as shard `shard`: `given`, checked to be one of `names(base, shards)` at
    `shard` (islands tell the shards apart by it), or by default the `merger` family's."""
    if given is None:
        return names("merger", shards)[shard]
    # one merger: any name (islands have one control endpoint)
    if shards == 1:
        return given
    base = given.rsplit(".", 1)[0] if shard > 0 else given
    if names(base, shards)[shard] != given or (
        shard == 0 and given.rpartition(".")[2].isdigit() and "." in given
    ):
        raise ConfigError(
            f"--name {given} for shard {shard}/{shards}: shard 0 is named BASE and shard I > 0"
            f" BASE.I (islands tell the shards apart by it), e.g. {names('merger', shards)[shard]}"
        )
    return given


def subscriptions(shard: int, shards: int, fragments: int) -> list[bytes]:
    """The delta bus topics shard `shard` subscribes to: its fragments' deltas and its stream's
    heartbeats (the closing "/" keeps delta/1/ from matching delta/10/)."""
    if shards == 1:
        return [b"delta/", b"heartbeat/0/"]
    return [f"delta/{f}/".encode() for f in owned(shard, shards, fragments)] + [
        f"heartbeat/{shard}/".encode()
    ]
