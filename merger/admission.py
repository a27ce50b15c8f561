"""Admission: may a reassembled delta be folded?  A pure verdict with a reason, never an exception.

Staleness ``s = version_p - base_version`` counts the folds of fragment p the island has not seen;
a delta with ``s > S`` is rejected (bounded staleness).  A delta must also match the model
(fingerprint, paths, shapes), carry positive counters (its weight divides by steps) and be finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from protocol import CodedTensor


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A complete delta of one fragment, as the merger sees it after reassembly."""

    island: str
    epoch: int
    delta_id: int
    fragment: int
    base_version: int
    steps: int
    tokens: int
    model: str
    tensors: Mapping[str, np.ndarray]  # path -> float32 delta (anchor - theta)


@dataclasses.dataclass(frozen=True)
class Verdict:
    admitted: bool
    reason: str  # "" when admitted; a stable label otherwise (metric key merger/rejected/<label>)
    detail: str
    staleness: int


def admit(candidate: Candidate, *, version: int, layout: Mapping[str, tuple[int, ...]], model: str, max_staleness: int) -> Verdict:
    """Judge `candidate` against fragment state `version` whose tensors have shapes `layout`."""
    staleness = version - candidate.base_version

    def reject(reason: str, detail: str) -> Verdict:
        return Verdict(False, reason, detail, staleness)

    if candidate.model != model:
        return reject("model_mismatch", f"model fingerprint {candidate.model} != {model}")
    if set(candidate.tensors) != set(layout):
        missing, extra = sorted(set(layout) - set(candidate.tensors)), sorted(set(candidate.tensors) - set(layout))
        return reject("layout_mismatch", f"fragment {candidate.fragment}: missing {missing[:3]}, unexpected {extra[:3]}")
    for path, shape in layout.items():
        if tuple(candidate.tensors[path].shape) != tuple(shape):
            return reject("layout_mismatch", f"{path}: shape {candidate.tensors[path].shape} != {tuple(shape)}")
    if staleness < 0:
        return reject("future_base", f"base version {candidate.base_version} is ahead of version {version}")
    if staleness > max_staleness:
        return reject("stale", f"staleness {staleness} > {max_staleness}")
    if candidate.steps < 1 or candidate.tokens < 1:
        return reject("empty", f"steps={candidate.steps}, tokens={candidate.tokens}: nothing was trained")
    for path, delta in candidate.tensors.items():
        if isinstance(delta, CodedTensor):
            continue  # int records: scales were checked finite and bounded when decoded from the wire
        if not np.isfinite(delta).all():
            return reject("non_finite", f"{path} holds NaN or Inf")
    return Verdict(True, "", "", staleness)
