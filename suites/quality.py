"""`dloco experiment quality`: the global model at the end of budgeted runs, per mode and budget.

Each run trains the cluster for a token budget (`[run] tokens`, PROTOCOL.md §6.1): every island's
inner rate decays over the cluster's progress towards it, so each run ends decayed, as a real
training run does.  The modes: `sync-dp` trained in one process (suites/inprocess.py: the cluster's
sync-dp arithmetic without the bus, whose loss per step does not depend on the link or the bus:
every step is one barrier-averaged step; `--sync-dp-on-bus` runs it as a cluster instead, about six
times slower), `sync-diloco` and `decoupled` over the profile's emulated links.  The table gives
the merger's final model's held-out loss at each budget and the gap to `sync-dp`; the plots, loss
against budget per mode (the usual scaling plot) and the global model against cluster tokens at the
largest budget.

The wall-clock claim at the largest budget, both ways: a short `sync-dp` run over the emulated
links (`sync-dp-linked`, bounded by LINKED_STEPS) gives sync-dp's seconds per step there; sync-dp's
time to decoupled's final loss is its full-speed run's steps to that loss times it (suites/
speedup.py), and decoupled's time to sync-dp's final loss is read off its global model's curve.

A run already finished in OUT (its report.md without FAILED, or an in-process sync-dp run's result)
is read back, not run again, whichever way it was made, so an interrupted suite resumes where it
stopped and repeats go to other OUT folders.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from dloco.cluster import config as cluster_config
from dloco.cluster.config import ClusterConfig
from dloco.cluster.sections import ModelSection
from dloco.protocol.errors import ConfigError, DlocoError
from dloco.suites import inprocess
from dloco.suites.qualityreport import LINKED, MODES, label, write_up
from dloco.suites.suiteresults import RunResult, collect, measure_global

# cluster tokens; 16 M is ~20 per parameter of the 0.87 M model
BUDGETS = (1_000_000, 4_000_000, 16_000_000)
# the quick model: 48 and 144 steps of each of four islands
QUICK_BUDGETS = (49_152, 147_456)
QUICK_MODEL = ModelSection(width=32, depth=1, heads=2, context=32, batch=8)
# H of the quick runs (half-speed regions: their own, scaled), so a small budget has rounds
QUICK_INTERVAL = 12
LINKED_STEPS, QUICK_LINKED_STEPS = 12, 6
# A run's time limit, from its budget: this many seconds per thousand cluster tokens, and at least
# MIN_LIMIT_S (the profile's cluster trains ~5 k tokens/s on two cores; sync-diloco's slowest round
# waits for its half-speed islands).
LIMIT_S_PER_KTOKEN, MIN_LIMIT_S = 1.0, 600.0


def _short(tokens: int) -> str:
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if tokens >= size and tokens % (size // 10) == 0:
            return f"{tokens / size:g}{unit}"
    return str(tokens)


def parse_budgets(text: str) -> tuple[int, ...]:
    """`1M,4M,16M` (K/M/G decimal) as token counts, each > 0, in increasing order."""
    budgets = []
    for part in text.split(","):
        part = part.strip()
        scale = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}.get(part[-1:], 1)
        try:
            value = float(part[:-1] if scale > 1 else part) * scale
        except ValueError:
            raise ConfigError(
                f"--budgets: {part!r} is not a number of tokens (e.g. 1M,4M,16M)"
            ) from None
        if not (value >= 1 and value == int(value)):
            raise ConfigError(f"--budgets: {part!r} is not a positive whole number of tokens")
        budgets.append(int(value))
    if budgets != sorted(set(budgets)):
        raise ConfigError(f"--budgets must increase and not repeat, got {text!r}")
    return tuple(budgets)


def _unlinked(c: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(
        c,
        regions=tuple(
            dataclasses.replace(r, uplink_mbps=None, downlink_mbps=None, rtt_ms=0.0)
            for r in c.regions
        ),
    )


def _quick(c: ClusterConfig) -> ClusterConfig:
    regions = tuple(
        (
            dataclasses.replace(
                r, interval=max(c.sync.fragments, r.interval * QUICK_INTERVAL // c.sync.interval)
            )
            if r.interval
            else r
        )
        for r in c.regions
    )
    return dataclasses.replace(
        c,
        model=QUICK_MODEL,
        eval_every=12,
        sync=dataclasses.replace(c.sync, interval=QUICK_INTERVAL),
        regions=regions,
    )


def plan(
    base: ClusterConfig, budgets: tuple[int, ...], quick: bool, modes: tuple[str, ...] = MODES
) -> list[tuple[str, ClusterConfig]]:
    """The suite's runs: every mode at every budget, then the short linked sync-dp run."""
    base = dataclasses.replace(
        _quick(base) if quick else base, chaos=(), max_steps=0, eval_trace=0, eval_early=False
    )
    runs = []
    for budget in budgets:
        for mode in modes:
            config = base.with_mode(mode).with_tokens(budget)
            config = _unlinked(config) if mode == "sync-dp" else config
            runs.append(
                (
                    label(mode, budget),
                    dataclasses.replace(
                        config, duration_s=max(MIN_LIMIT_S, LIMIT_S_PER_KTOKEN * budget / 1000)
                    ),
                )
            )
    if "sync-dp" in modes:
        steps = QUICK_LINKED_STEPS if quick else LINKED_STEPS
        # evaluated four times: its seconds per step are read between the first and the last
        runs.append(
            (
                LINKED,
                dataclasses.replace(
                    base.with_mode("sync-dp"),
                    max_steps=steps,
                    eval_every=steps // 4,
                    duration_s=MIN_LIMIT_S * 2,
                ),
            )
        )
    return runs


def run(out_dir: Path, **options) -> str:
    """run_suite's Markdown."""
    return run_suite(out_dir, **options)[0]


def in_process_result(name: str, config: ClusterConfig, run_dir: Path, log) -> RunResult:
    """A budgeted sync-dp run trained in one process (or read back from RUN_DIR), as a suite result:
    every island holds the shared model, so each has its curve."""
    done = inprocess.InProcessRun.load(run_dir)
    if done is None or done.budget != config.tokens:
        log(f"dloco experiment quality: {name} in one process (suites/inprocess.py) -> {run_dir}")
        done = inprocess.train_sync_dp(config, log=log)
        done.save(run_dir)
    evals = {
        r.name: [
            {
                "step": p["step"],
                "tokens": p["cluster_tokens"] // done.islands,
                "since_start": p["since_start"],
                "eval_loss": p["eval_loss"],
            }
            for p in done.curve
        ]
        for r in config.regions
    }
    last = {
        r.name: {"step": done.rounds, "tokens": done.cluster_tokens // done.islands}
        for r in config.regions
    }
    result = RunResult(name, config, 0, done.before, done.after, evals, last, run_dir=run_dir)
    result.global_curve = [
        {
            "since_start": p["since_start"],
            "cluster_tokens": p["cluster_tokens"],
            "eval_loss": p["eval_loss"],
        }
        for p in done.curve
    ]
    return result


def run_suite(
    out_dir: Path,
    quick: bool = False,
    config_path: Path | None = None,
    budgets: tuple[int, ...] | None = None,
    only: tuple[str, ...] | None = None,
    sync_dp_on_bus: bool = False,
    log=lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[str, list]:
    """Run (or read back) every run of the suite into OUT/quality/<label>; write OUT/quality.md and
    OUT/experiments/quality_*.png; return the Markdown and each run's results."""
    budgets = budgets or (QUICK_BUDGETS if quick else BUDGETS)
    runs = _selected(plan(cluster_config.load(config_path), budgets, quick), only)
    started, results = time.monotonic(), []
    for index, (name, config) in enumerate(runs, 1):
        run_dir = out_dir / "quality" / name
        report = run_dir / "report.md"
        finished = report.exists() and "\n## FAILED\n" not in report.read_text()
        read_back = (run_dir / inprocess.RESULT).exists()
        train_here = config.mode == "sync-dp" and config.tokens and not (sync_dp_on_bus or finished)
        # an in-process sync-dp run: read back, or trained in one process now
        if read_back or train_here:
            results.append(in_process_result(name, config, run_dir, log))
            continue
        if finished:
            log(
                f"dloco experiment quality: run {index}/{len(runs)} {name}: finished before, read"
                f" back from {run_dir}"
            )
        else:
            _launch(name, config, run_dir, f"{index}/{len(runs)}", log)
        results.append(collect(name, config, run_dir, 0))
    log(
        "dloco experiment quality: evaluating the merger's model during each run (replaying its"
        " log)"
    )
    budgeted = [r for r in results if r.config.tokens and not r.global_curve]
    # each run's own curve: equal tokens are its budget, not the suite's smallest run
    for r in budgeted:
        measure_global([r], log=log)
    command = (
        "dloco experiment quality"
        + (" --quick" if quick else "")
        + (" --sync-dp-on-bus" if sync_dp_on_bus else "")
        + (
            f" --budgets {','.join(_short(b) for b in budgets)}"
            if budgets not in (BUDGETS, QUICK_BUDGETS)
            else ""
        )
        + (f" --runs {','.join(only)}" if only else "")
    )
    return write_up(results, command, time.monotonic() - started, out_dir), results


def _selected(
    runs: list[tuple[str, ClusterConfig]], only: tuple[str, ...] | None
) -> list[tuple[str, ClusterConfig]]:
    """The suite's runs, only those named in `only` if given."""
    if only is None:
        return runs
    unknown = sorted(set(only) - {name for name, _ in runs})
    if unknown or not only:
        raise ConfigError(
            f"experiment quality has no run {', '.join(unknown) or '(none given)'}; "
            f"its runs: {', '.join(name for name, _ in runs)}"
        )
    return [(name, config) for name, config in runs if name in only]


def _launch(name: str, config: ClusterConfig, run_dir: Path, position: str, log) -> None:
    """Run `name`, the suite's run at `position` (3/7), on the cluster (`dloco up` into RUN_DIR);
    DlocoError if it failed."""
    from dloco.cluster import launcher

    bound = (
        f"{config.tokens:,} cluster tokens"
        if config.tokens
        else f"{config.max_steps} steps per island"
    )
    log(
        f"dloco experiment quality: run {position} {name} ({bound}, at most"
        f" {config.duration_s:.0f} s) -> {run_dir}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "up.out", "w") as out:
        code = launcher.run(config, run_dir, out=out)
    if code != 0:
        raise DlocoError(
            f"quality: run {name} failed (exit {code}); see {run_dir / 'report.md'}. Nothing is"
            " tabulated; the runs that finished are read back when the suite is run again with"
            " this --out"
        )
