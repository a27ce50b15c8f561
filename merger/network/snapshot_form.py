"""How a fragment's snapshot goes out when diff snapshots are on: in full, as a diff, or as a reply.

Pure: versions in, a form out.  The merger keeps the value it has served of each fragment
(protocol/downlink.py).  On the bus a snapshot goes out
- in full when nothing has been served yet, when its version is not newer than the one served, or
  when it is the first version at or past a multiple of `full_every` (0: never; a receiver that
  missed a diff then recovers without asking);
- as a diff from the served value otherwise.
Point to point (an island's request) it is the served value itself, exact, so that the receiver
can apply the diffs that follow; in full when nothing has been served yet.
"""

from __future__ import annotations

FULL, DIFF, REPLY = "full", "diff", "reply"


def snapshot_form(version: int, served_version: int | None, on_bus: bool, full_every: int) -> str:
    """FULL, DIFF or REPLY for a snapshot of `version`, given the version served so far (None:
    none)."""
    if served_version is None:
        return FULL
    if not on_bus:
        return REPLY
    if version <= served_version or (
        full_every and version // full_every > served_version // full_every
    ):
        return FULL
    return DIFF
