"""`dloco experiment quality`: the global model at the end of budgeted runs, per mode and budget,
with seeds, on a test split that no setting was chosen on.

Each run trains the cluster for a token budget (`[run] tokens`, PROTOCOL.md §6.1): every island's
inner rate decays over the cluster's progress towards it, so each run ends decayed, as a real
training run does.  The modes: `sync-dp`, data parallelism (one AdamW on the all-reduced gradient
of the global batch), trained in one process (suites/inprocess.py) at its tuned peak rate;
`sync-diloco` at its tuned outer step (both: suites/qualityplan.py `Settings`) and `decoupled`,
both over the profile's emulated links.  Every run's final model is evaluated on the whole
validation and test splits (island/data.py): the tables report test, the tuning grids (`--tune`)
read validation.  Seeds vary
the model's initialisation and every island's data order; a table gives each mode's mean and
standard deviation over them and each difference paired by seed.

The wall-clock claim at the largest budget, both ways: a short `sync-avg` run over the emulated
links (`sync-avg-linked`, bounded by LINKED_STEPS: the bytes and barrier of an fp32 all-reduce
through the hub every step) gives data parallelism's seconds per step there; sync-dp's time to
decoupled's final loss is its steps to that loss times it (suites/speedup.py), and decoupled's
time to sync-dp's final loss is read off its global model's curve.

A run already finished in OUT (its report.md without FAILED, or an in-process run's result) is
read back, not run again, so an interrupted suite resumes where it stopped.  Each run's result
(its curves, final losses, settings and commit: suites/qualityrecords.py) goes to `--results DIR`
as it lands; `--from-results DIR` tabulates and plots those without running anything.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from dloco.analysis.globalmodel import Evaluator
from dloco.cluster import config as cluster_config
from dloco.cluster.config import ClusterConfig
from dloco.cluster.records import run_task
from dloco.protocol.errors import ConfigError, DlocoError
from dloco.suites import inprocess, qualityrecords
from dloco.suites.qualityplan import (
    BUDGETS,
    QUICK_BUDGETS,
    Settings,
    plan,
    short,
    tuning_plan,
)
from dloco.suites.qualityplots import plot
from dloco.suites.qualityreport import write_up
from dloco.suites.suiteresults import RunResult, collect, measure_global


def run(out_dir: Path, **options) -> str:
    """run_suite's Markdown."""
    return run_suite(out_dir, **options)[0]


def in_process_result(name: str, config: ClusterConfig, run_dir: Path, log) -> RunResult:
    """A budgeted sync-dp run trained in one process (or read back from RUN_DIR), as a suite result:
    every island holds the shared model, so each has its curve."""
    done = inprocess.InProcessRun.load(run_dir)
    if done is None or done.budget != config.tokens:
        log(f"dloco experiment quality: {name} in one process (suites/inprocess.py) -> {run_dir}")
        qualityrecords.mark_trained(run_dir)
        done = inprocess.train_sync_dp(config, log=log, run_dir=run_dir)
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
    result.final = dict(done.final)
    return result


def run_suite(
    out_dir: Path,
    quick: bool = False,
    config_path: Path | None = None,
    budgets: tuple[int, ...] | None = None,
    only: tuple[str, ...] | None = None,
    settings: Settings = Settings(),
    tune: str | None = None,
    results_dir: Path | None = None,
    log=lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[str, list]:
    """Run (or read back) every run of the suite (or of a tuning grid: `tune`, at the first budget)
    into OUT/quality/<label>; write each run's record into `results_dir` (default OUT/results) as
    it lands, OUT/quality.md and OUT/experiments/quality_*.png; return the Markdown and each run's
    results."""
    budgets = budgets or (QUICK_BUDGETS if quick else BUDGETS)
    base = cluster_config.load(config_path)
    runs = (
        tuning_plan(base, budgets[0], quick, tune, settings)
        if tune
        else plan(base, budgets, quick, settings=settings)
    )
    runs = _selected(runs, only)
    results_dir = results_dir or out_dir / "results"
    started, results = time.monotonic(), []
    for index, (name, config) in enumerate(runs, 1):
        result = _run_or_read(name, config, out_dir / "quality" / name, f"{index}/{len(runs)}", log)
        if config.tokens:
            qualityrecords.save(qualityrecords.of(result), results_dir)
        results.append(result)
    command = (
        "dloco experiment quality"
        + (" --quick" if quick else "")
        + (f" --config {config_path}" if config_path else "")
        + (f" --tune {tune}" if tune else "")
        + (
            f" --budgets {','.join(short(b) for b in budgets)}"
            if budgets not in (BUDGETS, QUICK_BUDGETS)
            else ""
        )
        + (f" --seeds {','.join(map(str, settings.seeds))}" if settings.seeds != (0,) else "")
        + (f" --dp-lr {settings.dp_lr:g}" if settings.dp_lr != Settings().dp_lr else "")
        + (
            " --diloco-outer {:g},{:g}".format(*settings.diloco_outer)
            if settings.diloco_outer != Settings().diloco_outer
            else ""
        )
        + (f" --runs {','.join(only)}" if only else "")
    )
    plots = plot(results, out_dir / "experiments")
    return write_up(results, command, time.monotonic() - started, out_dir, plots), results


def _run_or_read(name: str, config: ClusterConfig, run_dir: Path, position: str, log) -> RunResult:
    """One run of the suite, trained now or read back from RUN_DIR: its results, the merger's
    model during the run (a budgeted run's own curve, replayed from its log) and its final model on
    the whole splits."""
    report = run_dir / "report.md"
    finished = report.exists() and "\n## FAILED\n" not in report.read_text()
    if config.mode == "sync-dp":
        return in_process_result(name, config, run_dir, log)
    if finished:
        log(f"dloco experiment quality: run {position} {name}: finished before, read back")
    else:
        _launch(name, config, run_dir, position, log)
    result = collect(name, config, run_dir, 0)
    if config.tokens:
        log(f"dloco experiment quality: {name}: the merger's model during the run, and at the end")
        # each run's own curve: equal tokens are its budget, not the suite's smallest run
        measure_global([result], log=log)
        result.final = Evaluator(run_task(config), run_dir).final_on_splits()
    return result


def run_from_results(results_dirs: list[Path], out_dir: Path, config_path=None) -> str:
    """The suite's write-up from committed records (suites/qualityrecords.py), nothing run."""
    base = cluster_config.load(config_path)
    records = [r for d in results_dirs for r in qualityrecords.load_all(d)]
    if not records:
        raise ConfigError(f"no quality records in {', '.join(map(str, results_dirs))}")
    results = [qualityrecords.result_of(record, base) for record in records]
    command = (
        "dloco experiment quality"
        + (f" --config {config_path}" if config_path else "")
        + "".join(f" --from-results {d}" for d in results_dirs)
    )
    return write_up(results, command, 0.0, out_dir, plot(results, out_dir / "experiments"))


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
    qualityrecords.mark_trained(run_dir)
    with open(run_dir / "up.out", "w") as out:
        code = launcher.run(config, run_dir, out=out)
    if code != 0:
        raise DlocoError(
            f"quality: run {name} failed (exit {code}); see {run_dir / 'report.md'}. Nothing is"
            " tabulated; the runs that finished are read back when the suite is run again with"
            " this --out"
        )
