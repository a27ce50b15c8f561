"""An admitted delta as a fold takes it (merger/fold/merge.py), and as the guard clips it
(merger/fold/clipping.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dloco.protocol import CodedTensor


@dataclasses.dataclass(frozen=True)
class Contribution:
    island: str
    epoch: int
    delta_id: int
    staleness: int
    tokens: int
    steps: int
    # path -> float32 delta, or its int records
    tensors: Mapping[str, np.ndarray | CodedTensor]
