"""Fold: admitted deltas of one round -> merged pseudo-gradient -> outer step -> version + 1.

``FragmentState`` is a named pytree replaced, never mutated.  Contributions are put in a canonical
order (island, epoch, delta_id) first, so a round's result does not depend on arrival order and a
replay of the same log reproduces the same bytes.

Several deltas of one island (one epoch) in a round are consecutive, disjoint pieces of one
trajectory (an island's anchor moves on every send), so they are summed into one before weighting:
a merger that fell behind and folds a backlog keeps all of each island's work, as if the island had
sent one delta over the longer span, instead of averaging the pieces (which would keep ~1/n of it).
Dense-coded deltas are merged as their sum straight from their codes (merger/engines/coded.py
`dense`); any others are summed in float32 (`combined`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dloco.merger.config import MergeConfig
from dloco.merger.engines import coded, fused
from dloco.merger.engines.sparse_xla import outer_step
from dloco.merger.fold import rda
from dloco.merger.fold.admission import delta_norm
from dloco.merger.fold.clipping import guarded
from dloco.merger.fold.contribution import Contribution
from dloco.merger.fold.outer import fused_terms, make_step
from dloco.merger.fold.weighting import weights as contribution_weights
from dloco.protocol import CodedTensor
from dloco.protocol.errors import DlocoError


class ReplayError(DlocoError):
    """The log does not describe a consistent history (a fold names an unknown delta, versions
    skip)."""


class FragmentState(NamedTuple):
    version: int
    # path -> float32 global value of the fragment (np.asarray for numpy)
    params: dict[str, np.ndarray | jax.Array]
    # the outer optimizer's state for these params
    opt_state: Any


class PendingStep(NamedTuple):
    """A fold computed up to its outer step (`fold(..., in_place=True)`).  `take(state)` takes that
    step on the installed `state`, donating its parameters and optimizer state (the new ones are
    written over them), and returns (params, optimizer state): between the two, only the merged
    direction (`direction`, the arrays the step reads) is held beside the state, not a second copy
    of it.  `state` must be the one the fold was computed from (version - 1).  A fold that took
    its step in the merge's pass (merger/engines/fused.py) holds no direction: `take` returns the
    new state it computed, in buffers of its own."""

    version: int
    direction: list
    take: Callable[[FragmentState], tuple[dict, Any]]


@dataclasses.dataclass(frozen=True)
class FoldReport:
    """What one fold did: one structured log line."""

    version: int
    contributors: tuple[str, ...]
    delta_ids: tuple[int, ...]
    staleness: tuple[int, ...]
    # inner steps of work each delta carries
    steps: tuple[int, ...]
    # they sum to the fold's share of a round (1 unless merge.share_window is set)
    weights: tuple[float, ...]
    delta_norms: tuple[float, ...]
    merged_norm: float
    # per island (its deltas of the fold taken as one): how far its part moved the fragment, its
    # weight times its delta's norm, after the guard (`guard`); and the islands whose part was
    # clipped
    movements: tuple[tuple[str, float], ...] = ()
    clipped: tuple[str, ...] = ()


def canonical(contributions: Sequence[Contribution]) -> list[Contribution]:
    return sorted(contributions, key=lambda c: (c.island, c.epoch, c.delta_id))


def per_island(ordered: Sequence[Contribution]) -> list[list[Contribution]]:
    """Canonically ordered contributions grouped by (island, epoch), in that order."""
    groups: list[list[Contribution]] = []
    for c in ordered:
        if groups and (groups[-1][0].island, groups[-1][0].epoch) == (c.island, c.epoch):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def counters(group: Sequence[Contribution]) -> tuple[int, int, int]:
    """(tokens, steps, staleness) of one island's deltas taken as one (see `combined`)."""
    return (
        sum(c.tokens for c in group),
        sum(c.steps for c in group),
        max(c.staleness for c in group),
    )


def combined(group: Sequence[Contribution]) -> Contribution:
    """One island's deltas of a round as one: their float32 sum (in canonical order), their tokens
    and steps added up, and the staleness of the oldest (the largest).  A single delta is returned
    as it is (coded tensors stay coded)."""
    if len(group) == 1:
        return group[0]
    tensors = {}
    for path in group[0].tensors:
        total = np.array(_float(group[0].tensors[path]), dtype=np.float32, copy=True)
        for c in group[1:]:
            total += _float(c.tensors[path])
        tensors[path] = total
    tokens, steps, staleness = counters(group)
    return Contribution(
        group[0].island, group[0].epoch, group[0].delta_id, staleness, tokens, steps, tensors
    )


def split_weight(group: Sequence[Contribution], weight: float) -> list[float]:
    """A combined delta's weight shared among its pieces by tokens (evenly without tokens): what the
    fold report gives each delta; the pieces' weights add up to the combined one's."""
    tokens = sum(c.tokens for c in group)
    return [weight * (c.tokens / tokens if tokens > 0 else 1.0 / len(group)) for c in group]


def plain(path: str, config: MergeConfig) -> bool:
    """Whether `path` is merged by plain weighted average (else RDA)."""
    return config.method == "average" or any(marker in path for marker in config.average_paths)


def merge(
    contributions: Sequence[Contribution], config: MergeConfig, share: float = 1.0
) -> tuple[dict[str, np.ndarray], list[float]]:
    """The merged pseudo-gradient of a round, scaled by `share`, and the weights used (canonical
    order, one per island: see `combined`; normalised to sum to `share`).  Float tensors; coded
    ones (CodedTensor) are decoded first (`fold` merges them from codes)."""
    groups = per_island(canonical(contributions))
    w = fold_weights(groups, config, share)
    return _merged([combined(group) for group in groups], w, config), w


def fold_weights(
    groups: Sequence[Sequence[Contribution]], config: MergeConfig, share: float
) -> list[float]:
    """Each island's weight in a fold (`groups`: its deltas, their counters taken together),
    normalised to sum to `share`."""
    return [
        x * share
        for x in contribution_weights(
            [counters(group) for group in groups],
            config.staleness_power,
            config.max_weight_ratio,
        )
    ]


def _merged(
    members: Sequence[Contribution], w: Sequence[float], config: MergeConfig
) -> dict[str, np.ndarray]:
    merged = {}
    for path in members[0].tensors:
        deltas = [_float(c.tensors[path]) for c in members]
        merged[path] = (
            rda.weighted_average if plain(path, config) else rda.radial_directional_average
        )(deltas, w)
    return merged


def _float(tensor) -> np.ndarray:
    return tensor.decode() if isinstance(tensor, CodedTensor) else tensor


def fold(
    state: FragmentState,
    contributions: Sequence[Contribution],
    config: MergeConfig,
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    share: float = 1.0,
    caps: Mapping[str, float] | None = None,
    limits: Mapping[str, float] | None = None,
    in_place: bool = False,
    scratch: coded.Scratch | None = None,
) -> tuple[FragmentState | PendingStep, FoldReport]:
    """Apply one round; `step` is `outer.make_step(optimizer)`; the merged delta is scaled by
    `share` (weighting.fold_share: 1 unless the merger scales folds by their share of a round);
    `caps`: island -> the most its part may move the fragment (`guard`; None: no guard); `limits`:
    island -> the norm each of its deltas counts with at most (`part_allowed`).  A round
    whose deltas are all coded with one int codec is merged from the codes, its outer step taken
    there (merger/engines/coded.py); any other is merged from float32.  `in_place`: return the outer
    step as a `PendingStep`, to be taken on `state` when it is installed (`MergerCore.install`);
    `scratch`: the memory a merge from dense codes reuses (coded.Scratch)."""
    if not contributions:
        raise ValueError("fold needs at least one contribution")
    ordered = canonical(contributions)
    groups = per_island(ordered)
    w = fold_weights(groups, config, share)
    parts, movements, clipped, factors = groups, [], [], [1.0] * len(groups)
    if caps is not None:
        parts, movements, clipped, factors = guarded(groups, w, caps, limits)
    take, direction, delta_norms, merged_norm = _stepped(
        state, parts, w, config, step, share, scratch
    )
    # as sent: a clipped delta's norm before the guard scaled it (scaled to nothing: the bound
    # admission measured)
    delta_norms = [
        n / f if f > 0 else delta_norm(c.tensors)
        for n, f, c in zip(
            delta_norms, [f for group, f in zip(groups, factors) for _ in group], ordered
        )
    ]
    # one entry per delta (an island's combined deltas share its weight: split_weight)
    report = FoldReport(
        version=state.version + 1,
        contributors=tuple(c.island for c in ordered),
        delta_ids=tuple(c.delta_id for c in ordered),
        staleness=tuple(c.staleness for c in ordered),
        steps=tuple(c.steps for c in ordered),
        weights=tuple(x for group, weight in zip(groups, w) for x in split_weight(group, weight)),
        delta_norms=tuple(delta_norms),
        merged_norm=merged_norm,
        movements=tuple((group[0].island, m) for group, m in zip(groups, movements)),
        clipped=tuple(clipped),
    )
    if in_place:
        return PendingStep(report.version, direction, lambda current: take(current, True)), report
    # XLA arrays: the next fold starts from them without a copy (np.asarray views them)
    params, opt_state = take(state, False)
    return FragmentState(report.version, dict(params), opt_state), report


def _stepped(state, parts, w, config, step, share, scratch):
    """A fold's merged direction over its parts (each island's deltas, after the guard), from their
    codes when every tensor is coded with one int codec (an island's several sparse deltas are
    summed in float32 first), else from float32: (`take(state, in_place)`, which takes the outer
    step on `state` and returns (params, optimizer state), the direction's arrays, each delta's
    norm, the merged norm).  Dense int codes under Nesterov momentum take the step from `state`
    here, in the merge's pass (merger/engines/fused.py): `take` returns that new state."""
    deltas = [c for group in parts for c in group]
    tensors = [c.tensors for c in deltas]
    mergeable = coded.mergeable(tensors)
    sparse_codes = mergeable and next(iter(tensors[0].values())).codec.sparse
    if not mergeable or (sparse_codes and len(deltas) > len(parts)):
        merged = _merged([combined(group) for group in parts], w, config)
        delta_norms = [
            rda.fragment_norm({p: _float(t) for p, t in c.tensors.items()}) for c in deltas
        ]
        return (
            _taking(merged, step, share),
            list(merged.values()),
            delta_norms,
            rda.fragment_norm(merged),
        )
    plains = {p: plain(p, config) for p in tensors[0]}
    if sparse_codes:
        paths, tiles, block_scale, layout, delta_norms, merged_norm = coded.direction(
            tensors, w, plains
        )

        def take_sparse(current: FragmentState, in_place: bool):
            new, opt_state = outer_step(step.optimizer, in_place=in_place)(
                [current.params[p] for p in paths],
                current.opt_state,
                tiles,
                block_scale,
                np.float32(share),
                layout,
            )
            return dict(zip(paths, new)), opt_state

        return take_sparse, tiles, delta_norms, merged_norm
    sizes = [len(group) for group in parts]
    terms = fused_terms(step.optimizer)
    if terms is not None and fused.fits(state.params, state.opt_state):
        scratch = coded.Scratch() if scratch is None else scratch
        dense = coded.dense_terms(tensors, w, plains, scratch, sizes)
        new = fused.step(state.params, state.opt_state, dense, terms, scratch.states)
        return (lambda current, in_place: new), [], dense.delta_norms, dense.merged_norm
    merged, delta_norms, merged_norm = coded.dense(tensors, w, plains, scratch, sizes)
    # aligned host buffers: XLA reads them where they are
    merged = {p: jax.device_put(v) for p, v in merged.items()}
    return _taking(merged, step, share), list(merged.values()), delta_norms, merged_norm


def _taking(merged: dict, step, share: float):
    """`take(state, in_place)` of a fold whose pseudo-gradient is `merged` (path -> array)."""

    def take(current: FragmentState, in_place: bool):
        taking = make_step(step.optimizer, in_place=True) if in_place else step
        return taking(current.params, current.opt_state, merged, share)

    return take


def taken(
    current: FragmentState, state: FragmentState | PendingStep, fragment: int
) -> FragmentState:
    """`state`, its outer step taken first if pending: on `current`, the fragment's state it was
    computed from, whose arrays are gone after it (a host view taken before keeps its values: XLA
    copies that buffer instead)."""
    if not isinstance(state, PendingStep):
        return state
    if state.version != current.version + 1:
        raise ReplayError(
            f"fold of fragment {fragment} to version {state.version} taken on version"
            f" {current.version}"
        )
    return FragmentState(state.version, *state.take(_distinct(current)))


def _distinct(state: FragmentState) -> FragmentState:
    """`state` with no XLA array in it twice (an optimizer's state may share a buffer, and one
    buffer cannot be donated twice): a repeated one is copied."""
    seen = set()

    def once(leaf):
        if isinstance(leaf, jax.Array) and id(leaf) in seen:
            return jnp.array(leaf, copy=True)
        seen.add(id(leaf))
        return leaf

    params = {path: once(value) for path, value in state.params.items()}
    return FragmentState(state.version, params, jax.tree_util.tree_map(once, state.opt_state))


def init_state(params: Mapping[str, np.ndarray], optimizer) -> FragmentState:
    """Version 0 of a fragment; the optimizer state is built over the params as a path-ordered list
    (the layout `outer.make_step` uses)."""
    params = {path: np.asarray(value, dtype=np.float32) for path, value in params.items()}
    return FragmentState(0, params, optimizer.init([params[p] for p in sorted(params)]))
