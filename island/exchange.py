"""The pure math of exchanging fragments: partition, schedule, pseudo-gradient, adoption.  Values
in, values out.

Schedule (staggered, Streaming DiLoCo): counting inner steps from 1, fragment p is due after step
t when ``t mod H == ((p + 1) * H // P) mod H``.  Each fragment is due every H steps and one falls
due about every H/P steps (P = 4, H = 50: fragments 0..3 at steps 12, 25, 37, 50, then 62, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dloco import protocol

# How the island holds a fragment's progress at its last send (`Anchor.offset`): int8 in blocks of
# 256, 1.02 bytes per parameter against a float32 copy's 4.  Its rounding is not lost (`advance`).
HELD_CODEC = protocol.Codec("int8", 256)


def residual_codec(codec: protocol.Codec) -> protocol.Codec:
    """How error feedback's residuals of deltas sent with `codec` are held: int8 in the wire's
    blocks (a residual is at most half a step of its block), but bf16 for a sparse codec, which
    leaves most of each block in the residual, round after round."""
    return protocol.Codec("bf16") if codec.sparse else protocol.Codec("int8", codec.block)


def held(value: np.ndarray, codec: protocol.Codec = HELD_CODEC) -> np.ndarray:
    """`value` encoded with `codec` (flat bytes)."""
    return codec.encode(np.asarray(value, np.float32).reshape(-1))


def unheld(
    encoded: np.ndarray, shape: tuple[int, ...], codec: protocol.Codec = HELD_CODEC
) -> np.ndarray:
    """The float32 value of `held` bytes, in `shape`."""
    return codec.decode(encoded, int(np.prod(shape, dtype=np.int64))).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Anchor:
    """What a fragment's next delta is taken against: the global value last adopted (`base`: the
    very arrays the downlink holds, no copy) plus, once the island has sent since, its progress at
    that send (`offset`, path -> `held` bytes).  So an anchor costs the island 1 byte per parameter
    beyond the global value, not a float32 copy of theta."""

    base: Mapping[str, np.ndarray]
    offset: Mapping[str, np.ndarray] | None = None

    @classmethod
    def adopted(cls, tensors: Mapping[str, np.ndarray]) -> Anchor:
        """The anchor of a fragment just adopted: its global value, the arrays themselves (float32,
        or bfloat16 when the merger serves it so: read as float32 a tensor at a time)."""
        return cls(dict(tensors))

    def value(self, path: str) -> np.ndarray:
        base = np.asarray(self.base[path], np.float32)
        if self.offset is None:
            return base
        return base + unheld(self.offset[path], base.shape)

    def values(self) -> dict[str, np.ndarray]:
        return {path: self.value(path) for path in self.base}

    def __iter__(self):
        return iter(self.base)


def advance(
    anchor: Anchor, theta: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], Anchor]:
    """A send: the delta, and the anchor the next delta counts from.  The new anchor is theta as
    the island can hold it (base + the held progress since base), and the delta is the old anchor
    minus the new one, not minus theta: what holding rounds off is in the next delta instead, so the
    deltas sent add up to the change since the base, float32 rounding aside (pseudo_gradient
    would lose it)."""
    delta, offset = {}, {}
    for path in anchor.base:
        base = np.asarray(anchor.base[path], np.float32)
        offset[path] = held(np.asarray(theta[path], np.float32) - base)
        delta[path] = anchor.value(path) - (base + unheld(offset[path], base.shape))
    return delta, Anchor(anchor.base, offset)


def partition(shapes: Mapping[str, tuple[int, ...]], fragments: int) -> list[list[str]]:
    """Same function the merger uses (protocol.partition): balanced by bytes, structure only."""
    return protocol.partition(shapes, fragments)


def due_offset(fragment: int, fragments: int, interval: int) -> int:
    """The step residue (mod H) at which `fragment` is due; distinct for every fragment when H >=
    P."""
    return ((fragment + 1) * interval // fragments) % interval


def due_fragments(step: int, fragments: int, interval: int) -> list[int]:
    """Fragments due after inner step `step` (counted from 1)."""
    return [p for p in range(fragments) if step % interval == due_offset(p, fragments, interval)]


def pseudo_gradient(
    anchor: Mapping[str, np.ndarray], theta: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """delta_p = anchor_p - theta_p, in float32."""
    return {
        path: np.asarray(anchor[path], np.float32) - np.asarray(theta[path], np.float32)
        for path in anchor
    }


def rebase(
    theta: Mapping[str, np.ndarray],
    anchor: Mapping[str, np.ndarray],
    snapshot: Mapping[str, np.ndarray],
    residual: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """theta_p <- Theta_p + (theta_p - anchor_p) - r_p: a newer global value with the island's own
    progress since its anchor (its last send or adoption) kept on top, so that the next delta, taken
    against Theta, still carries all of it; and with error feedback the part of earlier deltas the
    codec has not delivered yet (the residual r, in delta units: anchor - theta), which the next
    delta then carries too instead of the island losing it until it arrives."""
    residual = residual or {}
    out = {}
    for path in snapshot:
        value = np.asarray(snapshot[path], np.float32) + (
            np.asarray(theta[path], np.float32) - np.asarray(anchor[path], np.float32)
        )
        out[path] = (
            value - np.asarray(residual[path], np.float32).reshape(value.shape)
            if path in residual
            else value
        )
    return out


def adopt(
    theta: Mapping[str, np.ndarray], snapshot: Mapping[str, np.ndarray], alpha: float
) -> dict[str, np.ndarray]:
    """theta_p <- alpha * theta_p + (1 - alpha) * Theta_p (alpha 0: take the global value)."""
    if alpha == 0:
        return {path: np.asarray(snapshot[path], np.float32).copy() for path in snapshot}
    return {
        path: (
            (
                alpha * np.asarray(theta[path], np.float32)
                + (1 - alpha) * np.asarray(snapshot[path], np.float32)
            ).astype(np.float32)
        )
        for path in snapshot
    }


def fold_wait_over(
    sent: Mapping[int, int],
    versions: Mapping[int, int],
    unfolded_before: Mapping[int, int],
    unfolded_now: Mapping[int, int],
) -> bool:
    """A blocking island's wait is over when every fragment it just sent (fragment -> the version
    the delta was based on) is back in a newer version, or had a delta settled without a fold
    since the send (rejected, or given up on)."""
    return all(
        versions[f] > v or unfolded_now.get(f, 0) > unfolded_before.get(f, 0)
        for f, v in sent.items()
    )
