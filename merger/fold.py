"""Fold: admitted deltas of one round -> merged pseudo-gradient -> outer step -> version + 1.

``FragmentState`` is a named pytree replaced, never mutated.  Contributions are put in a canonical
order (island, epoch, delta_id) first, so a round's result does not depend on arrival order and a
replay of the same log reproduces the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from merger import rda
from merger.config import MergeConfig
from merger.weighting import weights as contribution_weights


class FragmentState(NamedTuple):
    version: int
    params: dict[str, np.ndarray]  # path -> float32 global value of the fragment
    opt_state: Any  # the outer optimizer's state for these params


@dataclasses.dataclass(frozen=True)
class Contribution:
    island: str
    epoch: int
    delta_id: int
    staleness: int
    tokens: int
    steps: int
    tensors: Mapping[str, np.ndarray]  # path -> float32 delta


@dataclasses.dataclass(frozen=True)
class FoldReport:
    """What one fold did: one structured log line."""

    version: int
    contributors: tuple[str, ...]
    delta_ids: tuple[int, ...]
    staleness: tuple[int, ...]
    weights: tuple[float, ...]
    delta_norms: tuple[float, ...]
    merged_norm: float


def canonical(contributions: Sequence[Contribution]) -> list[Contribution]:
    return sorted(contributions, key=lambda c: (c.island, c.epoch, c.delta_id))


def merge(contributions: Sequence[Contribution], config: MergeConfig) -> tuple[dict[str, np.ndarray], list[float]]:
    """The merged pseudo-gradient of a round and the normalised weights used (canonical order)."""
    ordered = canonical(contributions)
    w = contribution_weights([(c.tokens, c.steps, c.staleness) for c in ordered], config.staleness_power)
    merged = {}
    for path in ordered[0].tensors:
        deltas = [c.tensors[path] for c in ordered]
        plain = config.method == "average" or any(marker in path for marker in config.average_paths)
        merged[path] = (rda.weighted_average if plain else rda.radial_directional_average)(deltas, w)
    return merged, w


def fold(state: FragmentState, contributions: Sequence[Contribution], config: MergeConfig,
         step: Callable[[Any, Any, Any], tuple[Any, Any]]) -> tuple[FragmentState, FoldReport]:
    """Apply one round; `step` is `outer.make_step(optimizer)`."""
    if not contributions:
        raise ValueError("fold needs at least one contribution")
    ordered = canonical(contributions)
    merged, w = merge(ordered, config)
    params, opt_state = step(state.params, state.opt_state, merged)
    new_params = {path: np.asarray(value, dtype=np.float32) for path, value in params.items()}
    report = FoldReport(
        version=state.version + 1,
        contributors=tuple(c.island for c in ordered),
        delta_ids=tuple(c.delta_id for c in ordered),
        staleness=tuple(c.staleness for c in ordered),
        weights=tuple(w),
        delta_norms=tuple(rda.fragment_norm(c.tensors) for c in ordered),
        merged_norm=rda.fragment_norm(merged),
    )
    return FragmentState(state.version + 1, new_params, opt_state), report


def init_state(params: Mapping[str, np.ndarray], optimizer) -> FragmentState:
    """Version 0 of a fragment; the optimizer state is built over the params as a path-ordered list
    (the layout `outer.make_step` uses)."""
    params = {path: np.asarray(value, dtype=np.float32) for path, value in params.items()}
    return FragmentState(0, params, optimizer.init([params[p] for p in sorted(params)]))
