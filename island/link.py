"""What the training loop needs from the network (island/network.py's `NetworkLink` is it; the
tests hand the loop small ones of their own).  Nothing here may block the loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np


class Link(Protocol):
    """What the loop needs from the network; implementations never block the caller."""

    bytes_sent: int
    bytes_received: int
    # fragment -> deltas settled without a fold (blocking mode ends its wait on them)
    unfolded: Mapping[int, int]
    # fragment -> {path: shape} of snapshots of another model (never adopted)
    foreign: Mapping[int, Mapping[str, tuple[int, ...]]]

    def publish(
        self,
        fragment: int,
        base_version: int,
        delta: dict[str, np.ndarray],
        steps: int,
        tokens: int,
    ) -> None: ...

    # (fragment, version, tensors)
    def snapshots(self) -> list[tuple[int, int, dict[str, np.ndarray]]]: ...

    # error feedback's undelivered part, handed to the loop
    def take_residuals(self, paths) -> dict[str, np.ndarray]: ...

    # the island adopted this version with its progress on top: an unsent delta is a change of it
    def rebase_unsent(self, fragment: int, version: int) -> None: ...
