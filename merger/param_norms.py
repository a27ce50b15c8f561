"""A fragment's norm for the guard's cold reference (merger/outliers.py `fold_caps`), computed
ahead on a thread of its own instead of on the receiving thread when a fold starts.

While an island of a fragment has no movement reference (a merger with one island, or the first
folds of a fresh one), every fold of that fragment needs the norm of its parameters: one pass over
them, which on the receiving thread took ~40 % of the merger's ingest in `dloco bench scale` (one
island).  So when a fold is installed and one of its islands is still without a reference, the
norm of the new parameters starts on the `guard-norm` thread; the next fold of that fragment takes
the result (or computes it there if none was started for those parameters).  The value is the same
wherever it is computed (fold_loops.norm's fixed order), so replay and the live merger agree.

Installing a fold writes its step over the parameters (merger/fold.py `taken`): it first waits for
a norm still reading them (`settle`), which has had a whole fold's time to finish.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dloco.merger import fold_loops
from dloco.merger.outliers import NormHistory


def norm_of(params: Mapping[str, Any], threads: int = fold_loops.DEFAULT_THREADS) -> float:
    """The norm of a fragment's parameters (float32 arrays or XLA arrays on the host)."""
    return fold_loops.norm((np.asarray(v) for v in params.values()), threads)


class ParamNorms:
    """Per fragment, at most one norm in progress or done, for the parameters it was asked for."""

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[Mapping[str, Any], concurrent.futures.Future]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def installed(
        self, fragment: int, params: Mapping[str, Any], moves: NormHistory, movements: Sequence
    ) -> None:
        """A fold's new parameters are the fragment's: start their norm if an island of the fold
        (`movements`: (island, movement) pairs) has no movement reference in `moves`."""
        if any(moves.reference(island, "max") is None for island, _ in movements):
            self.ahead(fragment, params)

    def ahead(self, fragment: int, params: Mapping[str, Any]) -> None:
        """Start the norm of `params`, the fragment's newly installed parameters."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="guard-norm")
        # one thread: the codec pool's threads stay with the fold
        self._jobs[fragment] = (params, self._pool.submit(norm_of, params, 1))

    def settle(self, fragment: int) -> None:
        """Wait until nothing reads the fragment's parameters (before a step is taken over them)."""
        job = self._jobs.get(fragment)
        if job is not None:
            concurrent.futures.wait([job[1]])

    def of(self, fragment: int, params: Mapping[str, Any]) -> float:
        """The norm of `params`: the one started for them, else computed here."""
        job = self._jobs.get(fragment)
        if job is not None and job[0] is params:
            return job[1].result()
        return norm_of(params)
