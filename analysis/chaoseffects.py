"""What each executed chaos event (cluster/chaos.py) did to the rest of the cluster, derived from
the executed events, the islands' step times and the merger's fold times: one row per event (step
rates of the other islands before and after, folds before and after, time to rejoin and to the next
fold).  Pure; analysis.runinfo.chaos_effects reads its inputs from a run directory."""

from __future__ import annotations

# seconds before / after an event over which step rates and folds are compared
WINDOW_S = 15.0


def _count(times: list[float], start: float, end: float) -> int:
    return sum(start <= t < end for t in times)


def effects(
    executed: list[dict],
    steps: dict[str, list[float]],
    joins: dict[str, list[float]],
    folds: list[tuple[float, tuple[str, ...]]],
    window_s: float = WINDOW_S,
) -> list[dict]:
    """One row per executed event ({"wall", "action", "target"}), all times in wall-clock seconds.

    steps: per island, the wall time of every training step; joins: per island, when a process of it
    joined (got the merger's model); folds: (wall time, contributors) of every fold.
    The "after" window ends early at the next event, so two faults are not mixed up.  A kill that is
    followed by a restart of the same process also gets `during_absence`: each other island's steps
    over the whole absence / its steps over as long a stretch just before the kill (None without
    any).
    """
    rows = []
    ordered = sorted(executed, key=lambda e: e["wall"])
    for index, event in enumerate(ordered):
        # a multi-host island's process NAME.I: the island NAME
        t, target = event["wall"], event["target"].partition(".")[0]
        after_end = (
            min(t + window_s, ordered[index + 1]["wall"])
            if index + 1 < len(ordered)
            else t + window_s
        )
        before_start = max(t - window_s, ordered[index - 1]["wall"]) if index > 0 else t - window_s
        row = {
            **event,
            "others": _rates(steps, target, before_start, t, after_end),
            "window_s": (t - before_start, after_end - t),
            "folds_before": sum(before_start <= w < t for w, _ in folds),
            "folds_after": sum(t <= w < after_end for w, _ in folds),
            "contributors_after": sorted({c for w, cs in folds if t <= w < after_end for c in cs}),
        }
        row.update(_absence(event, ordered[index + 1 :], steps, target))
        row.update(_recovery(event, steps, joins, folds, target))
        rows.append(row)
    return rows


def _rates(
    steps: dict[str, list[float]], target: str, before_start: float, t: float, after_end: float
) -> dict[str, dict]:
    """Each other island's step rate before and after an event at `t`, and their ratio (None when
    it made no step before)."""
    rates = {}
    for island, times in steps.items():
        if island == target or after_end <= t or t <= before_start:
            continue
        before = _count(times, before_start, t) / (t - before_start)
        after = _count(times, t, after_end) / (after_end - t)
        rates[island] = {
            "before": before,
            "after": after,
            "ratio": after / before if before else None,
        }
    return rates


def _absence(
    event: dict, later: list[dict], steps: dict[str, list[float]], target: str
) -> dict[str, object]:
    """For a kill or a link's fault that ends later (at the restart, at the heal): its length and
    each other island's steps over it against as long a stretch just before; {} otherwise."""
    t = event["wall"]
    # a link's fault ends when it is healed, a kill at the restart
    ends = "heal" if _network(event["action"]) else "restart"
    back = next(
        (e["wall"] for e in later if e["target"] == event["target"] and e["action"] == ends),
        None,
    )
    # the whole absence against as long a stretch just before it
    if not (event["action"] in ("kill", "lose-disk") or _network(event["action"])) or back is None:
        return {}
    length = back - t
    return {
        "absence_s": length,
        "during_absence": {
            island: (
                _count(times, t, back) / _count(times, t - length, t)
                if _count(times, t - length, t)
                else None
            )
            for island, times in steps.items()
            if island != target
        },
    }


def _recovery(
    event: dict,
    steps: dict[str, list[float]],
    joins: dict[str, list[float]],
    folds: list[tuple[float, tuple[str, ...]]],
    target: str,
) -> dict[str, float | None]:
    """How soon the cluster came back after a heal or a restart (or, with a standby, a merger's
    fault): seconds to the rejoin and to the next fold that took the island's work."""
    t, row = event["wall"], {}
    # an island's link healed: when was its work folded again?
    if event["action"] == "heal" and target in steps:
        folded = [w for w, cs in folds if w >= t and target in cs]
        row["first_fold_s"] = folded[0] - t if folded else None
    # with a standby: how soon the next fold came
    elif event["action"] != "restart" and event["target"] == "merger":
        later = [w for w, _ in folds if w >= t]
        row["first_fold_s"] = later[0] - t if later else None
    if event["action"] == "restart":
        # an island: when did it rejoin, and when was its first delta folded?
        if target in steps:
            rejoined = [w for w in joins.get(target, []) if w >= t]
            folded = [w for w, cs in folds if w >= t and target in cs]
            row["rejoined_s"] = rejoined[0] - t if rejoined else None
            row["first_fold_s"] = folded[0] - t if folded else None
        else:
            later = [w for w, _ in folds if w >= t]
            row["first_fold_s"] = later[0] - t if later else None
    return row


def _network(action: str) -> bool:
    """A link's fault (cluster/chaos.py NETWORK_ACTIONS, partition-from-PEER, loss-P), not its
    heal."""
    return action.startswith(("partition", "loss-"))
