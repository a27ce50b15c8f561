"""The soak's invariant checker (suites/soak.py): what must hold after any schedule of faults, read
from a run directory once the run has stopped.

- every delta is folded at most once, in every merger's write-ahead log;
- fragment versions strictly increase, record after record, in every log;
- every delta an island's last life counted as folded is in the final primary's log (and every delta
  it sent was settled: folded, rejected, or its ack still unknown when it stopped);
- no fold a merger announced (published: only once acknowledged, PROTOCOL.md §12) is among the
  records it set aside on stepping down;
- a merger folds only while it is the primary (a standby, or one that stepped down, never), and
  each takeover is under a newer term;
- no island adopted a snapshot of a merger epoch older than one it had adopted before (a fenced
  primary's), in any of its lives;
- replaying each merger's log gives the digest of each of its checkpoints;
- every process is running at the end and stops cleanly (each fault had its recovery);
- the global model's held-out loss fell;
- each island's step rate while another process was faulted is at least RATE_FLOOR of its rate
  while nothing was (its own faults, and its rejoin after a kill, excluded).  This one measures a
  shared machine too; it is `timing` and reported apart.

The rules are pure functions of plain values; `check` reads them from the run directory.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Mapping

RATE_FLOOR = 0.9
RECOVERY = {
    "kill": "restart",
    "lose-disk": "restart",
    # any other fault (of a link) ends with `heal`
}


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    # a rate of a shared machine, not a correctness property
    timing: bool = False


def folded_once(members: Iterable[tuple]) -> Check:
    """`members`: every (island, epoch, delta id) of every fold record of one log."""
    counts = collections.Counter(tuple(m) for m in members)
    twice = [(m, n) for m, n in counts.items() if n > 1]
    return Check(
        "folded at most once",
        not twice and bool(counts),
        f"{len(counts)} deltas folded" + (f"; folded more than once: {twice[:3]}" if twice else ""),
    )


def versions_increase(folds: Iterable[tuple[int, int]]) -> Check:
    """`folds`: (fragment, version) of every fold record, in log order."""
    last: dict[int, int] = {}
    bad = []
    for fragment, version in folds:
        if version <= last.get(fragment, -1):
            bad.append((fragment, last[fragment], version))
        last[fragment] = version
    return Check(
        "versions strictly increase",
        not bad,
        f"fragments at versions {dict(sorted(last.items()))}"
        + (f"; went back: {bad[:3]} (fragment, before, after)" if bad else ""),
    )


def acked_in_log(dones: Mapping[str, dict], logged: collections.Counter) -> Check:
    """`dones`: each island's last life's `done` summary; `logged`: (island, epoch) -> its deltas in
    the final primary's fold records."""
    bad = []
    for island, done in sorted(dones.items()):
        acks, in_log = done.get("acks", {}), logged[(island, done.get("epoch"))]
        folded, unknown = acks.get("folded", 0), acks.get("unknown", 0)
        if (
            folded + acks.get("rejected", 0) + unknown != done.get("deltas_sent")
            or not folded <= in_log <= folded + unknown
        ):
            bad.append(
                f"{island}: sent {done.get('deltas_sent')}, acks {acks}, in the log {in_log}"
            )
    return Check(
        "every acked delta is in the log",
        bool(dones) and not bad,
        "; ".join(bad)
        or f"{len(dones)} islands' last lives: every folded ack in the log, every send settled",
    )


def nothing_acked_discarded(set_asides: Mapping[str, list[tuple[set, set]]]) -> Check:
    """`set_asides`: per merger, each time it set records aside, (the folds (fragment, version) it
    announced since its previous set-aside, the fold records set aside)."""
    bad, discarded = [], 0
    for name, times in sorted(set_asides.items()):
        for announced, aside in times:
            discarded += len(aside)
            if acked := sorted(announced & aside):
                bad.append(f"{name} set aside {len(acked)} announced folds, e.g. {acked[:3]}")
    return Check(
        "no acknowledged record set aside",
        not bad,
        "; ".join(bad) or f"{discarded} unannounced fold records set aside, none announced",
    )


ROLES = {
    "genesis": "primary",
    "recovered": "primary",
    "no_primary": "primary",
    "taking_over": "primary",
    "following": "standby",
    "stepped_down": "standby",
}


def one_primary(logs: Mapping[str, list[dict]]) -> Check:
    """`logs`: each merger process's log events in order.  No fold while a standby; terms increase
    from takeover to takeover (across processes, by time); a fenced merger's epoch is older than
    the one that fenced it."""
    bad, takeovers = [], []
    for name, events in logs.items():
        role = None
        for event in events:
            role = ROLES.get(event.get("event"), role)
            if event.get("event") == "fold" and role == "standby":
                bad.append(
                    f"{name} folded version {event.get('version')} "
                    f"of fragment {event.get('fragment')} as a standby"
                )
            if event.get("event") == "taking_over":
                takeovers.append((event.get("timestamp", ""), event.get("term", 0), name))
            if event.get("event") == "fenced" and not event.get("by_epoch", 0) > event.get(
                "epoch", 0
            ):
                bad.append(f"{name} fenced by an epoch not newer than its own: {event}")
    terms = [term for _, term, _ in sorted(takeovers)]
    if any(b <= a for a, b in itertools.pairwise(terms)):
        bad.append(f"takeover terms not increasing: {terms}")
    return Check(
        "one primary at a time",
        not bad,
        "; ".join(bad[:3]) or f"{len(takeovers)} takeovers, terms {terms}",
    )


def epochs_monotone(adopted: Mapping[str, list[tuple[str, int]]]) -> Check:
    """`adopted`: per island, (merger, epoch) of each `merger_epoch` line, every life in order."""
    bad = []
    for island, changes in sorted(adopted.items()):
        newest: dict[str, int] = {}
        for merger, epoch in changes:
            if epoch < newest.get(merger, 0):
                bad.append(f"{island} adopted epoch {epoch} of {merger} after {newest[merger]}")
            newest[merger] = max(epoch, newest.get(merger, 0))
    counts = {island: len({e for _, e in changes}) for island, changes in sorted(adopted.items())}
    return Check(
        "no snapshot of an older merger epoch adopted",
        bool(adopted) and not bad,
        "; ".join(bad[:3]) or f"merger epochs adopted per island: {counts}",
    )


def replay_matches(results: Mapping[str, list[tuple[int, str, str]] | str]) -> Check:
    """`results`: per merger directory, (record, checkpoint digest, replayed digest) of each
    checkpoint, or why the replay failed."""
    bad, compared = [], 0
    for name, rows in sorted(results.items()):
        if isinstance(rows, str):
            bad.append(f"{name}: {rows}")
            continue
        compared += len(rows)
        bad += [
            f"{name}: checkpoint at record {at} differs"
            for at, expected, actual in rows
            if expected != actual
        ]
        if not rows:
            bad.append(f"{name}: no checkpoint to compare")
    return Check(
        "replay gives each checkpoint's digest",
        not bad,
        "; ".join(bad[:3]) or f"{compared} checkpoints in {len(results)} logs",
    )


CLEAN_STOP = {
    "merger": "stopped",
    "standby": "stopped",
    "broker": "broker_stopped",
    # an island's: "done"
}


def stopped_cleanly(last: Mapping[str, str | None]) -> Check:
    """`last`: each process's last logged event.  Every fault was followed by its recovery, so each
    process must have run to the end and stopped cleanly (a merger `stopped`, the broker
    `broker_stopped`, an island `done`): a killed one that never came back shows here."""
    bad = {
        name: event
        for name, event in sorted(last.items())
        # a shard's merger.I and standby.I as the merger's
        if event != CLEAN_STOP.get(name.partition(".")[0], "done")
    }
    return Check(
        "every process back and stopped cleanly",
        bool(last) and not bad,
        f"last logged events: {bad}" if bad else f"{len(last)} processes",
    )


def improved(initial: float, final: float | None) -> Check:
    return Check(
        "the global model improved",
        final is not None and final < initial,
        f"held-out loss {initial:.3f} -> "
        + ("none (no checkpoint)" if final is None else f"{final:.3f}"),
    )


def fault_intervals(
    executed: list[dict], joins: Mapping[str, list[float]], end: float
) -> list[tuple[str, float, float]]:
    """(target, start, end) of each fault: from the event to its recovery (`restart` after a
    kill, else `heal`), and for a killed island on to its rejoin; a fault never recovered lasts
    to `end`."""
    ordered = sorted(executed, key=lambda e: e["wall"])
    out = []
    for index, event in enumerate(ordered):
        if event["action"] in ("restart", "heal"):
            continue
        recovery = RECOVERY.get(event["action"], "heal")
        back = next(
            (
                e["wall"]
                for e in ordered[index + 1 :]
                if e["target"] == event["target"] and e["action"] == recovery
            ),
            end,
        )
        rejoined = (
            [w for w in joins.get(event["target"], []) if w >= back]
            if recovery == "restart"
            else []
        )
        out.append((event["target"], event["wall"], min(rejoined[0], end) if rejoined else back))
    return out


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _inside(t: float, merged: list[tuple[float, float]]) -> bool:
    return any(start <= t < end for start, end in merged)


def _minus(
    span: tuple[float, float], merged: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """`span` without `merged` (merged: sorted, disjoint)."""
    out, at = [], span[0]
    for start, end in merged:
        if end <= at or start >= span[1]:
            continue
        if start > at:
            out.append((at, start))
        at = max(at, end)
    return out + ([(at, span[1])] if at < span[1] else [])


def rate_ratios(
    steps: Mapping[str, list[float]],
    faults: list[tuple[str, float, float]],
    span: tuple[float, float],
) -> dict[str, float | None]:
    """Per island: its steps per second while another process was faulted (and it was not) over its
    steps per second while nothing was, within `span` (None: no time of one kind)."""
    every = _merge((s, e) for _, s, e in faults)
    clean = _minus(span, every)
    ratios = {}
    for island, times in steps.items():
        own = _merge((s, e) for target, s, e in faults if target.partition(".")[0] == island)
        faulted = [
            piece
            for start, end in every
            if min(end, span[1]) > max(start, span[0])
            for piece in _minus((max(start, span[0]), min(end, span[1])), own)
        ]
        clean_s, faulted_s = sum(e - s for s, e in clean), sum(e - s for s, e in faulted)
        if clean_s <= 0 or faulted_s <= 0:
            ratios[island] = None
            continue
        clean_rate = sum(_inside(t, clean) for t in times) / clean_s
        faulted_rate = sum(_inside(t, faulted) for t in times) / faulted_s
        ratios[island] = faulted_rate / clean_rate if clean_rate else None
    return ratios


def rates_kept(ratios: Mapping[str, float | None], floor: float = RATE_FLOOR) -> Check:
    low = {island: r for island, r in ratios.items() if r is not None and r < floor}
    shown = ", ".join(
        f"{island} {'-' if r is None else f'{r:.2f}x'}" for island, r in sorted(ratios.items())
    )
    return Check(
        f"step rate kept >= {floor}x while others were faulted",
        not low and any(r is not None for r in ratios.values()),
        shown,
        timing=True,
    )
