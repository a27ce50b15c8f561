"""`dloco experiment NAME`: named suites of cluster runs side by side, same corpus, model and links,
written up as Markdown (ready for EXPERIMENTS.md) with PNG plots.

Each suite is a list of (label, cluster-file transform).  Every run is a plain `dloco up` into
`OUT/<label>/` (its own report.md there); the suite then compares them:
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
from collections.abc import Callable
from pathlib import Path

from dloco.analysis.runinfo import read_events
from dloco.cluster import config as cluster_config
from dloco.cluster import cpuquota
from dloco.cluster.chaos import ChaosEvent
from dloco.cluster.config import ClusterConfig, ModelSection
from dloco.protocol.errors import ConfigError, DlocoError
from dloco.suites import speedup, wirebytes
from dloco.suites.suiteresults import RunResult, cluster_tokens, collect, measure_global, summarize

Transform = Callable[[ClusterConfig], ClusterConfig]


def _mode(mode: str) -> Transform:
    return lambda c: dataclasses.replace(c, mode=mode)


def _homogeneous(c: ClusterConfig) -> ClusterConfig:
    """Every region at full speed, and so at the [sync] interval."""
    return _one_interval(
        dataclasses.replace(
            c, regions=tuple(dataclasses.replace(r, slowdown=1.0) for r in c.regions)
        )
    )


def _chain(*transforms: Transform) -> Transform:
    """The transforms applied in order."""

    def apply(c: ClusterConfig) -> ClusterConfig:
        for transform in transforms:
            c = transform(c)
        return c

    return apply


def _sync(**values) -> Transform:
    """These [sync] settings (island.config.SyncConfig fields) over the run's."""
    return lambda c: dataclasses.replace(c, sync=dataclasses.replace(c.sync, **values))


def _merger(**values) -> Transform:
    """These [merger] settings (cluster.config.MergerSection fields) over the run's."""
    return lambda c: dataclasses.replace(c, merger=dataclasses.replace(c.merger, **values))


def _one_interval(c: ClusterConfig) -> ClusterConfig:
    """Every island at the [sync] interval (no region's own)."""
    return dataclasses.replace(
        c, regions=tuple(dataclasses.replace(r, interval=0) for r in c.regions)
    )


def _islands(count: int) -> Transform:
    return lambda c: dataclasses.replace(c, regions=c.regions[:count])


def _unlinked(c: ClusterConfig) -> ClusterConfig:
    """No link emulation: every region's links unlimited, no latency."""
    return dataclasses.replace(
        c,
        regions=tuple(
            dataclasses.replace(r, uplink_mbps=None, downlink_mbps=None, rtt_ms=0.0)
            for r in c.regions
        ),
    )


def _faults(c: ClusterConfig) -> ClusterConfig:
    """Kill the third island and bring it back, then kill the merger and bring it back.  A run
    bounded by steps keys them to progress: the kill at 35 % of the first island's steps, the
    restart after another 25 %, the merger's kill once the restarted island has trained an
    interval, its restart 5 s later.  A run of fixed length: at 35 %, 60 %, 75 % and 80 % of it."""
    region = c.regions[min(2, len(c.regions) - 1)]
    victim, first = region.name, c.regions[0].name
    if c.max_steps:
        n, interval = c.max_steps, c.interval_of(region)
        schedule = (
            ChaosEvent(None, "kill", victim, at_step=max(1, round(0.35 * n)), island=first),
            ChaosEvent(
                None,
                "restart",
                victim,
                at_step=max(1, round(0.25 * n)),
                island=first,
                relative=True,
            ),
            ChaosEvent(None, "kill", "merger", at_step=interval, island=victim, relative=True),
            ChaosEvent(5.0, "restart", "merger", relative=True),
        )
        return dataclasses.replace(c, chaos=schedule)
    d = c.duration_s
    schedule = [
        (0.35, "kill", victim),
        (0.60, "restart", victim),
        (0.75, "kill", "merger"),
        (0.80, "restart", "merger"),
    ]
    return dataclasses.replace(
        c,
        chaos=tuple(ChaosEvent(round(f * d, 1), action, target) for f, action, target in schedule),
    )


# Speed emulated by CPU quotas (cluster/cpuquota.py): a full-speed island may use 0.45 cores, a
# half-speed one 0.225, whatever its peers do; four full-speed islands take 1.8 of this machine's 2
# cores and leave the rest to the merger and the broker.  With sleeps instead, a half-speed island's
# CPU goes to the fast ones, which then step faster than in a uniform cluster.
CAPPED_CPUS = 0.45


def _capped(c: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(c, island_cpus=CAPPED_CPUS)


# sync-diloco with quotas: a half-speed island (0.225 cores, ~0.47 steps/s) finishes its H = 48
# steps ~50 s after the fast ones, past the profile's 30 s quorum timeout, which would fold the fast
# pair alone and split every round in two.  Classic DiLoCo waits for everyone.
# settle first: it must exceed the quorum timeout
WAIT_FOR_SLOW = _chain(_sync(settle_timeout_s=180.0), _merger(quorum_timeout_s=150.0))


def _interval(h: int) -> Transform:
    """H = h, and each region with its own interval scaled with it."""

    def apply(c: ClusterConfig) -> ClusterConfig:
        regions = tuple(
            (
                dataclasses.replace(
                    r, interval=max(c.sync.fragments, r.interval * h // c.sync.interval)
                )
                if r.interval
                else r
            )
            for r in c.regions
        )
        return dataclasses.replace(c, sync=dataclasses.replace(c.sync, interval=h), regions=regions)

    return apply


# Fewer bytes: H = 96, and a fragment's snapshot on the bus at most once per mean round of the
# islands (an island's base is then up to a round of folds behind: max_staleness 8).  See
# default.toml.
LEAN = _chain(_interval(96), _merger(snapshot_every_round=1.0, max_staleness=8))

# The bytes suite's configurations, spelled out so that they stay what they are when the profile
# changes: the former default (every fold down as an int4 diff, int4 deltas up, one H for every
# region, Nesterov at lr 0.35), the profile as shipped, and the profile with topk2 deltas (error
# feedback) up (suites/wirebytes.py has the goals).
EVERY_FOLD_INT4 = _chain(
    _one_interval,
    _sync(interval=48, codec="int4", error_feedback=False),
    _merger(
        snapshot_diff_codec="int4",
        snapshot_every_round=0.0,
        max_staleness=4,
        outer="nesterov",
        outer_lr=0.35,
    ),
)
LEAN_BYTES = _sync(codec="topk2", error_feedback=True)

SUITES: dict[str, tuple[str, list[tuple[str, Transform]]]] = {
    "speedup": (
        (
            "The three modes at the default profile's links (scaled like the seed's 2-5 Gbit/s for"
            " a 12B model, see cluster/profiles/default.toml), and decoupled at H = 96 (48 on the"
            " half-speed regions; a fragment's snapshot at most once per mean round, as in the"
            " profile): time to a target loss, loss at equal tokens, utilisation, bytes per token."
            f" `{speedup.FULL_SPEED}` is sync-dp without link emulation, for as many steps as the"
            " decoupled runs' cluster tokens: its loss per step, with sync-dp's measured time per"
            " step, gives sync-dp's time to the decoupled runs' final loss (suites/speedup.py)."
        ),
        [
            ("decoupled", _mode("decoupled")),
            ("decoupled-h96-held", _chain(_mode("decoupled"), LEAN)),
            ("sync-diloco", _mode("sync-diloco")),
            ("sync-dp", _mode("sync-dp")),
            (speedup.FULL_SPEED, _chain(_mode("sync-dp"), _unlinked)),
        ],
    ),
    "heterogeneous": (
        (
            "Four islands, two at half speed, against four at full speed, in decoupled and"
            " sync-diloco: do the fast islands wait for the slow ones, and does the slow hardware"
            " cost the model anything? Speeds are CPU quotas (0.45 cores per full-speed island), so"
            " a slow island's cycles go to nobody else. Three full-speed islands have the mixed"
            " cluster's compute per second on fewer replicas. The mixed decoupled run's half-speed"
            " islands send at the profile's H = 24, the others at 48."
        ),
        [
            ("decoupled-mixed", _chain(_mode("decoupled"), _capped)),
            ("decoupled-uniform", _chain(_mode("decoupled"), _homogeneous, _capped)),
            # three full-speed islands: the mixed cluster's compute per second (2 x 1 + 2 x 1/2), on
            # as many replicas
            (
                "decoupled-uniform-3-islands",
                _chain(_mode("decoupled"), _homogeneous, _islands(3), _capped),
            ),
            ("sync-diloco-mixed", _chain(_mode("sync-diloco"), _capped, WAIT_FOR_SLOW)),
            (
                "sync-diloco-uniform",
                _chain(_mode("sync-diloco"), _homogeneous, _capped, WAIT_FOR_SLOW),
            ),
        ],
    ),
    "faults": (
        (
            "One island killed -9 for a quarter of the run, then the merger, in decoupled and"
            " sync-diloco: the survivors' step rate during the island's absence, the time to the"
            " next fold after the merger comes back, the loss curve."
        ),
        [
            ("decoupled", _chain(_mode("decoupled"), _faults)),
            ("sync-diloco", _chain(_mode("sync-diloco"), _faults)),
        ],
    ),
    "quantization": (
        (
            "Delta codecs fp32, bf16, int8, int4, int2, each without and with error feedback"
            " (decoupled)."
        ),
        [
            (f"{codec}{'-ef' if ef else ''}", _sync(codec=codec, error_feedback=ef))
            for codec in ("fp32", "bf16", "int8", "int4", "int2")
            for ef in (False, True)
        ],
    ),
    "quantization-sync": (
        (
            "The delta codecs in sync-diloco, where a run is reproducible (every island waits for"
            " every round, folds are canonical: the same configuration gives the same bytes), so"
            " the codec is the only difference between two runs' losses at equal tokens — single"
            " decoupled runs differ by a few percent from timing alone."
        ),
        [
            (
                f"{codec}{'-ef' if ef else ''}",
                _chain(_mode("sync-diloco"), _sync(codec=codec, error_feedback=ef)),
            )
            for codec, ef in (
                ("fp32", False),
                ("bf16", False),
                ("int8", False),
                ("int4", False),
                ("int4", True),
                ("int2", False),
                ("int2", True),
            )
        ],
    ),
    "adoption": (
        (
            "A global fragment arriving between an island's sends: `rebase` (the default: the"
            " island's unsent work on the fragment stays on top and goes out whole in its next"
            " delta) against `replace` (docs/design.md's adopt-on-arrival: that work is"
            " overwritten), decoupled, with the profile's mixed speeds and with four equal islands"
            " (in phase, so each fragment's snapshots arrive seconds before the other islands send"
            " it)."
        ),
        [
            (
                f"{adoption}-{speeds}",
                _chain(
                    _mode("decoupled"),
                    _sync(adoption=adoption),
                    *([_homogeneous] if speeds == "uniform" else []),
                ),
            )
            for speeds in ("mixed", "uniform")
            for adoption in ("rebase", "replace")
        ],
    ),
    "merging": (
        (
            "Plain weighted average vs RDA at 2 and 4 islands (the profile's outer step: Nesterov"
            " at its lr on folds scaled by their share of a round); against the outer steps at"
            " DiLoCo's lr 0.7 (4 islands, RDA): Nesterov on the same share-scaled folds, Round"
            " Nesterov (momentum once per round of shares), Delayed Nesterov with a whole step per"
            " fold."
        ),
        [
            (f"{merge}-{n}-islands", _chain(_merger(merge=merge), _islands(n)))
            for n in (2, 4)
            for merge in ("average", "rda")
        ]
        + [
            ("nesterov-lr0.7-4-islands", _merger(outer_lr=0.7)),
            ("round-nesterov-lr0.7-4-islands", _merger(outer="round_nesterov", outer_lr=0.7)),
            (
                "delayed-nesterov-lr0.7-4-islands",
                _merger(outer="delayed_nesterov", outer_lr=0.7, share_window=0),
            ),
        ],
    ),
    "downlink": (
        (
            "Snapshots down as the whole fragment in bf16 after every fold, as int4 diffs of the"
            " value islands hold (protocol/downlink.py) after every fold, and as int4 diffs held to"
            " one per fragment per mean round of the islands (the profile's default), decoupled:"
            " bytes per token, and whether the loss pays for them."
        ),
        [
            (
                "bf16-full",
                _merger(
                    snapshot_codec="bf16", snapshot_diff_codec="none", snapshot_every_round=0.0
                ),
            ),
            ("int4-diff", _merger(snapshot_diff_codec="int4", snapshot_every_round=0.0)),
            (
                "int4-diff-held",
                _merger(snapshot_diff_codec="int4", snapshot_every_round=1.0, max_staleness=8),
            ),
        ],
    ),
    "bytes": (
        (
            "Bytes on the wire per trained token, up and down: sync-dp, the former default (every"
            " fold down as an int4 diff, int4 deltas up, one H for every region), the profile as"
            " shipped (a fragment's int4 diff held to one per mean round of the islands, half-speed"
            " regions at half the H), and the profile with topk2 deltas (error feedback) up: the"
            " ratio to sync-dp, the merger's model at equal cluster tokens and at equal time, the"
            " islands' utilisation, and the goals (suites/wirebytes.py)."
        ),
        [
            (wirebytes.SYNC_DP, _mode("sync-dp")),
            (wirebytes.REFERENCE, EVERY_FOLD_INT4),
            ("default", lambda c: c),
            ("lean", LEAN_BYTES),
        ],
    ),
}
# Seconds per run by default (a suite stays within 30 minutes on 2 cores).  heterogeneous: five
# runs, each ~95 s longer than its length (start-up, stop, trace evaluations), so 240 s.
DEFAULT_SECONDS = {
    "speedup": 300.0,
    "heterogeneous": 240.0,
    "faults": 300.0,
    "quantization": 150.0,
    "quantization-sync": 150.0,
    "adoption": 300.0,
    "merging": 210.0,
    "downlink": 300.0,
    "bytes": 300.0,
}
# --quick: the tiny model and a few runs per suite (the ones whose direction shows in a short run),
# each bounded by work: every island trains this many steps (at least one interval, H = 48, and for
# sync-diloco whole rounds).  QUICK_LIMIT_S is only the limit of a run that cannot get there.
QUICK_STEPS = {
    "speedup": 96,
    "heterogeneous": 144,
    "faults": 192,
    "quantization": 96,
    "quantization-sync": 96,
    "adoption": 144,
    "merging": 96,
    "downlink": 144,
    "bytes": 144,
}
QUICK_LIMIT_S = 900.0
# the limit of the speedup suite's sync-dp-full-speed run (bounded by steps)
FULL_SPEED_LIMIT_S = 1800.0
QUICK_RUNS = {
    "speedup": ("decoupled", "sync-diloco", "sync-dp"),
    "heterogeneous": ("decoupled-mixed", "sync-diloco-mixed", "sync-diloco-uniform"),
    "quantization": ("fp32", "int4", "int2"),
    "quantization-sync": ("fp32", "int4"),
    "adoption": ("rebase-uniform", "replace-uniform"),
    "merging": ("average-4-islands", "rda-4-islands", "round-nesterov-lr0.7-4-islands"),
}
QUICK_MODEL = ModelSection(width=32, depth=1, heads=2, context=32, batch=8)
# Islands evaluate each of their first N steps after training (below eval_every, 50 and 20 in quick
# runs): 47-50 s at the end of a default run (four islands on two cores).  Suites of many runs,
# whose bars are not times, evaluate at steps 1, 2, 4, ... 32 in the loop instead, to stay within 30
# minutes (quantization: 10 runs, merging: 7).
EVAL_TRACE, QUICK_EVAL_TRACE = 48, 19
UNTRACED = {"quantization", "merging"}


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
    from dloco.cluster import launcher

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
    steps = steps or (QUICK_STEPS[name] if quick else 0)
    limit = seconds or (QUICK_LIMIT_S if steps else DEFAULT_SECONDS[name])
    base = dataclasses.replace(
        cluster_config.load(config_path), duration_s=limit, max_steps=steps, chaos=()
    )
    # The held-out loss at every early step, evaluated after training (island --eval-trace): time to
    # a target crossed early is then measured to the step, and no evaluation slows the steps it
    # measures.
    untraced = name in UNTRACED
    base = dataclasses.replace(base, eval_trace=0 if untraced else EVAL_TRACE, eval_early=untraced)
    if quick:
        base = dataclasses.replace(
            base, model=QUICK_MODEL, eval_every=20, eval_trace=0 if untraced else QUICK_EVAL_TRACE
        )
        # the runs whose direction shows in a short run, unless the caller named its own
        if only is None:
            runs = [
                (label, transform)
                for label, transform in runs
                if label in QUICK_RUNS.get(name, (label,))
            ]
    configs = [(label, transform(base)) for label, transform in runs]
    if reuse:
        return _tabulate(name, description, configs, reuse, out_dir, log)
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
    from dloco.analysis.report import read_exit_codes

    results = []
    for k, folder in enumerate(reuse, 1):
        for label, config in configs:
            run_dir = folder / name / label
            if (run_dir / "report.md").exists():
                # it failed or did not train: never tabulated
                if "\n## FAILED\n" in (run_dir / "report.md").read_text():
                    raise ExperimentError(
                        f"{name}: run {label} in {folder} failed (its report.md says why): nothing"
                        " is tabulated"
                    )
                planned, codes = read_exit_codes(run_dir)
                missing = sorted(set(config.process_names) - set(codes))
                if missing:
                    raise ConfigError(
                        f"{run_dir / 'report.md'} has no exit status for {', '.join(missing)}: not"
                        f" a run of {name} {label}"
                    )
                # killed on purpose, not restarted:
                last_action = {
                    e["target"]: e["action"] for e in read_events(run_dir / "chaos.jsonl")
                }
                # as the launcher counts a run
                code = (
                    0
                    if all(c == 0 or last_action.get(p) == "kill" for p, c in codes.items())
                    else 1
                )
                launched = (run_dir / "up.out").read_text() if (run_dir / "up.out").exists() else ""
                # else it slept
                quotas = (
                    "CPU quotas (cgroup" in launched
                    or "-core quota)" in (run_dir / "report.md").read_text()
                )
                as_run = dataclasses.replace(
                    config,
                    duration_s=planned or config.duration_s,
                    island_cpus=config.island_cpus if quotas else 0.0,
                )
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
