"""The report a run leaves behind: report.md with a table per island and for the global model, and
PNG plots (analysis/plots.py: held-out loss against wall clock and tokens, bytes on the wire,
compute utilisation)."""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

from dloco.analysis import sampling
from dloco.analysis.globalmodel import Evaluator
from dloco.analysis.plots import write_plots
from dloco.analysis.runinfo import (
    RunTask,
    chaos_effects,
    last_step,
    lives,
    merger_folds,
    read_events,
    read_metrics,
)
from dloco.protocol.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class IslandOutline:
    """One island as the report lists it: its plan, not what it did."""

    name: str
    # its slowdown, and its CPU quota where the run set one
    speed: str
    # H, its inner steps between two sends of a fragment
    interval: int
    uplink_mbps: float | None
    downlink_mbps: float | None
    rtt_ms: float


@dataclasses.dataclass(frozen=True)
class RunOutline:
    """What a run was set up to do, in plain values (cluster.records.outline makes it from a cluster
    file): the report reads everything else from the run directory."""

    mode: str
    duration_s: float
    # 0: bounded by the clock alone
    max_steps: int
    islands: tuple[IslandOutline, ...]
    task: RunTask

    @property
    def names(self) -> list[str]:
        return [island.name for island in self.islands]


def global_eval(task: RunTask, run_dir: Path) -> tuple[dict[str, float], dict[str, float] | None]:
    """Held-out loss and metrics ({"loss": ..., name: ...}) of the initial model and of the merger's
    final global model (None without a checkpoint), on the islands' held-out batches."""
    evaluator = Evaluator(task, run_dir)
    return evaluator.initial(), evaluator.final()


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _chaos_section(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "## Chaos",
        "",
        (
            "What each kill -9 / restart did to the rest: the other islands' step rates in the"
            " seconds after the event relative to the seconds before (1.00 = undisturbed), the"
            " merger's folds in those windows, and the recovery."
        ),
        "",
        (
            "| t (s) | event | other islands' step rate after/before | folds before/after |"
            " contributors after | recovery |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = ", ".join(
            f"{name} {r['ratio']:.2f}" if r["ratio"] is not None else f"{name} (not yet stepping)"
            for name, r in row["others"].items()
        )
        recovery = ""
        if "rejoined_s" in row:
            recovery = (
                f"rejoined after {_seconds(row['rejoined_s'])}; first delta folded after"
                f" {_seconds(row['first_fold_s'])}"
            )
        elif "first_fold_s" in row:
            recovery = f"next fold after {_seconds(row['first_fold_s'])}"
        window = f"{row['window_s'][0]:.0f}/{row['window_s'][1]:.0f} s"
        lines.append(
            f"| {row['at_s']:.1f} | {row['action']} {row['target']} | {ratios or '-'} |"
            f" {row['folds_before']}/{row['folds_after']} (windows {window}) |"
            f" {', '.join(row['contributors_after']) or '-'} | {recovery or '-'} |"
        )
    return lines + [""]


def read_exit_codes(run_dir: Path) -> tuple[float | None, dict[str, int | None]]:
    """The planned length (seconds) and each process's exit status as write_report put them in
    report.md (its first line, the islands' table, the global model's): (seconds, {name: code}),
    None where the report says None (a process never started or stopped).  Raises ConfigError
    when a status cell is not one."""
    codes, section, planned, header, fence = {}, None, None, False, None
    for line in (run_dir / "report.md").read_text().splitlines():
        # a code block (the closing sample) is text, never a heading or a table
        if fence is not None:
            fence = None if line.strip() == fence else fence
            continue
        if match := re.match(r"(`{3,}|~{3,})", line):
            fence = match.group(1)
            continue
        if planned is None and (match := re.search(r"planned length (\d+(?:\.\d+)?) s", line)):
            planned = float(match.group(1))
        if line.startswith("## "):
            section, header = line, True
        elif line.startswith("|---"):
            continue
        elif line.startswith("| "):
            # a table's first row names its columns
            if header:
                header = False
                continue
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if section == "## Islands":
                codes[cells[0]] = _code(cells[-1], run_dir)
            elif section and section.startswith("## Global model"):
                codes["merger"], codes["broker"] = (
                    _code(cells[-2], run_dir),
                    _code(cells[-1], run_dir),
                )
    return planned, codes


def _code(cell: str, run_dir: Path) -> int | None:
    if cell == "None":
        return None
    try:
        return int(cell)
    except ValueError:
        raise ConfigError(f"{run_dir / 'report.md'}: {cell!r} is not an exit status") from None


def warnings(initial: float, final: float | None, islands: dict[str, float]) -> list[str]:
    """Loud lines for a global model that ended worse than it started, or worse than every island's
    last held-out loss: the merger's settings (an outer lr that overshoots, say) cost the model what
    the islands gained.  Such a run still exits 0 (its processes did their work); the report and
    the run's last line say so."""
    if final is None:
        return []
    found = []
    if final > initial:
        found.append(
            f"the global model ended worse than it started: held-out loss {initial:.3f} →"
            f" {final:.3f}"
        )
    if islands and final > max(islands.values()):
        found.append(
            f"the global model ({final:.3f}) ended worse than every island's last held-out loss "
            f"({', '.join(f'{name} {loss:.3f}' for name, loss in sorted(islands.items()))})"
        )
    if not found:
        return []
    return [
        "## WARNING: the global model",
        "",
        *(f"- {line}" for line in found),
        (
            "- the islands trained and the merging lost it: the outer step's settings ([merger]"
            " outer_lr, max_staleness) decide it, and a cluster file without [merger] gets the"
            ' processes\' defaults (EXPERIMENTS.md "Quality" has what was measured)'
        ),
        "",
    ]


def write_report(
    plan: RunOutline, run_dir: Path, exit_codes: dict[str, int], problems: list[str] = ()
) -> Path:
    """report.md and plots/.  `problems`: why the run failed (analysis.verdict), listed first."""
    metrics = {name: read_metrics(run_dir / "metrics" / f"{name}.jsonl") for name in plan.names}
    folds = merger_folds(run_dir)
    evaluator = Evaluator(plan.task, run_dir)
    before, after = evaluator.initial(), evaluator.final()
    lines = [
        "# dloco run report",
        "",
        f"Run directory: `{run_dir}`; mode `{plan.mode}`; {len(plan.islands)} regions; planned"
        f" length {plan.duration_s:.0f} s"
        + (f" at most, {plan.max_steps} steps per island." if plan.max_steps else "."),
        "",
    ]
    if problems:
        lines += ["## FAILED", "", *(f"- {problem}" for problem in problems), ""]
    islands, island_finals = _islands_table(plan, metrics, folds, exit_codes)
    lines += islands
    lines += _global_table(folds, before, after, exit_codes)
    lines += warnings(before["loss"], after and after["loss"], island_finals)
    lines += _chaos_section(chaos_effects(run_dir, plan.names))
    global_curve = [
        e for e in read_events(run_dir / "global.jsonl") if "eval_loss" in e and "wall" in e
    ]
    if global_curve:
        lines += [
            (
                f"The global model during the run: {len(global_curve)} evaluations by the evaluator"
                f" (it follows the snapshot bus), held-out loss {global_curve[0]['eval_loss']:.3f}"
                f" → {global_curve[-1]['eval_loss']:.3f} at versions"
                f" {global_curve[-1].get('versions')}."
            ),
            "",
        ]
    lines += ["## Plots", ""] + [
        f"![{p}]({p})" for p in write_plots(run_dir, metrics, global_curve)
    ]
    lines += [
        "",
        (
            "Logs: `logs/<process>.log` (JSON lines); island metrics: `metrics/<region>.jsonl`; the"
            " merger's write-ahead log and checkpoints: `merger/` (`dloco replay` rebuilds the"
            " model from it; `dloco export` writes it as safetensors)."
        ),
        "",
    ]
    # last: the sample's text may be anything, and the tables above are read back (read_exit_codes)
    if after is not None:
        lines += sampling.report_lines(plan.task, run_dir, evaluator.trainer)
    report = run_dir / "report.md"
    report.write_text("\n".join(lines))
    return report


def _islands_table(
    plan: RunOutline, metrics: dict[str, list[dict]], folds: list[dict], exit_codes: dict
) -> tuple[list[str], dict[str, float]]:
    """The islands' table (read back by read_exit_codes), and each island's last held-out loss."""
    folded_by = collections.Counter(name for fold in folds for name in fold["contributors"])
    lines = [
        "## Islands",
        "",
        (
            "| region | slowdown | H | link up/down Mbit/s, RTT | steps | tokens | steps/s |"
            " compute util | last loss | last held-out loss | bytes sent | bytes received | deltas"
            " folded | exit |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    island_finals = {}
    for region in plan.islands:
        events = [e for e in metrics[region.name] if "step" in e]
        # a restarted island: its last life's step and rate, every life's tokens and bytes
        last = last_step(lives(events))
        evals = [e["eval_loss"] for e in events if "eval_loss" in e]
        if evals:
            island_finals[region.name] = evals[-1]
        seconds = last.get("time", 0) or float("nan")
        lines.append(
            f"| {region.name} | {region.speed} | {region.interval} |"
            f" {region.uplink_mbps or '∞'}/{region.downlink_mbps or '∞'},"
            f" {region.rtt_ms:.0f} ms |"
            f" {last.get('step', 0)} | {last.get('tokens', 0):,} |"
            f" {last.get('step', 0) / seconds:.2f} | {last.get('compute_util', float('nan')):.3f} |"
            f" {last.get('loss', float('nan')):.3f} | {evals[-1] if evals else float('nan'):.3f} |"
            f" {last.get('bytes_sent', 0):,} | {last.get('bytes_received', 0):,} |"
            f" {folded_by.get(region.name, 0)} | {exit_codes.get(region.name)} |"
        )
    return lines, island_finals


def _global_table(
    folds: list[dict], before: dict[str, float], after: dict[str, float] | None, exit_codes: dict
) -> list[str]:
    """The global model's table (read back by read_exit_codes), and its other held-out metrics."""
    versions = collections.defaultdict(int)
    for fold in folds:
        versions[fold["fragment"]] = max(versions[fold["fragment"]], fold["version"])
    lines = [
        "",
        "## Global model (the merger's)",
        "",
        (
            "| folds | fragment versions | held-out loss, initial | held-out loss, final | merger"
            " exit | broker exit |"
        ),
        "|---|---|---|---|---|---|",
        (
            f"| {len(folds)} | {dict(sorted(versions.items()))} | {before['loss']:.3f} |"
            f" {after if after is None else round(after['loss'], 3)} | {exit_codes.get('merger')} |"
            f" {exit_codes.get('broker')} |"
        ),
        "",
    ]
    if extra := [name for name in before if name != "loss"]:
        held = ", ".join(
            f"{name} {before[name]:.4g} → {after[name]:.4g}"
            if after
            else f"{name} {before[name]:.4g} (initial)"
            for name in extra
        )
        lines += [f"Held-out {held} (initial → final global model).", ""]
    return lines
