"""A fragment's norm for the guard's cold reference (merger/fold/outliers.py `fold_caps`): a lower
bound of it computed ahead on a thread of its own, the exact norm only when a fold needs it.

While an island of a fragment has no movement reference (a merger with one island, or the first
folds of a fresh one), a fold caps its part at COLD_LIMIT times the norm of the fragment's
parameters.  The exact norm is a pass over them, a sizeable share of a one-island merger's ingest
(`dloco bench scale`), beside the fold on the second core.  An honest island moves a fragment by
a small fraction of its norm, under any cap, so a fold asks first for a lower bound:
`dense_loops.norm` over one part in LOWER_EVERY of each tensor (the same part sums as the exact
norm's, fewer of them: never above it, float for float).  A part within COLD_LIMIT times the bound
is within the cap whatever its exact value; only a part that moves more asks for the exact norm,
computed then (merger/fold/clipping.py).  So the fold is the same, bit for bit, as with the exact
norm, and replay and the live merger agree wherever the norms are computed.

When a fold is installed and one of its islands is still without a reference, the lower bound of
the new parameters starts on the `guard-norm` thread; the next fold of that fragment takes it (or
computes it there if none was started for those parameters).  Installing a fold writes its step
over the parameters (merger/fold/merge.py `taken`): it first waits for a norm still reading them
(`settle`), which has had a whole fold's time to finish.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dloco.merger.engines import dense_loops
from dloco.merger.fold.merge import FragmentState, ReplayError
from dloco.merger.fold.outliers import NormHistory, ParamNorm

# the lower bound reads one part (dense_loops.NORM_PART values) in this many of each tensor
LOWER_EVERY = 8


def norm_of(
    params: Mapping[str, Any], threads: int = dense_loops.DEFAULT_THREADS, every: int = 1
) -> float:
    """The norm of a fragment's parameters (float32 arrays or XLA arrays on the host); `every` > 1:
    the lower bound over one part in `every` (dense_loops.norm)."""
    return dense_loops.norm((np.asarray(v) for v in params.values()), threads, every)


class ParamNorms:
    """Per fragment, at most one lower bound in progress or done, for the parameters it was asked
    for."""

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[Mapping[str, Any], concurrent.futures.Future]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def installed(
        self, fragment: int, params: Mapping[str, Any], moves: NormHistory, movements: Sequence
    ) -> None:
        """A fold's new parameters are the fragment's: start their lower bound if an island of the
        fold (`movements`: (island, movement) pairs) has no movement reference in `moves`."""
        if any(moves.reference(island, "max") is None for island, _ in movements):
            self.ahead(fragment, params)

    def ahead(self, fragment: int, params: Mapping[str, Any]) -> None:
        """Start the lower bound of `params`, the fragment's newly installed parameters."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="guard-norm")
        # one thread: the codec pool's threads stay with the fold
        self._jobs[fragment] = (params, self._pool.submit(norm_of, params, 1, LOWER_EVERY))

    def settle(self, fragment: int) -> None:
        """Wait until nothing reads the fragment's parameters (before a step is taken over them)."""
        job = self._jobs.get(fragment)
        if job is not None:
            concurrent.futures.wait([job[1]])

    def lower(self, fragment: int, params: Mapping[str, Any]) -> float:
        """The lower bound of the norm of `params`: the one started for them, else computed here."""
        job = self._jobs.get(fragment)
        if job is not None and job[0] is params:
            return job[1].result()
        return norm_of(params, every=LOWER_EVERY)

    def bounds(self, fragment: int, states: Sequence[FragmentState]) -> ParamNorm:
        """What the guard asks of the norm of the fragment's parameters (`states`: the core's, one
        per fragment; outliers.fold_caps).  The exact norm is computed when asked, from the state
        then held, which must be the one asked about: a started fold holds no parameters (they
        would outlive the step that writes over them, and XLA would copy them instead)."""
        state = states[fragment]
        return ParamNorm(
            functools.partial(_exact, states, fragment, state.version),
            functools.partial(self.lower, fragment, state.params),
        )


def _exact(states: Sequence[FragmentState], fragment: int, version: int) -> float:
    state = states[fragment]
    if state.version != version:
        raise ReplayError(
            f"the guard asked for the norm of fragment {fragment} at version {version}; it holds"
            f" {state.version}"
        )
    return norm_of(state.params)
