"""`dloco experiment NAME`: named suites of cluster runs side by side, same corpus, model and links,
written up as Markdown (ready for EXPERIMENTS.md) with PNG plots.

Each suite (suites/catalog.py) is a list of (label, cluster-file transform: suites/transforms.py).
Every run is a plain `dloco up` into `OUT/<label>/` (its own report.md there); the suite then
compares them:
- held-out loss of the merger's final global model, and of the merger's model when the whole
  cluster had trained the suite's equal cluster tokens (the fewest any run trained: the same
  compute in every run) and at GLOBAL_POINTS moments of each run (rebuilt by replaying the
  merger's log, analysis/globalmodel.py; the `_global.png` plot);
- time to a target held-out loss (the target: the worst run's best island evaluation, so every
  run reaches it), from the islands' evaluations: every one of the first EVAL_TRACE steps
  (evaluated after training, from copies of the parameters; UNTRACED suites: steps 1, 2, 4, ...),
  then every eval_every;
- the islands' held-out loss at equal tokens (the fewest tokens any run's islands reached);
- compute utilisation per island and bytes on the wire per trained token.
`--quick` runs the tiny model and only the runs of a suite whose direction shows in a short run
(QUICK_RUNS), each bounded by work (QUICK_STEPS steps per island), not by seconds.
tests/test_experiments_quick.py runs every quick suite and checks each result's direction, not its
magnitude (`pytest -m experiments`, outside the default test run).  A run that failed or did not
train (analysis.verdict) stops the suite with the reason: it is never tabulated.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

from dloco.analysis.runinfo import read_events
from dloco.cluster import config as cluster_config
from dloco.cluster import cpuquota
from dloco.cluster.config import ClusterConfig
from dloco.protocol.errors import ConfigError, DlocoError
from dloco.suites import speedup
from dloco.suites.catalog import (
    DEFAULT_SECONDS,
    EVAL_TRACE,
    QUICK_EVAL_TRACE,
    QUICK_LIMIT_S,
    QUICK_MODEL,
    QUICK_RUNS,
    QUICK_STEPS,
    SUITES,
    UNTRACED,
)
from dloco.suites.suiteresults import RunResult, cluster_tokens, collect, measure_global, summarize
from dloco.suites.transforms import Transform

# the limit of the speedup suite's sync-avg-full-speed run (bounded by steps)
FULL_SPEED_LIMIT_S = 1800.0


class ExperimentError(DlocoError):
    """A run of the suite failed, did not train or was interrupted: the suite stops and tabulates
    nothing."""

    def __init__(self, message: str, interrupted: bool = False) -> None:
        super().__init__(message)
        self.interrupted = interrupted


def run(name: str, out_dir: Path, **options) -> str:
    """Run suite `name` (run_suite's options); write OUT/<name>.md and OUT/experiments/*.png; return
    the Markdown."""
    return run_suite(name, out_dir, **options)[0]


def run_suite(
    name: str,
    out_dir: Path,
    quick: bool = False,
    config_path: Path | None = None,
    seconds: float | None = None,
    log=lambda line: print(line, file=sys.stderr, flush=True),
    only: tuple[str, ...] | None = None,
    reuse: tuple[Path, ...] = (),
    steps: int | None = None,
) -> tuple[str, list[RunResult]]:
    """Run suite `name`, only the runs labelled in `only` if given, each for `seconds` or the
    suite's default, or bounded by work: `steps` per island (QUICK_STEPS with `quick`), `seconds`
    then their limit.  With `reuse` (earlier suites' OUT folders), run nothing: tabulate the runs
    found there, one table (repeats labelled #1, #2, ... by folder).  Returns the Markdown and each
    run's results.
    """
    description, runs = _selected(name, only)
    steps = steps or (QUICK_STEPS[name] if quick else 0)
    limit = seconds or (QUICK_LIMIT_S if steps else DEFAULT_SECONDS[name])
    base = _base(name, cluster_config.load(config_path), limit, steps, quick)
    # --quick: the runs whose direction shows in a short run, unless the caller named its own
    if quick and only is None:
        runs = [
            (label, transform)
            for label, transform in runs
            if label in QUICK_RUNS.get(name, (label,))
        ]
    configs = [(label, transform(base)) for label, transform in runs]
    if reuse:
        return _tabulate(name, description, configs, reuse, out_dir, log)
    configs = _quotas_or_sleeps(name, configs, log)
    started, results = time.monotonic(), []
    for index, (label, config) in enumerate(configs, 1):
        if label == speedup.FULL_SPEED and not config.max_steps:
            config = _as_many_tokens(
                config, [r for r in results if r.label.startswith("decoupled")]
            )
        run_dir = out_dir / name / label
        bound = (
            f"{config.max_steps} steps per island, at most {config.duration_s:.0f} s"
            if config.max_steps
            else f"{config.duration_s:.0f} s"
        )
        log(f"dloco experiment {name}: run {index}/{len(runs)} {label} ({bound}) -> {run_dir}")
        code = _launch(name, label, config, run_dir)
        results.append(collect(label, config, run_dir, code))
    command = (
        f"dloco experiment {name}"
        + (" --quick" if quick else "")
        + (f" --steps {steps}" if steps and not quick else "")
        + (f" --seconds {seconds:g}" if seconds else "")
        + (f" --runs {','.join(label for label, _ in runs)}" if only is not None else "")
    )
    return (
        _write_up(name, description, results, command, time.monotonic() - started, out_dir, log),
        results,
    )


def _selected(name: str, only: tuple[str, ...] | None) -> tuple[str, list[tuple[str, Transform]]]:
    """Suite `name`'s description and runs, only those labelled in `only` if given."""
    if name not in SUITES:
        raise ConfigError(f"unknown experiment {name!r}; suites: {', '.join(SUITES)}")
    description, runs = SUITES[name]
    if only is not None:
        unknown = sorted(set(only) - {label for label, _ in runs})
        if unknown or not only:
            raise ConfigError(
                f"experiment {name} has no run {', '.join(unknown) or '(none given)'}; its runs:"
                f" {', '.join(label for label, _ in runs)}"
            )
        runs = [(label, transform) for label, transform in runs if label in only]
    return description, runs


def _base(name: str, config: ClusterConfig, limit: float, steps: int, quick: bool) -> ClusterConfig:
    """The cluster file every run of suite `name` transforms: `limit` seconds, `steps` per island,
    no faults, its evaluations traced (and the tiny model with `quick`)."""
    base = dataclasses.replace(config, duration_s=limit, max_steps=steps, chaos=())
    # The held-out loss at every early step, evaluated after training (island --eval-trace): time to
    # a target crossed early is then measured to the step, and no evaluation slows the steps it
    # measures.
    untraced = name in UNTRACED
    base = dataclasses.replace(base, eval_trace=0 if untraced else EVAL_TRACE, eval_early=untraced)
    if quick:
        base = dataclasses.replace(
            base, model=QUICK_MODEL, eval_every=20, eval_trace=0 if untraced else QUICK_EVAL_TRACE
        )
    return base


def _quotas_or_sleeps(
    name: str, configs: list[tuple[str, ClusterConfig]], log
) -> list[tuple[str, ClusterConfig]]:
    """The runs as given, or, where they ask for CPU quotas and this machine has none, with slow
    regions sleeping instead (said in the log)."""
    if (
        any(config.island_cpus for _, config in configs)
        and (reason := cpuquota.unavailable()) is not None
    ):
        log(
            f"dloco experiment {name}: no CPU quotas here ({reason}); slow regions sleep instead,"
            " and a sleeping island's CPU goes to the others"
        )
        configs = [
            (label, dataclasses.replace(config, island_cpus=0.0)) for label, config in configs
        ]
    return configs


def _launch(name: str, label: str, config: ClusterConfig, run_dir: Path) -> int:
    """One run of the suite, a plain `dloco up` into RUN_DIR (its output in RUN_DIR/up.out): its
    exit status, 0, or ExperimentError with why it failed."""
    from dloco.cluster import launcher

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "up.out", "w") as out:
        code = launcher.run(config, run_dir, out=out)
    if code != 0:
        why = [
            line.removeprefix("dloco up: FAILED: ")
            for line in (run_dir / "up.out").read_text().splitlines()
            if line.startswith("dloco up: FAILED: ")
        ]
        interrupted = code == launcher.EXIT_INTERRUPTED
        raise ExperimentError(
            f"{name}: run {label} {'was interrupted' if interrupted else 'failed'} (exit"
            f" {code}{': ' + '; '.join(why) if why else ''}); see {run_dir / 'report.md'}."
            " Nothing is tabulated.",
            interrupted=interrupted,
        )
    return code


def _as_many_tokens(config: ClusterConfig, decoupled: list[RunResult]) -> ClusterConfig:
    """`config` bounded by steps: as many as its islands need to train the decoupled runs' cluster
    tokens (the most of them), its length only a limit.  Unchanged without a decoupled run."""
    if not decoupled:
        return config
    # an island's tokens per step
    per_step = max(
        e["tokens"] / e["step"] for r in decoupled for e in r.last.values() if e.get("step")
    )
    steps = math.ceil(max(cluster_tokens(r) for r in decoupled) / (per_step * len(config.regions)))
    return dataclasses.replace(
        config, max_steps=steps, duration_s=max(config.duration_s, FULL_SPEED_LIMIT_S)
    )


def _tabulate(
    name: str,
    description: str,
    configs: list[tuple[str, ClusterConfig]],
    reuse: tuple[Path, ...],
    out_dir: Path,
    log,
) -> tuple[str, list[RunResult]]:
    """run_suite over earlier runs: OUT/<name>/<label> of each folder in `reuse`, for each run of
    the suite found there (their exit status and length: report.md's; 0 when every process exited
    0). The model comes from the suite's configuration: tabulate --quick runs with --quick."""
    results = []
    for k, folder in enumerate(reuse, 1):
        for label, config in configs:
            run_dir = folder / name / label
            if (run_dir / "report.md").exists():
                as_run, code = _as_run(name, label, config, run_dir, folder)
                results.append(
                    collect(label + (f" #{k}" if len(reuse) > 1 else ""), as_run, run_dir, code)
                )
    if not results:
        raise ConfigError(
            f"no run of experiment {name} (a {name}/<run>/report.md) in"
            f" {', '.join(map(str, reuse))}"
        )
    command = f"dloco experiment {name} " + " ".join(f"--from {folder}" for folder in reuse)
    return _write_up(name, description, results, command, 0.0, out_dir, log), results


def _as_run(
    name: str, label: str, config: ClusterConfig, run_dir: Path, folder: Path
) -> tuple[ClusterConfig, int]:
    """An earlier run of `config` in RUN_DIR as it ran (its planned length, CPU quotas or sleeps)
    and its exit status as the launcher counts it; an error if it failed or is another run."""
    from dloco.analysis.report import read_exit_codes

    # it failed or did not train: never tabulated
    if "\n## FAILED\n" in (run_dir / "report.md").read_text():
        raise ExperimentError(
            f"{name}: run {label} in {folder} failed (its report.md says why): nothing is tabulated"
        )
    planned, codes = read_exit_codes(run_dir)
    missing = sorted(set(config.process_names) - set(codes))
    if missing:
        raise ConfigError(
            f"{run_dir / 'report.md'} has no exit status for {', '.join(missing)}: not a run of"
            f" {name} {label}"
        )
    # killed on purpose, not restarted:
    last_action = {e["target"]: e["action"] for e in read_events(run_dir / "chaos.jsonl")}
    # as the launcher counts a run
    code = 0 if all(c == 0 or last_action.get(p) == "kill" for p, c in codes.items()) else 1
    launched = (run_dir / "up.out").read_text() if (run_dir / "up.out").exists() else ""
    # else it slept
    quotas = (
        "CPU quotas (cgroup" in launched or "-core quota)" in (run_dir / "report.md").read_text()
    )
    as_run = dataclasses.replace(
        config,
        duration_s=planned or config.duration_s,
        island_cpus=config.island_cpus if quotas else 0.0,
    )
    return as_run, code


def _write_up(
    name: str,
    description: str,
    results: list[RunResult],
    command: str,
    seconds: float,
    out_dir: Path,
    log,
) -> str:
    """The suite's Markdown (OUT/<name>.md) and plots (OUT/experiments/), after the merger's model
    is measured."""
    from dloco.suites.experimentplots import plot

    log(
        f"dloco experiment {name}: evaluating the merger's model during each run (replaying its"
        " log)"
    )
    measure_global(results, log=log)
    text = summarize(name, description, results, command, seconds)
    plot(name, results, out_dir / "experiments")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(text)
    return text
