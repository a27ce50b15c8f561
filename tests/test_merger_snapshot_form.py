"""The merger's choice between a full snapshot, a diff and a reply, against hand-derived cases."""

from __future__ import annotations

import pytest

from merger.snapshot_form import DIFF, FULL, REPLY, snapshot_form


@pytest.mark.parametrize("version, served, on_bus, every, form", [
    (0, None, True, 0, FULL),  # nothing served yet: full, on the bus ...
    (7, None, False, 0, FULL),  # ... and as a reply
    (4, 3, True, 0, DIFF),  # newer than served: the change since it
    (9, 3, True, 0, DIFF),  # several versions newer: still one diff
    (3, 3, True, 0, FULL),  # not newer than served: full
    (2, 5, True, 0, FULL),
    (4, 3, False, 0, REPLY),  # a request: the served value itself
    (3, 3, False, 4, REPLY),
    (8, 3, False, 4, REPLY),  # a request never turns into a full one, whatever full_every says
    (4, 3, True, 4, FULL),  # every 4th: 4 // 4 = 1 > 3 // 4 = 0
    (5, 4, True, 4, DIFF),  # 5 // 4 = 1 = 4 // 4
    (7, 5, True, 4, DIFF),  # 1 = 1
    (9, 7, True, 4, FULL),  # 2 > 1: version 8 was skipped, 9 is the first past it
    (9, 3, True, 4, FULL),  # 2 > 0
    (12, 8, True, 4, FULL),  # 3 > 2
    (11, 8, True, 4, DIFF),  # 2 = 2
    (4, 3, True, 1, FULL),  # every version in full
])
def test_snapshot_form(version, served, on_bus, every, form):
    assert snapshot_form(version, served, on_bus, every) == form
