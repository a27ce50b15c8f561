"""The guard's clipping of a fold's parts (merger/fold/outliers.py gives the caps and limits): how
far each island's part of a fold may move the fragment, and the deltas scaled down to it.

A part is an island's deltas of one fold (`fold.per_island`), taken as one: its weight times its
norm is its movement.  A coded delta is scaled by its block scales (it stays coded, so the fold
stays on codes: merger/engines/coded.py), any other in float32.  Pure functions of the deltas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dloco.merger.fold.admission import delta_norm
from dloco.merger.fold.contribution import Contribution
from dloco.merger.fold.outliers import ColdCap
from dloco.protocol import CodedTensor


def clip_factors(
    islands: Sequence[str],
    w: Sequence[float],
    norms: Sequence[float],
    caps: Mapping[str, float | ColdCap],
    allowed: Sequence[float] | None = None,
) -> tuple[list[float], list[str], list[float]]:
    """What each island's part of a fold may move the fragment: its weight times its norm
    (`norms`: `part_norm`), at most `caps[island]` (merger/fold/outliers.py: a multiple of the other
    islands' recent movements).  `allowed`: the norm each part may have before its cap is applied
    (`part_allowed`: each of its deltas counted at most at a limit; None: its norm).  A part past
    either is scaled down to it.  Returns each part's movement as the history records it (after its
    cap, before `allowed`: a limit that cuts an honest island's early deltas must not lower every
    reference after it), the islands clipped, and the factor each part is scaled by (1: whole)."""
    movements, clipped, factors = [], [], []
    for i, (island, weight, norm) in enumerate(zip(islands, w, norms)):
        kept = min(1.0, allowed[i] / norm) if allowed is not None and norm > 0 else 1.0
        movement = weight * norm
        cap = caps.get(island)
        if isinstance(cap, ColdCap):
            # within the lower bound: within the cap, whatever its exact value
            cap = cap.lower if movement <= cap.lower else cap.exact()
        if cap is not None and movement * kept > cap:
            kept *= cap / (movement * kept)
        if cap is not None:
            movement = min(movement, cap)
        if kept < 1.0:
            clipped.append(island)
        movements.append(float(movement))
        factors.append(min(kept, 1.0))
    return movements, clipped, factors


def guard(
    members: Sequence[Contribution],
    w: Sequence[float],
    norms: Sequence[float],
    caps: Mapping[str, float],
    allowed: Sequence[float] | None = None,
) -> tuple[list[Contribution], list[float], list[str], list[float]]:
    """`clip_factors` over one delta per island: (the members, each scaled by its factor; the
    movements; the islands clipped; the factors)."""
    movements, clipped, factors = clip_factors([m.island for m in members], w, norms, caps, allowed)
    return [scaled(m, f) for m, f in zip(members, factors)], movements, clipped, factors


def guarded(
    groups: Sequence[Sequence[Contribution]],
    w: Sequence[float],
    caps: Mapping[str, float],
    limits: Mapping[str, float] | None,
) -> tuple[list[list[Contribution]], list[float], list[str], list[float]]:
    """`clip_factors` over a fold's parts (`groups`: each island's deltas), each cold island's
    deltas counted at most at its limit (`limits`); every delta of a clipped part scaled by its
    factor.  Returns the parts as `guard` returns the members."""
    allowed = (
        [part_allowed(group, limits.get(group[0].island)) for group in groups] if limits else None
    )
    movements, clipped, factors = clip_factors(
        [group[0].island for group in groups], w, [part_norm(g) for g in groups], caps, allowed
    )
    parts = [[scaled(c, f) for c in group] for group, f in zip(groups, factors)]
    return parts, movements, clipped, factors


def scaled(contribution: Contribution, factor: float) -> Contribution:
    """`contribution` times `factor` (as it is when `factor` is 1)."""
    if factor >= 1.0:
        return contribution
    scale = np.float32(factor)
    return dataclasses.replace(
        contribution,
        tensors={p: _scaled(t, scale) for p, t in contribution.tensors.items()},
    )


def _scaled(tensor, scale: np.float32):
    """`tensor` times `scale`: a dense coded tensor's block scales scaled (its codes kept), any
    other decoded and scaled in float32."""
    if isinstance(tensor, CodedTensor) and not tensor.codec.sparse:
        return tensor.scaled(scale)
    return (tensor.decode() if isinstance(tensor, CodedTensor) else tensor) * scale


def part_norm(group: Sequence[Contribution]) -> float:
    """An island's deltas of one fold, as the guard measures them: the sum of their norms as
    admission measured each (an int-coded delta's bound from its scales, no pass over its values);
    at least the norm of their sum."""
    return sum(delta_norm(c.tensors) for c in group)


def part_allowed(group: Sequence[Contribution], limit: float | None) -> float:
    """The norm an island's part may keep when each of its deltas counts at most `limit`
    (merger/fold/outliers.py `delta_limits`: an island without a movement reference yet); None: no
    limit, its `part_norm`.  A burst of large deltas keeps `limit` per delta, honest deltas below it
    all of theirs."""
    norms = [delta_norm(c.tensors) for c in group]
    return sum(norms) if limit is None else sum(min(n, limit) for n in norms)
