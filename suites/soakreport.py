"""The soak's reading side: the checker's inputs from a run directory (analysis/soakcheck.py has
the rules) and OUT/soak.md."""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
from pathlib import Path

from dloco.analysis import soakcheck
from dloco.analysis.runinfo import chaos_effects, read_events, step_times
from dloco.merger.log.segments import read_records

# each merger's run directory: merger, standby, and shard I's merger.I, standby.I
MERGER_DIR = re.compile(r"(merger|standby)(\.[1-9][0-9]*)?")


def _replay(directory: Path) -> list[tuple[int, str, str]] | str:
    from dloco.merger.state.recovery import replay
    from dloco.protocol import DlocoError

    try:
        return list(replay(directory, lambda *_: None))
    except (DlocoError, OSError, KeyError) as error:
        return str(error)


def check_run(run_dir: Path, config) -> list[soakcheck.Check]:
    """Every check of analysis/soakcheck.py on a stopped run."""
    from dloco.analysis.report import global_eval
    from dloco.cluster.records import run_task

    islands = [region.name for region in config.regions]
    mergers = sorted(
        (
            path.name
            for path in run_dir.iterdir()
            if MERGER_DIR.fullmatch(path.name) and (path / "wal").exists()
        ),
        key=lambda name: (name.partition(".")[2], name),
    )
    checks = _log_checks(run_dir, mergers)
    logged = _final_log(run_dir)
    island_logs = {name: read_events(run_dir / "logs" / f"{name}.log") for name in islands}
    checks.append(_acked(islands, island_logs, logged))
    checks.append(soakcheck.nothing_acked_discarded({m: _set_asides(run_dir, m) for m in mergers}))
    # each shard's pair on its own (their terms are their own)
    for shard in sorted({name.partition(".")[2] for name in mergers}):
        pair = [name for name in mergers if name.partition(".")[2] == shard]
        check = soakcheck.one_primary(
            {name: read_events(run_dir / "logs" / f"{name}.log") for name in pair}
        )
        checks.append(
            dataclasses.replace(check, name=f"{check.name} (shard {shard})") if shard else check
        )
    checks.append(
        soakcheck.epochs_monotone(
            {
                name: [
                    (e["merger"], e["epoch"]) for e in events if e.get("event") == "merger_epoch"
                ]
                for name, events in island_logs.items()
            }
        )
    )
    checks.append(soakcheck.replay_matches({name: _replay(run_dir / name) for name in mergers}))
    last = {
        name: (
            events[-1]["event"] if events else None
            # an island prints its summary after `done`: not an event
        )
        for name in (*islands, *mergers, "broker")
        for events in [[e for e in read_events(run_dir / "logs" / f"{name}.log") if "event" in e]]
    }
    checks.append(soakcheck.stopped_cleanly(last))
    before, after = global_eval(run_task(config), run_dir)
    checks.append(soakcheck.improved(before["loss"], after and after["loss"]))
    checks += _rate_checks(run_dir, islands)
    return checks


def _log_checks(run_dir: Path, mergers: list[str]) -> list[soakcheck.Check]:
    """Each merger's write-ahead log: every delta folded once, versions increasing."""
    checks = []
    for name in mergers:
        folds = [
            record
            for _, record in read_records(run_dir / name / "wal")
            if record.get("type") == "fold"
        ]
        for check in (
            soakcheck.folded_once(m for f in folds for m in f["members"]),
            soakcheck.versions_increase((f["fragment"], f["version"]) for f in folds),
        ):
            checks.append(soakcheck.Check(f"{check.name} ({name}'s log)", check.ok, check.detail))
    return checks


def _final_log(run_dir: Path) -> collections.Counter:
    """The final primaries' fold records (each shard's): (island, epoch) -> its deltas folded."""
    from dloco.analysis.runinfo import shard_run_dirs

    return collections.Counter(
        (m[0], m[1])
        for final in shard_run_dirs(run_dir)
        for _, record in read_records(final / "wal")
        if record.get("type") == "fold"
        for m in record["members"]
    )


def _set_asides(run_dir: Path, name: str) -> list[tuple[set, set]]:
    """Each time merger `name` set records aside: the folds it announced since the previous time,
    and the fold records in what it set aside (wal/discarded/<from index>[-n]/)."""
    out, announced = [], set()
    discarded = run_dir / name / "wal" / "discarded"
    taken: set[Path] = set()
    for event in read_events(run_dir / "logs" / f"{name}.log"):
        if event.get("event") == "fold":
            announced.add((event["fragment"], event["version"]))
        elif event.get("event") == "log_set_aside":
            folders = sorted(
                set(discarded.glob(f"{event['from_index']:012d}*")) - taken, key=lambda p: p.name
            )[:1]
            taken.update(folders)
            aside = {
                (r["fragment"], r["version"])
                for folder in folders
                for _, r in read_records(folder)
                if r.get("type") == "fold"
            }
            out.append((announced, aside))
            announced = set()
    return out


def _acked(islands: list[str], island_logs: dict, logged: collections.Counter) -> soakcheck.Check:
    """Each island's acknowledged deltas (its last life's `done`) against the final primary's log,
    and a `done` from every island."""
    dones = {
        name: done[-1]
        for name, events in island_logs.items()
        if (done := [e for e in events if e.get("event") == "done"])
    }
    missing = sorted(set(islands) - set(dones))
    acked = soakcheck.acked_in_log(dones, logged)
    if not missing:
        return acked
    return soakcheck.Check(
        acked.name, False, f"no `done` from {', '.join(missing)}; {acked.detail}"
    )


def _rate_checks(run_dir: Path, islands: list[str]) -> list[soakcheck.Check]:
    """The other islands' step rates through each fault (none when an island has no steps)."""
    steps, joins = step_times(run_dir, islands)
    executed = read_events(run_dir / "chaos.jsonl")
    if not all(steps.values()):
        return []
    span = (
        max(times[0] for times in steps.values() if times),
        min(times[-1] for times in steps.values() if times),
    )
    return [
        soakcheck.rates_kept(
            soakcheck.rate_ratios(steps, soakcheck.fault_intervals(executed, joins, span[1]), span)
        )
    ]


def _recovery(row: dict) -> str:
    if row.get("rejoined_s") is not None:
        return (
            f"rejoined {row['rejoined_s']:.1f} s, folded {row['first_fold_s']:.1f} s"
            if row.get("first_fold_s") is not None
            else f"rejoined {row['rejoined_s']:.1f} s, not folded again"
        )
    if row.get("first_fold_s") is not None:
        return f"next fold {row['first_fold_s']:.1f} s"
    return "-"


def write_up(
    run_dir: Path,
    config,
    faults,
    chaos: str,
    seed: int,
    minutes: float,
    code: int,
    checks,
    no_network: str | None,
) -> str:
    """OUT/soak.md: the checks first (what a user trusting the run needs), then each fault's row."""
    islands = [region.name for region in config.regions]
    rows = chaos_effects(run_dir, islands)
    failed = [c for c in checks if not c.ok and not c.timing]
    where = (
        "network namespaces"
        if no_network is None
        else f"loopback (no network faults: {no_network})"
    )
    intro = (
        f"`dloco experiment soak --minutes {minutes:g} --seed {seed}`: {len(faults)} faults over "
        f"{minutes:g} minutes, {len(islands)} islands ({', '.join(islands)}), a standby"
        f"{' (its lease in etcd)' if config.merger.etcd else ''}, {where}; "
        f"`dloco up` exited {code}."
    )
    verdict = (
        f"**{'PASSED' if not failed and code == 0 else 'FAILED'}**: "
        f"{len(checks) - len(failed)} of {len(checks)} checks hold"
        + (f"; failed: {', '.join(c.name for c in failed)}" if failed else "")
        + "."
    )
    lines = ["# Soak", "", intro, "", verdict, "", "| check | holds | detail |", "|---|---|---|"]
    lines += [
        f"| {c.name}{' (timing)' if c.timing else ''} | {'yes' if c.ok else '**no**'} "
        f"| {c.detail} |"
        for c in checks
    ]
    lines += ["", *_faults_section(faults, rows)]
    failover = ', failover = "etcd"' if config.merger.etcd else ""
    settings = f"`[merger] standby = true{failover}`, the tiny model" + (
        ', `[run] network = "netns"`' if no_network is None else ""
    )
    lines += [
        "",
        (
            f"Replay the same faults: `dloco up --chaos '{chaos}'` with the same cluster file "
            f"({settings}). Run directory: `{run_dir}`."
        ),
        "",
    ]
    return "\n".join(lines)


def _faults_section(faults, rows: list[dict]) -> list[str]:
    """OUT/soak.md's faults: a row per fault (the others' step rate during it, its recovery), then
    the others' step rates over all of them."""
    legend = (
        "Each fault and its recovery; the other islands' step rate over the whole fault against "
        "as long a stretch just before it (1.00 = undisturbed); the time from the recovery to the "
        "target's next folded delta (an island) or to the next fold (the broker), and for the "
        "primary merger from the fault to the next fold (the standby's, once it has taken over)."
    )
    lines = [
        "## Faults",
        "",
        legend,
        "",
        "| t (s) | fault | target | length (s) | others' step rate during | recovery |",
        "|---|---|---|---|---|---|",
    ]
    # each event's own text: exact
    by_when = {row["when"]: row for row in rows if "when" in row}
    for fault in faults:
        start, end = (str(event) for event in fault.events())
        row, back = by_when.get(start), by_when.get(end)
        during = row.get("during_absence") if row else None
        rates = (
            ", ".join(f"{n} {r:.2f}" for n, r in sorted(during.items()) if r is not None)
            if during
            else "-"
        )
        if row is None:
            recovery = "not executed"
        elif fault.target == "merger":
            recovery = _recovery({"first_fold_s": row.get("first_fold_s")}) + " after the fault"
        else:
            recovery = _recovery(back) if back else "not recovered"
        lines.append(
            f"| {fault.start_s:.0f} | {fault.kind} ({fault.action}) | {fault.target} "
            f"| {fault.length_s:.1f} | {rates} | {recovery} |"
        )
    ratios = [
        r for row in rows for r in (row.get("during_absence") or {}).values() if r is not None
    ]
    if ratios:
        lines += [
            "",
            (
                f"Others' step rate during a fault: median {statistics.median(ratios):.2f}x, "
                f"min {min(ratios):.2f}x over {len(ratios)} (island, fault) pairs."
            ),
        ]
    return lines
