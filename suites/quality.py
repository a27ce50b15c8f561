"""`dloco experiment quality`: the global model at the end of budgeted runs, per mode and budget,
with seeds, on a test split that no setting was chosen on.

Each run trains the cluster for a token budget (`[run] tokens`, PROTOCOL.md §6.1): every island's
inner rate decays over the cluster's progress towards it, so each run ends decayed, as a real
training run does.  The modes: `sync-dp`, data parallelism (one AdamW on the all-reduced gradient
of the global batch), trained in one process (suites/inprocess.py) at its tuned peak rate (DP_LR);
`sync-diloco` at its tuned outer step (DILOCO_OUTER) and `decoupled`, both over the profile's
emulated links.  Every run's final model is evaluated on the whole validation and test splits
(island/data.py): the tables report test, the tuning grids (`--tune`) read validation.  Seeds vary
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

import dataclasses
import sys
import time
from pathlib import Path

from dloco.analysis.globalmodel import Evaluator
from dloco.cluster import config as cluster_config
from dloco.cluster.config import ClusterConfig
from dloco.cluster.records import run_task
from dloco.cluster.sections import ModelSection
from dloco.protocol.errors import ConfigError, DlocoError
from dloco.suites import inprocess, qualityrecords
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


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the suite runs at each budget besides the modes: seeds, and each baseline's tuned
    settings (the defaults are the tuning tables' best: EXPERIMENTS.md, "Quality")."""

    seeds: tuple[int, ...] = (0,)
    # sync-dp's peak learning rate at the global batch (None: the islands' default)
    dp_lr: float | None = None
    # sync-diloco's outer (lr, momentum)
    diloco_outer: tuple[float, float] = (0.7, 0.9)


def parse_settings(seeds: str | None, dp_lr: float | None, diloco_outer: str | None) -> Settings:
    """`--seeds 0,1,2`, `--dp-lr 6e-3`, `--diloco-outer 0.35,0.9` over the defaults."""
    settings = Settings()
    if seeds is not None:
        try:
            parsed = tuple(int(part) for part in seeds.split(","))
        except ValueError:
            raise ConfigError(f"--seeds: {seeds!r} is not a list of ints (e.g. 0,1,2)") from None
        if len(set(parsed)) != len(parsed) or any(seed < 0 for seed in parsed):
            raise ConfigError(f"--seeds must be distinct ints >= 0, got {seeds!r}")
        settings = dataclasses.replace(settings, seeds=parsed)
    if dp_lr is not None:
        if not 0 < dp_lr < 1:
            raise ConfigError(f"--dp-lr must be in (0, 1), got {dp_lr}")
        settings = dataclasses.replace(settings, dp_lr=dp_lr)
    if diloco_outer is not None:
        try:
            lr, momentum = (float(part) for part in diloco_outer.split(","))
        except ValueError:
            raise ConfigError(
                f"--diloco-outer: {diloco_outer!r} is not LR,MOMENTUM (e.g. 0.35,0.9)"
            ) from None
        if not (0 < lr and 0 <= momentum < 1):
            raise ConfigError(
                f"--diloco-outer needs lr > 0, momentum in [0, 1), got {diloco_outer}"
            )
        settings = dataclasses.replace(settings, diloco_outer=(lr, momentum))
    return settings


# The tuning grids (`--tune`), each at the suite's (small) budget: sync-dp's peak lr as multiples
# of the islands' default, at the global batch; sync-diloco's outer lr x momentum at two H.
DP_LR_FACTORS = (0.5, 1.0, 2.0, 4.0)
DILOCO_GRID = {"interval": (12, 48), "lr": (0.15, 0.35, 0.7, 1.0), "momentum": (0.0, 0.9)}
TUNABLE = ("sync-dp", "sync-diloco")


def _bounded(config: ClusterConfig, budget: int) -> ClusterConfig:
    return dataclasses.replace(
        config, duration_s=max(MIN_LIMIT_S, LIMIT_S_PER_KTOKEN * budget / 1000)
    )


def _mode_config(
    base: ClusterConfig, mode: str, budget: int, seed: int, settings: Settings
) -> ClusterConfig:
    config = dataclasses.replace(base.with_mode(mode).with_tokens(budget), seed=seed)
    if mode == "sync-dp":
        model = dataclasses.replace(config.model, lr=settings.dp_lr)
        config = _unlinked(dataclasses.replace(config, model=model))
    if mode == "sync-diloco":
        lr, momentum = settings.diloco_outer
        config = dataclasses.replace(
            config, mode_merger=(("outer_lr", lr), ("outer_momentum", momentum))
        )
    return _bounded(config, budget)


def _base(base: ClusterConfig, quick: bool) -> ClusterConfig:
    return dataclasses.replace(
        _quick(base) if quick else base, chaos=(), max_steps=0, eval_trace=0, eval_early=False
    )


def plan(
    base: ClusterConfig,
    budgets: tuple[int, ...],
    quick: bool,
    modes: tuple[str, ...] = MODES,
    settings: Settings = Settings(),
) -> list[tuple[str, ClusterConfig]]:
    """The suite's runs: every mode at every budget for every seed, then the short linked sync-avg
    run that times a step of data parallelism over the links."""
    base = _base(base, quick)
    runs = [
        (label(mode, budget, seed), _mode_config(base, mode, budget, seed, settings))
        for budget in budgets
        for seed in settings.seeds
        for mode in modes
    ]
    if "sync-dp" in modes:
        steps = QUICK_LINKED_STEPS if quick else LINKED_STEPS
        # evaluated four times: its seconds per step are read between the first and the last
        runs.append(
            (
                LINKED,
                dataclasses.replace(
                    base.with_mode("sync-avg"),
                    max_steps=steps,
                    eval_every=steps // 4,
                    duration_s=MIN_LIMIT_S * 2,
                ),
            )
        )
    return runs


def tuning_plan(
    base: ClusterConfig, budget: int, quick: bool, mode: str, settings: Settings = Settings()
) -> list[tuple[str, ClusterConfig]]:
    """A baseline's tuning grid at `budget` (seed: the first of `settings`): sync-dp's peak lr
    (DP_LR_FACTORS times the islands' default), or sync-diloco's outer lr x momentum at each H of
    DILOCO_GRID.  Each run's label names its setting."""
    from dloco.suites.inprocess import peak_lr

    if mode not in TUNABLE:
        raise ConfigError(f"--tune takes one of {', '.join(TUNABLE)}, got {mode!r}")
    base, seed = _base(base, quick), settings.seeds[0]
    runs = []
    if mode == "sync-dp":
        default = peak_lr(dataclasses.replace(base, model=dataclasses.replace(base.model, lr=None)))
        for factor in DP_LR_FACTORS:
            lr = default * factor
            chosen = dataclasses.replace(settings, dp_lr=lr)
            runs.append(
                (
                    label(mode, budget, seed, f"lr{lr:g}"),
                    _mode_config(base, mode, budget, seed, chosen),
                )
            )
        return runs
    for interval in DILOCO_GRID["interval"]:
        at_h = dataclasses.replace(base, sync=dataclasses.replace(base.sync, interval=interval))
        for lr in DILOCO_GRID["lr"]:
            for momentum in DILOCO_GRID["momentum"]:
                chosen = dataclasses.replace(settings, diloco_outer=(lr, momentum))
                runs.append(
                    (
                        label(mode, budget, seed, f"h{interval}-lr{lr:g}-m{momentum:g}"),
                        _mode_config(at_h, mode, budget, seed, chosen),
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
            f" --budgets {','.join(_short(b) for b in budgets)}"
            if budgets not in (BUDGETS, QUICK_BUDGETS)
            else ""
        )
        + (f" --seeds {','.join(map(str, settings.seeds))}" if settings.seeds != (0,) else "")
        + (f" --dp-lr {settings.dp_lr:g}" if settings.dp_lr is not None else "")
        + (
            " --diloco-outer {:g},{:g}".format(*settings.diloco_outer)
            if settings.diloco_outer != Settings().diloco_outer
            else ""
        )
        + (f" --runs {','.join(only)}" if only else "")
    )
    return write_up(results, command, time.monotonic() - started, out_dir), results


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
    command = "dloco experiment quality --from-results " + " ".join(map(str, results_dirs))
    return write_up(results, command, 0.0, out_dir)


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
