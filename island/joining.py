"""An island's join: before its first step it waits for the merger's snapshot of every fragment,
and refuses a merger that trains another model, naming the first parameter that differs."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from dloco.bus.sockets import HEARTBEAT_TIMEOUT_MS
from dloco.island.task import first_difference
from dloco.protocol.errors import DlocoError


class JoinTimeout(DlocoError):
    """The merger's initial snapshot did not arrive."""


class ModelMismatch(DlocoError):
    """The merger's model (parameter paths and shapes) is not the one this island's task builds."""


def wait_for_model(
    link,
    ours: Mapping[str, tuple[int, ...]],
    fragments: int,
    timeout_s: float,
    stopping: Callable[[], bool],
    unreachable: Callable[[list[str]], None] = lambda endpoints: None,
) -> list[tuple[int, int, dict[str, np.ndarray]]]:
    """The snapshots (fragment, version, tensors) `link` delivers until every one of `fragments`
    has arrived, in arrival order; fewer when `stopping()` turns true.  `ours`: this task's
    {path: shape}.  Raises JoinTimeout after `timeout_s`, naming the endpoints never reached, or
    those that refused its handshake, if the link says (`link.unreached()`, `link.refused()`),
    ModelMismatch as soon as what arrived differs from `ours`
    (and, once everything arrived, if anything of `ours` is missing).  `unreachable(endpoints)` is
    told once if no connection has come up within the heartbeat timeout."""
    started = time.monotonic()
    deadline, warned = started + timeout_s, False
    waiting, theirs, arrived = set(range(fragments)), {}, []
    while waiting and not stopping():
        unreached = link.unreached() if hasattr(link, "unreached") else []
        if not warned and unreached and time.monotonic() - started > HEARTBEAT_TIMEOUT_MS / 1000:
            unreachable(unreached)
            warned = True
        if time.monotonic() > deadline:
            refuse_foreign(link, ours, fragments, final=True)
            if unreached:
                raise JoinTimeout(
                    f"could not reach {', '.join(unreached)} within {timeout_s} s: is the hub"
                    " running, and are its ports open to this host?"
                )
            refused = link.refused() if hasattr(link, "refused") else []
            why = (
                f" ({', '.join(refused)} refused its handshake: is this island's key in the hub's"
                " allow-list?)"
                if refused
                else ""
            )
            raise JoinTimeout(
                f"no snapshot of fragments {sorted(waiting)} within {timeout_s} s: is the"
                f" merger running, with the same model?{why}"
            )
        for fragment, version, tensors in link.snapshots():
            theirs.update({p: np.shape(v) for p, v in tensors.items()})
            # so far: what arrived
            so_far = {p: ours[p] for p in theirs if p in ours}
            if (difference := first_difference(theirs, so_far)) is not None:
                raise ModelMismatch(f"the merger trains another model than this task: {difference}")
            arrived.append((fragment, version, tensors))
            waiting.discard(fragment)
        refuse_foreign(link, ours, fragments)
        time.sleep(0.01)
    if not waiting and (difference := first_difference(theirs, ours)) is not None:
        raise ModelMismatch(f"the merger trains another model than this task: {difference}")
    return arrived


def refuse_foreign(
    link, ours: Mapping[str, tuple[int, ...]], fragments: int, final: bool = False
) -> None:
    """The link drops snapshots of another model (their fingerprint is not this task's) and keeps
    only their layout.  Once every fragment's has arrived (they come together, answering the join's
    request), raise ModelMismatch naming the first differing path of the whole model; at the join's
    deadline (`final`), the first one in what has arrived."""
    foreign = getattr(link, "foreign", {})
    if not foreign or (len(foreign) < fragments and not final):
        return
    theirs = {p: shape for layout in foreign.values() for p, shape in layout.items()}
    compared = ours if len(foreign) >= fragments else {p: ours[p] for p in theirs if p in ours}
    if (difference := first_difference(theirs, compared)) is not None:
        raise ModelMismatch(f"the merger trains another model than this task: {difference}")
