"""Admission: may a reassembled delta be folded?  A pure verdict with a reason, never an exception.

Staleness ``s = version_p - base_version`` counts the folds of fragment p the island has not seen;
a delta with ``s > S`` is rejected (bounded staleness).  A delta must also match the model
(fingerprint, paths, shapes), carry positive counters (its weight divides by steps) and be finite,
its norm too: a norm past sqrt(float32 max) would overflow the fold's float32 arithmetic.  Given a
limit (merger/fold/outliers.py: a multiple of recent norms), a delta whose norm is past it is an
outlier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dloco.protocol import CodedTensor


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
    # path -> float32 delta (anchor - theta)
    tensors: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Verdict:
    admitted: bool
    # "" when admitted; a stable label otherwise (metric key merger/rejected/<label>)
    reason: str
    detail: str
    staleness: int
    # the delta's Euclidean norm (float64), once the checks got that far
    norm: float = 0.0


# ~1.8e19: squares of larger values overflow float32
FLOAT32_SAFE_NORM = float(np.sqrt(np.finfo(np.float32).max))


def delta_norm(tensors: Mapping[str, np.ndarray | CodedTensor]) -> float:
    """The Euclidean norm of a delta's values, in float64; for coded tensors an upper bound from
    their scales (CodedTensor.squared_norm_bound: about 3x the norm for Gaussian-like deltas, well
    inside the outlier factor, and without a pass over every value on the merger's receive path)."""
    total = 0.0
    for tensor in tensors.values():
        if isinstance(tensor, CodedTensor):
            total += tensor.squared_norm_bound()
        else:
            flat = np.asarray(tensor).reshape(-1)
            total += float(np.dot(flat.astype(np.float64), flat.astype(np.float64)))
    return float(np.sqrt(total))


def admit(
    candidate: Candidate,
    *,
    version: int,
    layout: Mapping[str, tuple[int, ...]],
    model: str,
    max_staleness: int,
    norm_limit: float | None = None,
) -> Verdict:
    """Judge `candidate` against fragment state `version` whose tensors have shapes `layout`, and
    its norm against `norm_limit` (None: not judged)."""
    staleness = version - candidate.base_version

    def reject(reason: str, detail: str) -> Verdict:
        return Verdict(False, reason, detail, staleness)

    if candidate.model != model:
        return reject("model_mismatch", f"model fingerprint {candidate.model} != {model}")
    if (mismatch := _layout_mismatch(candidate, layout)) is not None:
        return reject("layout_mismatch", mismatch)
    if staleness < 0:
        return reject(
            "future_base", f"base version {candidate.base_version} is ahead of version {version}"
        )
    if staleness > max_staleness:
        return reject("stale", f"staleness {staleness} > {max_staleness}")
    if candidate.steps < 1 or candidate.tokens < 1:
        return reject(
            "empty", f"steps={candidate.steps}, tokens={candidate.tokens}: nothing was trained"
        )
    for path, delta in candidate.tensors.items():
        if isinstance(delta, CodedTensor):
            # int records: scales were checked finite and bounded when decoded from the wire
            continue
        if not np.isfinite(delta).all():
            return reject("non_finite", f"{path} holds NaN or Inf")
    norm = delta_norm(candidate.tensors)
    if not np.isfinite(norm) or norm >= FLOAT32_SAFE_NORM:
        return Verdict(
            False, "non_finite", f"norm {norm:.4g} overflows float32 arithmetic", staleness, norm
        )
    if norm_limit is not None and norm > norm_limit:
        return Verdict(
            False,
            "outlier_norm",
            f"norm {norm:.4g} > limit {norm_limit:.4g} (outlier_factor x recent norms)",
            staleness,
            norm,
        )
    return Verdict(True, "", "", staleness, norm)


def _layout_mismatch(candidate: Candidate, layout: Mapping[str, tuple[int, ...]]) -> str | None:
    """How the delta's tensors differ from the fragment's `layout` (paths, then shapes); None: they
    do not."""
    if set(candidate.tensors) != set(layout):
        missing, extra = (
            sorted(set(layout) - set(candidate.tensors)),
            sorted(set(candidate.tensors) - set(layout)),
        )
        return f"fragment {candidate.fragment}: missing {missing[:3]}, unexpected {extra[:3]}"
    for path, shape in layout.items():
        if tuple(candidate.tensors[path].shape) != tuple(shape):
            return f"{path}: shape {candidate.tensors[path].shape} != {tuple(shape)}"
    return None
