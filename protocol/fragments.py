"""Partition of a model's parameters into P fragments, balanced by value count.

Both ends compute it from the model structure alone (paths and shapes) and P, so an island and
the merger agree on which tensor belongs to which fragment without exchanging the assignment.
Greedy longest-processing-time: tensors in decreasing size (ties by path), each to the fragment
with the fewest values so far (ties by lowest index).  PROTOCOL.md §10 specifies it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dloco.protocol.errors import EncodeError


def partition(shapes: Mapping[str, tuple[int, ...]], fragments: int) -> list[list[str]]:
    """Paths of each fragment (each list sorted), for `fragments` >= 1 and at most one per
    tensor."""
    if not isinstance(fragments, int) or fragments < 1:
        raise EncodeError(f"the number of fragments must be an int >= 1, got {fragments!r}")
    if fragments > len(shapes):
        raise EncodeError(
            f"{fragments} fragments but only {len(shapes)} tensors: every fragment needs one"
        )
    loads = [0] * fragments
    members: list[list[str]] = [[] for _ in range(fragments)]
    for path in sorted(shapes, key=lambda p: (-math.prod(shapes[p]), p)):
        target = min(range(fragments), key=lambda i: (loads[i], i))
        loads[target] += math.prod(shapes[path])
        members[target].append(path)
    return [sorted(paths) for paths in members]
