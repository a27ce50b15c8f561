"""The quality suite's measures and write-up (suites/quality.py runs it): the table of the final
global model's test loss per mode and budget (mean and standard deviation over seeds) with the gaps
to sync-dp and sync-diloco paired by seed, a tuning grid's table (validation), the planner's q(H)
against data parallelism, the wall-clock claim both ways; suites/qualityplots.py draws the plots."""

# Over 400 lines: every table of the quality write-up, each read through the same grouping of runs
# by mode, budget, setting and seed (by_setting, paired_gap), so that no two tables disagree on it.

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from dloco.sim.quality import factor_from_loss, slope_per_doubling
from dloco.suites import linkcurve, speedup, wallclock
from dloco.suites.suiteresults import RunResult, bytes_per_token

MODES = ("sync-dp", "sync-diloco", "decoupled")
# a short sync-avg run over the emulated links: data parallelism's seconds per step there
LINKED = "sync-avg-linked"


def label(mode: str, budget: int, seed: int = 0, tag: str = "") -> str:
    """A budgeted run's label, e.g. decoupled@4M; a tuning run's setting and a seed other than 0
    follow: sync-dp@2M-lr0.006-s1."""
    name = f"{mode}@{budget}"
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if budget >= size and budget % (size // 10) == 0:
            name = f"{mode}@{budget / size:g}{unit}"
            break
    return name + (f"-{tag}" if tag else "") + (f"-s{seed}" if seed else "")


def tag_of(result: RunResult) -> str:
    """The setting a tuning run's label names ("" for the suite's own runs)."""
    rest = result.label.partition("@")[2].partition("-")[2]
    return re.sub(r"(^|-)s\d+$", "", rest)


def reported(result: RunResult, split: str = "test") -> float | None:
    """The final model's loss on a whole split (test: the reported figure)."""
    value = result.final.get(split) if result.final else None
    return value if value is not None and math.isfinite(value) else None


def spread(values: list[float]) -> tuple[float, float] | None:
    """(mean, sample standard deviation; 0 for one value) of the finite values, or None for
    none."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def by_setting(results: list[RunResult]) -> dict[tuple[str, int, str], list[RunResult]]:
    """(mode, budget, tag) -> its runs, one per seed."""
    groups: dict[tuple[str, int, str], list[RunResult]] = {}
    for r in results:
        if r.config.tokens:
            groups.setdefault((r.config.mode, r.config.tokens, tag_of(r)), []).append(r)
    return groups


def paired_gap(
    runs: list[RunResult], references: list[RunResult], split: str = "test"
) -> tuple[float, float, int] | None:
    """(mean, sd, seeds) of the gap to the reference over the seeds both have (each seed's runs
    share the initial model and every island's data order)."""
    by_seed = {r.config.seed: reported(r, split) for r in references}
    gaps = [
        gap(reported(r, split), by_seed.get(r.config.seed))
        for r in runs
        if r.config.seed in by_seed
    ]
    gaps = [g for g in gaps if g is not None]
    stats = spread(gaps)
    return None if stats is None else (*stats, len(gaps))


def _mean_sd(runs: list[RunResult] | None, split: str = "test") -> str:
    stats = spread([v for r in runs or [] if (v := reported(r, split)) is not None])
    if stats is None:
        return "n/a"
    return f"{stats[0]:.4f} ± {stats[1]:.4f} ({len(runs)})" if len(runs) > 1 else f"{stats[0]:.4f}"


def _gap_cell(found: tuple[float, float, int] | None) -> str:
    if found is None:
        return "n/a"
    mean, sd, seeds = found
    return f"{mean:+.2%} ± {sd:.2%}" if seeds > 1 else f"{mean:+.2%}"


def wall_clock(results: list[RunResult]) -> dict:
    """The speedup both ways at the largest budget (None where a run is missing or never got
    there): sync-dp's seconds over the emulated links to decoupled's final loss, decoupled's to
    sync-dp's, and their ratios to the other mode's own time."""
    by_label = {r.label: r for r in results}
    linked = by_label.get(LINKED)
    budget = max((r.config.tokens for r in results), default=0)
    dp, dec = by_label.get(label("sync-dp", budget)), by_label.get(label("decoupled", budget))
    if (
        linked is None
        or dp is None
        or dec is None
        or dp.global_after is None
        or dec.global_after is None
    ):
        return {}
    per_step = speedup.seconds_per_step(linked.evals)
    curve = speedup.mean_curve(dp.evals)
    dp_steps = max((e.get("step", 0) for e in dp.last.values()), default=0)
    dp_to_dec = speedup.steps_to(curve, dec.global_after)
    dec_seconds = max((p["since_start"] for p in dec.global_curve), default=None)
    dec_to_dp = wallclock.seconds_on(dec.global_curve, dp.global_after)
    out = {
        "budget": budget,
        "seconds_per_step_linked": per_step,
        "decoupled_seconds": dec_seconds,
        "sync_dp_seconds": per_step * dp_steps if per_step else None,
        "sync_dp_to_decoupled_final_s": (
            dp_to_dec * per_step if dp_to_dec is not None and per_step else None
        ),
        "decoupled_to_sync_dp_final_s": dec_to_dp,
    }
    if out["sync_dp_to_decoupled_final_s"] and dec_seconds:
        out["speedup_to_decoupled_final"] = out["sync_dp_to_decoupled_final_s"] / dec_seconds
    if out["sync_dp_seconds"] and dec_to_dp:
        out["speedup_to_sync_dp_final"] = out["sync_dp_seconds"] / dec_to_dp
    return out


def gap(loss: float | None, reference: float | None) -> float | None:
    """(loss - reference) / reference: how much worse than the reference (negative: better)."""
    if loss is None or reference is None or not math.isfinite(loss) or reference <= 0:
        return None
    return (loss - reference) / reference


def _cell(value: float | None, form: str = ".3f") -> str:
    return "n/a" if value is None else format(value, form)


def table(results: list[RunResult]) -> list[str]:
    """Per budget, each mode's final test loss (mean ± sd over seeds, their count) and decoupled's
    gaps to the baselines, paired by seed."""
    groups = {key: runs for key, runs in by_setting(results).items() if not key[2]}
    budgets = sorted({budget for _, budget, _ in groups})
    modes = [m for m in MODES if any((m, b, "") in groups for b in budgets)]
    lines = [
        "| budget (cluster tokens) | "
        + " | ".join(f"{m}: test loss" for m in modes)
        + " | decoupled vs sync-dp | decoupled vs sync-diloco | decoupled islands busy |"
        " decoupled bytes / token |",
        "|---|" + "---|" * (len(modes) + 4),
    ]
    for budget in budgets:
        runs = {m: groups.get((m, budget, "")) for m in modes}
        decoupled = runs.get("decoupled") or []
        busy = min(
            (e.get("compute_util", 1.0) for r in decoupled for e in r.last.values()),
            default=None,
        )
        # bytes sent and received by the islands per token they trained, mean over seeds
        per_token = spread([bytes_per_token(r) for r in decoupled])
        lines.append(
            f"| {budget:,} | "
            + " | ".join(_mean_sd(runs[m]) for m in modes)
            + f" | {_gap_cell(paired_gap(decoupled, runs.get('sync-dp') or []))}"
            + f" | {_gap_cell(paired_gap(decoupled, runs.get('sync-diloco') or []))} |"
            f" {_cell(busy, '.2f')} | {_cell(per_token and per_token[0], '.1f')} |"
        )
    return lines


def up_down(result: RunResult, params: int | None = None) -> tuple[float, float] | None:
    """Bytes the islands sent and received per token they trained.  sync-dp trains in one process,
    so its bytes are counted as this system's hub would move them (suites/wallclock.py): every
    island its fp32 gradient up and the result down each step, with `params`; None without."""
    tokens = sum(e.get("tokens", 0) for e in result.last.values())
    if not tokens:
        return None
    if result.config.mode == "sync-dp":
        if params is None:
            return None
        steps = sum(e.get("step", 0) for e in result.last.values())
        moved = steps * wallclock.FP32_BYTES * params / tokens
        return moved, moved
    return linkcurve.up_down_per_token(result)


def bytes_table(results: list[RunResult], params: int | None = None) -> list[str]:
    """Per budget, each mode's bytes per trained token up and down (mean over seeds)."""
    groups = {key: runs for key, runs in by_setting(results).items() if not key[2]}
    budgets = sorted({budget for _, budget, _ in groups})
    modes = [m for m in MODES if any((m, b, "") in groups for b in budgets)]
    if not modes:
        return []

    def cell(runs: list[RunResult] | None) -> str:
        found = [ud for r in runs or [] if (ud := up_down(r, params)) is not None]
        if not found:
            return "n/a"
        up, down = (statistics.fmean(ud[k] for ud in found) for k in (0, 1))
        return f"{up:,.1f} / {down:,.1f}"

    return [
        "| budget (cluster tokens) | "
        + " | ".join(f"{m}: bytes / token up / down" for m in modes)
        + " |",
        "|---|" + "---|" * len(modes),
        *(
            f"| {budget:,} | " + " | ".join(cell(groups.get((m, budget, ""))) for m in modes) + " |"
            for budget in budgets
        ),
        "",
    ]


def tuning_table(results: list[RunResult]) -> list[str]:
    """A tuning grid's runs: each setting's final loss on the whole validation split (what the
    choice reads; mean ± sd (seeds) where it ran more than one), by mode, best first."""
    groups = by_setting(results)
    rows = sorted(
        (
            (spread([v for r in runs if (v := reported(r, "validation")) is not None]), key)
            for key, runs in groups.items()
            if key[2]
        ),
        # by mode, each mode's best first
        key=lambda row: (row[1][0], row[0][0] if row[0] else math.inf),
    )
    if not rows:
        return []
    lines = ["| run | setting | validation loss (whole split) |", "|---|---|---|"]
    for _, key in rows:
        mode, budget, tag = key
        lines.append(f"| {label(mode, budget)} | {tag} | {_mean_sd(groups[key], 'validation')} |")
    return [*lines, ""]


# a decoupled tuning run's tag at some H and outer lr, and an outer momentum or a number of
# fragments other than the profile's (suites/qualityplan.py DECOUPLED_GRID)
DECOUPLED_TAG = re.compile(r"^h(\d+)-lr([0-9.]+)(-m[0-9.]+)?(-p\d+)?$")


def decoupled_setting(result: RunResult) -> tuple[int, float] | None:
    """(H, outer lr) of a decoupled run: the suite's own run's, or the ones its tuning tag names.
    None for another mode, and for a run at another outer momentum or number of fragments than
    the profile's: the planner's curve is the profile's outer step and fragments at each H."""
    if result.config.mode != "decoupled":
        return None
    sync, merger = result.config.effective()
    found = DECOUPLED_TAG.match(tag_of(result))
    if found and (found[3] or found[4]):
        return None
    return (int(found[1]), float(found[2])) if found else (sync.interval, merger.outer_lr)


def quality_curve(results: list[RunResult], split: str = "validation") -> list[tuple]:
    """The planner's q(H) (sim/quality.py) from the runs: at each budget where sync-dp ran, the
    tokens sync-dp needs to reach decoupled's final loss at interval H, over decoupled's budget.
    sync-dp's loss between budgets follows its fall per doubling from its smallest budget to its
    largest (at least two).  Rows (budget, H, outer lr, runs, loss, sync-dp's loss, q), means over
    seeds."""
    groups = by_setting(results)
    dp = {
        budget: stats[0]
        for (mode, budget, tag), runs in groups.items()
        if mode == "sync-dp" and not tag
        if (stats := spread([v for r in runs if (v := reported(r, split)) is not None]))
    }
    if len(dp) < 2:
        return []
    slope = slope_per_doubling(*((b, dp[b]) for b in (min(dp), max(dp))))
    losses: dict[tuple[int, int, float], list[float]] = {}
    for r in results:
        setting, loss = decoupled_setting(r), reported(r, split)
        if setting and loss is not None and r.config.tokens in dp:
            losses.setdefault((r.config.tokens, *setting), []).append(loss)
    rows = []
    for (budget, h, lr), values in sorted(losses.items()):
        loss = statistics.fmean(values)
        q = factor_from_loss(loss, dp[budget], slope)
        rows.append((budget, h, lr, len(values), loss, dp[budget], q))
    return rows


def quality_curve_table(results: list[RunResult]) -> list[str]:
    rows = quality_curve(results)
    if not rows:
        return []
    lines = [
        "| budget | decoupled: H | outer lr | runs | validation loss | sync-dp's validation loss |"
        " q: sync-dp's tokens to that loss / budget |",
        "|---|---|---|---|---|---|---|",
    ]
    for budget, h, lr, n, loss, dp, q in rows:
        lines.append(f"| {budget:,} | {h} | {lr:g} | {n} | {loss:.4f} | {dp:.4f} | {q:.3f} |")
    return [*lines, ""]


# decoupled within 1.5 % of sync-dp; >= 20x sooner to a final loss
QUALITY_GOAL, SPEEDUP_GOAL = 0.015, 20.0


def goal_lines(results: list[RunResult]) -> list[str]:
    """The suite's goals at the largest budget, each met or missed and by how much (a goal whose
    runs are missing is not judged).  Quality is judged on the test split, paired by seed: within
    1.5 % of sync-dp only if the mean gap plus one standard deviation is."""
    groups = {key: runs for key, runs in by_setting(results).items() if not key[2]}
    budget = max((b for _, b, _ in groups), default=0)
    decoupled = groups.get(("decoupled", budget, ""), [])
    lines = []
    if found := paired_gap(decoupled, groups.get(("sync-dp", budget, ""), [])):
        mean, sd, seeds = found
        met = mean + sd <= QUALITY_GOAL
        lines.append(
            f"- goal, decoupled within {QUALITY_GOAL:.1%} of sync-dp (test, {seeds} seed"
            f"{'s' if seeds > 1 else ''}): {'met' if met else 'MISSED'} ({_gap_cell(found)})"
        )
    if found := paired_gap(decoupled, groups.get(("sync-diloco", budget, ""), [])):
        lines.append(
            f"- goal, decoupled no worse than sync-diloco (test):"
            f" {'met' if found[0] <= 0 else 'MISSED'} ({_gap_cell(found)})"
        )
    clock = wall_clock(results)
    best = max(
        (
            clock[k]
            for k in ("speedup_to_decoupled_final", "speedup_to_sync_dp_final")
            if clock.get(k)
        ),
        default=None,
    )
    if best is not None:
        verdict = "met" if best >= SPEEDUP_GOAL else f"MISSED by {SPEEDUP_GOAL / best:.1f}x"
        lines.append(
            f"- goal, decoupled >= {SPEEDUP_GOAL:g}x sooner to a final loss: {verdict} (best of the"
            f" two ways: {best:.1f}x)"
        )
    return [*lines, ""] if lines else []


def bandwidth_lines(results: list[RunResult]) -> list[str]:
    """The wall clock like for like at the largest budget (suites/wallclock.py), from the seed-0
    sync-dp and decoupled runs; nothing without them."""
    budget = max((r.config.tokens for r in results), default=0)
    by_label = {r.label: r for r in results}
    dp, dec = by_label.get(label("sync-dp", budget)), by_label.get(label("decoupled", budget))
    if dp is None or dec is None or not dec.global_curve or not dec.evals:
        return []
    x = wallclock.exchange_of(dec, wallclock.params_of(dec.config))
    rows = wallclock.curve_rows(speedup.mean_curve(dp.evals), dec.global_curve, x)
    return wallclock.table(rows, x) + wallclock.utilisation_table(x)


def claim_lines(results: list[RunResult]) -> list[str]:
    clock = wall_clock(results)
    if not clock:
        return [
            "The wall-clock claim needs the largest budget's sync-dp and decoupled runs and"
            f" `{LINKED}`."
        ]
    return [
        (
            f"At {clock['budget']:,} cluster tokens, with sync-dp's"
            f" {_cell(clock['seconds_per_step_linked'], '.1f')} s per step over the profile's"
            f" emulated links (`{LINKED}`):"
        ),
        "",
        (
            "- sync-dp would reach decoupled's final loss in"
            f" {_cell(clock['sync_dp_to_decoupled_final_s'], ',.0f')} s, against decoupled's"
            f" {_cell(clock['decoupled_seconds'], ',.0f')} s:"
            f" **{_cell(clock.get('speedup_to_decoupled_final'), '.1f')}x**;"
        ),
        (
            "- decoupled reached sync-dp's final loss in"
            f" {_cell(clock['decoupled_to_sync_dp_final_s'], ',.0f')} s (n/a: never), against"
            f" sync-dp's {_cell(clock['sync_dp_seconds'], ',.0f')} s:"
            f" **{_cell(clock.get('speedup_to_sync_dp_final'), '.1f')}x**."
        ),
        "",
    ]


def write_up(
    results: list[RunResult], command: str, seconds: float, out_dir: Path, plots: list[Path]
) -> str:
    """OUT/quality.md, which shows `plots` (suites/qualityplots.py drew them into
    OUT/experiments/); returns the Markdown."""
    params = wallclock.params_of(results[0].config) if results else None
    text = "\n".join(
        [
            "## Quality at equal tokens, each run decayed over its budget",
            "",
            (
                "The final global model of runs bounded by a cluster token budget (every island's"
                " inner rate decays over the cluster's progress towards it, PROTOCOL.md §6.1),"
                " evaluated on the whole test split: mean ± standard deviation over seeds (their"
                " count), gaps paired by seed. sync-dp is data parallelism, one AdamW on the"
                " all-reduced gradient of the global batch, trained in one process"
                " (suites/inprocess.py)."
            ),
            "",
            *table(results),
            "",
            *bytes_table(results, params),
            *tuning_table(results),
            *quality_curve_table(results),
            *goal_lines(results),
            *claim_lines(results),
            *bandwidth_lines(results),
            *(f"![{p.name}](experiments/{p.name})" for p in plots),
            "",
            f"Command: `{command}` ({seconds / 60:.0f} min).",
            "",
        ]
    )
    (out_dir / "quality.md").write_text(text)
    return text
