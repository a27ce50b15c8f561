"""`dloco experiment NAME`: named suites of cluster runs side by side, same corpus, model and links,
written up as Markdown (ready for EXPERIMENTS.md) with PNG plots.

Each suite is a list of (label, cluster-file transform).  Every run is a plain `dloco up` into
`OUT/<label>/` (its own report.md there); the suite then compares them:
- held-out loss of the merger's final global model, and of the merger's model when the whole
  cluster had trained the suite's equal cluster tokens (the fewest any run trained: the same
  compute in every run) and at GLOBAL_POINTS moments of each run (rebuilt by replaying the
  merger's log, cluster/globalmodel.py; the `_global.png` plot);
- time to a target held-out loss (the target: the worst run's best island evaluation, so every
  run reaches it), from the islands' evaluations: every one of the first EVAL_TRACE steps
  (evaluated after training, from copies of the parameters; UNTRACED suites: steps 1, 2, 4, ...),
  then every eval_every;
- the islands' held-out loss at equal tokens (the fewest tokens any run's islands reached);
- compute utilisation per island and bytes on the wire per trained token.
`--quick` runs the tiny model, shorter, and only the runs of a suite whose direction shows within
a minute (QUICK_RUNS): under 3 minutes per suite.  tests/test_experiments_quick.py runs every quick
suite and checks each result's direction, not its magnitude (`pytest -m experiments`, ~15 minutes,
outside the default test run).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cluster import config as cluster_config
from cluster import cpuquota
from cluster.chaos import ChaosEvent
from cluster.config import ClusterConfig
from cluster.runinfo import chaos_effects, last_step, lives, read_events, read_metrics
from protocol.errors import ConfigError, DlocoError

Transform = Callable[[ClusterConfig], ClusterConfig]


def _mode(mode: str) -> Transform:
    return lambda c: dataclasses.replace(c, mode=mode)


def _homogeneous(c: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(c, regions=tuple(dataclasses.replace(r, slowdown=1.0) for r in c.regions))


def _both(*transforms: Transform) -> Transform:
    def apply(c: ClusterConfig) -> ClusterConfig:
        for transform in transforms:
            c = transform(c)
        return c
    return apply


def _set(section: str, **values) -> Transform:
    return lambda c: dataclasses.replace(c, **{section: {**getattr(c, section), **values}})


def _islands(count: int) -> Transform:
    return lambda c: dataclasses.replace(c, regions=c.regions[:count])


def _faults(c: ClusterConfig) -> ClusterConfig:
    """Kill the third island at 35 % of the run and bring it back at 60 %; kill the merger at 75 %, back at 80 %."""
    d, victim = c.duration_s, c.regions[min(2, len(c.regions) - 1)].name
    schedule = [(0.35, "kill", victim), (0.60, "restart", victim), (0.75, "kill", "merger"), (0.80, "restart", "merger")]
    return dataclasses.replace(c, chaos=tuple(ChaosEvent(round(f * d, 1), action, target) for f, action, target in schedule))


# Speed emulated by CPU quotas (cluster/cpuquota.py): a full-speed island may use 0.45 cores, a
# half-speed one 0.225, whatever its peers do; four full-speed islands take 1.8 of this machine's 2
# cores and leave the rest to the merger and the broker.  With sleeps instead, the half-speed
# islands' CPU went to the fast ones (587 steps against 396-410 in a uniform cluster, eighth session).
CAPPED_CPUS = 0.45


def _capped(c: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(c, island_cpus=CAPPED_CPUS)


# sync-diloco with quotas: a half-speed island (0.225 cores, ~0.47 steps/s) finishes its H = 48 steps
# ~50 s after the fast ones, past the profile's 30 s quorum timeout, which then folded the fast pair
# alone and split every round in two (first run, 2026-12-01).  Classic DiLoCo waits for everyone.
WAIT_FOR_SLOW = _both(_set("sync", settle_timeout_s=180.0), _set("merger", quorum_timeout_s=150.0))  # settle first: it must exceed the quorum timeout


# Fewer bytes down: H = 96, and a fragment's snapshot on the bus at most once per round of its fastest
# island (an island's base is then up to a round of folds behind: max_staleness 8).  See default.toml.
LEAN = _both(_set("sync", interval=96), _set("merger", snapshot_every_round=1.0, max_staleness=8))

SUITES: dict[str, tuple[str, list[tuple[str, Transform]]]] = {
    "speedup": ("The three modes at the default profile's links (scaled like the seed's 2-5 Gbit/s for a 12B model, "
                "see cluster/profiles/default.toml), and decoupled in its lean-downlink configuration (H = 96, a fragment's "
                "snapshot at most once per round): time to a target loss, loss at equal tokens, utilisation, bytes per token.",
                [("decoupled", _mode("decoupled")), ("decoupled-h96-held", _both(_mode("decoupled"), LEAN)),
                 ("sync-diloco", _mode("sync-diloco")), ("sync-dp", _mode("sync-dp"))]),
    "heterogeneous": ("Four islands, two at half speed, against four at full speed, in decoupled and sync-diloco: "
                      "do the fast islands wait for the slow ones, and does the slow hardware cost the model anything? Speeds are "
                      "CPU quotas (0.45 cores per full-speed island), so a slow island's cycles go to nobody else. Three full-speed "
                      "islands have the mixed cluster's compute per second on fewer replicas.",
                      [("decoupled-mixed", _both(_mode("decoupled"), _capped)), ("decoupled-uniform", _both(_mode("decoupled"), _homogeneous, _capped)),
                       # three full-speed islands: the mixed cluster's compute per second (2 x 1 + 2 x 1/2), on as many replicas
                       ("decoupled-uniform-3-islands", _both(_mode("decoupled"), _homogeneous, _islands(3), _capped)),
                       ("sync-diloco-mixed", _both(_mode("sync-diloco"), _capped, WAIT_FOR_SLOW)),
                       ("sync-diloco-uniform", _both(_mode("sync-diloco"), _homogeneous, _capped, WAIT_FOR_SLOW))]),
    "faults": ("One island killed -9 for a quarter of the run, then the merger, in decoupled and sync-diloco: the survivors' step "
               "rate during the island's absence, the time to the next fold after the merger comes back, the loss curve.",
               [("decoupled", _both(_mode("decoupled"), _faults)), ("sync-diloco", _both(_mode("sync-diloco"), _faults))]),
    "quantization": ("Delta codecs fp32, bf16, int8, int4, int2, each without and with error feedback (decoupled).",
                     [(f"{codec}{'-ef' if ef else ''}", _set("sync", codec=codec, error_feedback=ef))
                      for codec in ("fp32", "bf16", "int8", "int4", "int2") for ef in (False, True)]),
    "quantization-sync": ("The delta codecs in sync-diloco, where a run is reproducible (every island waits for every round, "
                          "folds are canonical: the same configuration gives the same bytes), so the codec is the only difference "
                          "between two runs' losses at equal tokens — single decoupled runs differ by a few percent from timing alone.",
                          [(f"{codec}{'-ef' if ef else ''}", _both(_mode("sync-diloco"), _set("sync", codec=codec, error_feedback=ef)))
                           for codec, ef in (("fp32", False), ("bf16", False), ("int8", False), ("int4", False), ("int4", True),
                                             ("int2", False), ("int2", True))]),
    "adoption": ("A global fragment arriving between an island's sends: `rebase` (the default: the island's unsent work on the "
                 "fragment stays on top and goes out whole in its next delta) against `replace` (DESIGN.md's adopt-on-arrival: "
                 "that work is overwritten), decoupled, with the profile's mixed speeds and with four equal islands (in phase, "
                 "so each fragment's snapshots arrive seconds before the other islands send it).",
                 [(f"{adoption}-{speeds}", _both(_mode("decoupled"), _set("sync", adoption=adoption), *([_homogeneous] if speeds == "uniform" else [])))
                  for speeds in ("mixed", "uniform") for adoption in ("rebase", "replace")]),
    "merging": ("Plain weighted average vs RDA at 2 and 4 islands (the profile's outer step: Nesterov at lr 0.35 on folds scaled "
                "by their share of a round); against the outer steps at DiLoCo's lr 0.7 (4 islands, RDA): Nesterov on the same "
                "share-scaled folds, Round Nesterov (momentum once per round of shares), Delayed Nesterov with a whole step per fold.",
                [(f"{merge}-{n}-islands", _both(_set("merger", merge=merge), _islands(n))) for n in (2, 4) for merge in ("average", "rda")]
                + [("nesterov-lr0.7-4-islands", _set("merger", outer_lr=0.7)),
                   ("round-nesterov-lr0.7-4-islands", _set("merger", outer="round_nesterov", outer_lr=0.7)),
                   ("delayed-nesterov-lr0.7-4-islands", _set("merger", outer="delayed_nesterov", outer_lr=0.7, share_window=0))]),
    "downlink": ("Snapshots down as the whole fragment in bf16 after every fold, as int4 diffs of the value islands hold "
                 "(protocol/downlink.py) after every fold, and as int4 diffs held to one per fragment per round of the fastest "
                 "island (the default), decoupled: bytes per token, and whether the loss pays for them.",
                 [("bf16-full", _set("merger", snapshot_codec="bf16", snapshot_diff_codec="none", snapshot_every_round=0.0)),
                  ("int4-diff", _set("merger", snapshot_diff_codec="int4", snapshot_every_round=0.0)),
                  ("int4-diff-held", _set("merger", snapshot_diff_codec="int4", snapshot_every_round=1.0))]),
}
# Seconds per run by default (a suite stays within 30 minutes on 2 cores), and with --quick.  heterogeneous:
# five runs; four of 300 s took 1576 s with start-up, stop and trace evaluations (~95 s a run), so 240 s.
DEFAULT_SECONDS = {"speedup": 300.0, "heterogeneous": 240.0, "faults": 300.0, "quantization": 150.0, "quantization-sync": 150.0,
                   "adoption": 300.0, "merging": 210.0, "downlink": 300.0}
# --quick: the tiny model, a few runs per suite (the ones whose direction shows in a minute), each suite
# within 3 minutes on 2 cores (about 15 s of start-up per run on top of its seconds).
QUICK_SECONDS = {"speedup": 35.0, "heterogeneous": 40.0, "faults": 65.0, "quantization": 35.0, "quantization-sync": 40.0, "adoption": 40.0,
                 "merging": 35.0, "downlink": 40.0}
QUICK_RUNS = {"speedup": ("decoupled", "sync-diloco", "sync-dp"), "heterogeneous": ("decoupled-mixed", "sync-diloco-mixed", "sync-diloco-uniform"), "quantization": ("fp32", "int4", "int2"), "quantization-sync": ("fp32", "int4"), "adoption": ("rebase-uniform", "replace-uniform"),
              "merging": ("average-4-islands", "rda-4-islands", "round-nesterov-lr0.7-4-islands")}
QUICK_MODEL = {"width": 32, "depth": 1, "heads": 2, "context": 32, "batch": 8}
# Islands evaluate each of their first N steps after training (below eval_every, 50 and 20 in quick
# runs): 47-50 s at the end of a default run (four islands on two cores).  Suites of many runs,
# whose bars are not times, evaluate at steps 1, 2, 4, ... 32 in the loop instead, to stay within 30
# minutes (quantization: 10 runs, merging: 7).
EVAL_TRACE, QUICK_EVAL_TRACE = 48, 19
# The merger's model is evaluated at this many moments of each run, and at equal cluster tokens
# (measure_global: one replay of the merger's log and ~1 s per evaluation, after the runs).
GLOBAL_POINTS = 6
UNTRACED = {"quantization", "merging"}


@dataclasses.dataclass
class RunResult:
    label: str
    config: ClusterConfig
    exit_code: int
    global_before: float | None
    global_after: float | None
    evals: dict[str, list[dict]]  # island -> evaluation events (since_start: seconds from the cluster's first step, tokens, eval_loss)
    last: dict[str, dict]  # island -> last step event
    chaos: list[dict] = dataclasses.field(default_factory=list)  # cluster.chaos.effects rows
    run_dir: Path | None = None
    global_curve: list[dict] = dataclasses.field(default_factory=list)  # the merger's model: since_start, cluster_tokens, eval_loss
    global_equal: float | None = None  # the merger's model when the cluster had trained the suite's equal cluster tokens


def _collect(label: str, config: ClusterConfig, run_dir: Path, code: int) -> RunResult:
    from cluster.report import global_eval

    evals, last = read_islands([r.name for r in config.regions], run_dir)
    before, after = global_eval(config, run_dir)
    return RunResult(label, config, code, before, after, evals, last, chaos_effects(run_dir, [r.name for r in config.regions]), run_dir)


def cluster_tokens(result: RunResult) -> int:
    """Tokens the whole cluster trained in the run (every island, every life)."""
    return sum(e.get("tokens", 0) for e in result.last.values())


def measure_global(results: list[RunResult], points: int = GLOBAL_POINTS, log=lambda line: None) -> int:
    """The merger's model during each run, rebuilt from its log: at `points` evenly spaced moments
    from the cluster's first step to its last, and when the cluster had trained the suite's equal
    cluster tokens (the fewest any run trained, which is therefore the same compute in every run).
    Fills each result's global_curve and global_equal; returns the equal cluster tokens.  A run
    whose log cannot be replayed faithfully keeps n/a (and is named through `log`): one broken
    run never costs a suite the others' table."""
    equal = min(cluster_tokens(r) for r in results)
    for r in results:
        if r.run_dir is None or not (r.run_dir / "merger").exists():
            continue
        try:
            _measure_global_run(r, equal, points)
        except (DlocoError, OSError, ValueError) as error:
            r.global_curve, r.global_equal = [], None
            log(f"dloco experiment: {r.label}: the merger's model was not rebuilt ({error}); its global columns say n/a")
    return equal


def _measure_global_run(r: RunResult, equal: int, points: int) -> None:
    """measure_global for one run (raises when its merger's log cannot be replayed faithfully)."""
    from cluster.globalmodel import Evaluator, cluster_tokens_at, states_at, when_cluster_reached

    steps = {name: lives([e for e in read_metrics(r.run_dir / "metrics" / f"{name}.jsonl") if "step" in e and "wall" in e])
             for name in r.last}
    walls = sorted(e["wall"] for runs in steps.values() for life in runs for e in life if e["step"] > 0)
    if not walls:
        return
    began, ended = walls[0], walls[-1]
    moments = [began + (ended - began) * k / points for k in range(1, points + 1)]
    reached = when_cluster_reached(steps, equal)
    evaluator = Evaluator(r.config, r.run_dir)
    params = states_at(r.run_dir, moments + [reached if reached is not None else ended])
    # before the merger's first fold its model is the initial one (global_before)
    losses = [r.global_before if p is None else evaluator.loss(p) for p in params]
    r.global_curve = [{"since_start": at - began, "cluster_tokens": cluster_tokens_at(steps, at), "eval_loss": loss} for at, loss in zip(moments, losses)]
    r.global_equal = losses[-1] if reached is not None else None


def read_islands(names: list[str], run_dir: Path) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Each island's evaluations, on one clock (`since_start`: seconds since the cluster's first
    training step), and its last step event (tokens and bytes summed over its lives)."""
    by_island = {name: lives([e for e in read_metrics(run_dir / "metrics" / f"{name}.jsonl") if "step" in e]) for name in names}
    began = min((e["wall"] for runs in by_island.values() for life in runs for e in life if e["step"] == 1), default=None)
    evals, last = {}, {}
    for name, runs in by_island.items():
        evals[name] = [{**e, "since_start": e["wall"] - began, "life": i} for i, life in enumerate(runs) for e in life
                       if "eval_loss" in e and e["step"] > 0] if began else []
        last[name] = last_step(runs)
    return evals, last


def time_to(result: RunResult, target: float) -> float | None:
    """Seconds from the cluster's first training step (the earliest island's step 1, by wall clock)
    to the first island evaluation at or below `target` (`since_start`).  Start-up (JAX import,
    compilation, joining: ~10-15 s here) is left out: it is the same in every mode and does not grow
    with the length of a run.  One clock for every island: a late-joining or restarted island, which
    starts from a model the others have trained, gets no head start."""
    times = [e["since_start"] for events in result.evals.values() for e in events if e["eval_loss"] <= target]
    return min(times) if times else None


def _first_life(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("life", 0) == 0]


def loss_at_tokens(result: RunResult, tokens: float) -> float:
    """Mean over islands of the held-out loss at `tokens` (linear interpolation of their evaluations;
    a restarted island's first life only: its token count starts again from 0)."""
    values = []
    for events in result.evals.values():
        first = _first_life(events)
        if first:
            xs, ys = [e["tokens"] for e in first], [e["eval_loss"] for e in first]
            values.append(float(np.interp(tokens, xs, ys)))
    return float(np.mean(values)) if values else float("nan")


def bytes_per_token(result: RunResult) -> float:
    sent = sum(e.get("bytes_sent", 0) + e.get("bytes_received", 0) for e in result.last.values())
    tokens = sum(e.get("tokens", 0) for e in result.last.values())
    return sent / tokens if tokens else float("nan")


def summarize(name: str, description: str, results: list[RunResult], command: str, seconds: float) -> str:
    target = max(min(e["eval_loss"] for events in r.evals.values() for e in events) for r in results if any(r.evals.values()))
    equal_tokens = min(max(e["tokens"] for e in first) for r in results for events in r.evals.values() if (first := _first_life(events)))
    lines = [f"## `{name}`", "", description, "", f"Command: `{command}` ({seconds:.0f} s of wall clock for the suite, "
             f"{results[0].config.duration_s:.0f} s per run, {'/'.join(str(n) for n in sorted({len(r.config.regions) for r in results}))} islands; "
             f"{_speeds(results)}).", "",
             f"| run | global held-out loss (initial → final) | global loss at {min(cluster_tokens(r) for r in results):,} cluster tokens | time to island loss ≤ {target:.3f} (from the cluster's first step) | island loss at {equal_tokens:,} tokens "
             "| compute utilisation per island | bytes on the wire per token | exit |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        reach = time_to(r, target)
        utils = ", ".join(f"{name} {e.get('compute_util', float('nan')):.2f}" for name, e in r.last.items())
        after = "n/a" if r.global_after is None else f"{r.global_after:.3f}"
        at_equal = "n/a" if r.global_equal is None else f"{r.global_equal:.3f}"
        lines.append(f"| {r.label} | {r.global_before:.3f} → {after} | {at_equal} | {'not reached' if reach is None else f'{reach:.1f} s'} "
                     f"| {loss_at_tokens(r, equal_tokens):.3f} | {utils} | {bytes_per_token(r):,.0f} | {r.exit_code} |")
    dp = next((r for r in results if r.label == "sync-dp"), None)
    for r in results:
        if dp is not None and r.label.startswith("decoupled") and time_to(r, target) and time_to(dp, target):
            lines += ["", f"{r.label} vs sync-dp: {time_to(dp, target) / time_to(r, target):.1f}x faster to the target; "
                      f"{bytes_per_token(dp) / bytes_per_token(r):.0f}x fewer bytes per token; "
                      f"loss at equal tokens {100 * (loss_at_tokens(r, equal_tokens) / loss_at_tokens(dp, equal_tokens) - 1):+.1f} %."]
    for r in results:
        for row in r.chaos:
            rates = ", ".join(f"{n} {v['ratio']:.2f}" for n, v in row["others"].items() if v["ratio"] is not None) or "-"
            extra = f"; next fold after {row['first_fold_s']:.1f} s" if row.get("first_fold_s") is not None else ""
            if row.get("during_absence"):
                extra += (f"; over its whole {row['absence_s']:.0f} s absence vs as long before: "
                          + ", ".join(f"{n} {v:.2f}" for n, v in row["during_absence"].items() if v is not None))
            lines.append(f"- {r.label}, {row['action']} {row['target']} at {row['at_s']:.0f} s: other islands' step rate after/before {rates}; "
                         f"folds {row['folds_before']} before / {row['folds_after']} after{extra}")
    lines += ["", f"![{name}: loss vs tokens](experiments/{name}_loss_vs_tokens.png) ![{name}: loss vs time](experiments/{name}_loss_vs_time.png)"
              + (f" ![{name}: the merger's model](experiments/{name}_global.png)" if any(r.global_curve for r in results) else ""), ""]
    return "\n".join(lines)


def _speeds(results: list[RunResult]) -> str:
    """How the runs emulated slow hardware: CPU quotas (their cores) or sleeps."""
    cores = sorted({r.config.island_cpus for r in results})
    if cores == [0.0]:
        return "a slow region sleeps its slowdown, its CPU free for the others"
    return f"CPU quotas: {'/'.join(f'{c:g}' for c in cores)} cores per full-speed island, divided by a region's slowdown"


def run(name: str, out_dir: Path, quick: bool = False, config_path: Path | None = None, seconds: float | None = None,
        log=lambda line: print(line, file=sys.stderr, flush=True), only: tuple[str, ...] | None = None, reuse: tuple[Path, ...] = ()) -> str:
    """Run suite `name` (only the runs labelled in `only`, if given); write OUT/<name>.md and
    OUT/experiments/*.png; return the Markdown.  With `reuse` (earlier suites' OUT folders), run
    nothing: tabulate the runs found there, one table (repeats labelled #1, #2, ... by folder)."""
    return run_suite(name, out_dir, quick, config_path, seconds, log, only, reuse)[0]


def run_suite(name: str, out_dir: Path, quick: bool = False, config_path: Path | None = None, seconds: float | None = None,
              log=lambda line: print(line, file=sys.stderr, flush=True), only: tuple[str, ...] | None = None,
              reuse: tuple[Path, ...] = ()) -> tuple[str, list[RunResult]]:
    """`run`, also returning each run's results (the tests check their directions)."""
    from cluster import launcher

    if name not in SUITES:
        raise ConfigError(f"unknown experiment {name!r}; suites: {', '.join(SUITES)}")
    description, runs = SUITES[name]
    if only is not None:
        unknown = sorted(set(only) - {label for label, _ in runs})
        if unknown or not only:
            raise ConfigError(f"experiment {name} has no run {', '.join(unknown) or '(none given)'}; its runs: {', '.join(label for label, _ in runs)}")
        runs = [(label, transform) for label, transform in runs if label in only]
    base = cluster_config.load(config_path)
    base = dataclasses.replace(base, duration_s=seconds or (QUICK_SECONDS[name] if quick else DEFAULT_SECONDS[name]), chaos=())
    # The held-out loss at every early step, evaluated after training (island --eval-trace): time to
    # a target crossed early is then measured to the step, and no evaluation slows the steps it measures.
    untraced = name in UNTRACED
    base = dataclasses.replace(base, eval_trace=0 if untraced else EVAL_TRACE, eval_early=untraced)
    if quick:
        base = dataclasses.replace(base, model={**base.model, **QUICK_MODEL}, eval_every=20, eval_trace=0 if untraced else QUICK_EVAL_TRACE)
        runs = [(label, transform) for label, transform in runs if label in QUICK_RUNS.get(name, (label,))]
    configs = [(label, transform(base)) for label, transform in runs]
    if reuse:
        return _tabulate(name, description, configs, reuse, out_dir, log)
    if any(config.island_cpus for _, config in configs) and (reason := cpuquota.unavailable()) is not None:
        log(f"dloco experiment {name}: no CPU quotas here ({reason}); slow regions sleep instead, and a sleeping island's CPU goes to the others")
        configs = [(label, dataclasses.replace(config, island_cpus=0.0)) for label, config in configs]
    started, results = time.monotonic(), []
    for index, (label, config) in enumerate(configs, 1):
        run_dir = out_dir / name / label
        log(f"dloco experiment {name}: run {index}/{len(runs)} {label} ({config.duration_s:.0f} s) -> {run_dir}")
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "up.out", "w") as out:
            code = launcher.run(config, run_dir, out=out)
        results.append(_collect(label, config, run_dir, code))
    command = (f"dloco experiment {name}" + (" --quick" if quick else "") + (f" --seconds {seconds:g}" if seconds else "")
               + (f" --runs {','.join(label for label, _ in runs)}" if only is not None else ""))
    return _write_up(name, description, results, command, time.monotonic() - started, out_dir, log), results


def _tabulate(name: str, description: str, configs: list[tuple[str, ClusterConfig]], reuse: tuple[Path, ...], out_dir: Path,
              log) -> tuple[str, list[RunResult]]:
    """run_suite over earlier runs: OUT/<name>/<label> of each folder in `reuse`, for each run of the
    suite found there (their exit status and length: report.md's; 0 when every process exited 0).
    The model comes from the suite's configuration: tabulate --quick runs with --quick."""
    from cluster.report import read_exit_codes

    results = []
    for k, folder in enumerate(reuse, 1):
        for label, config in configs:
            run_dir = folder / name / label
            if (run_dir / "report.md").exists():
                planned, codes = read_exit_codes(run_dir)
                missing = sorted(set(config.process_names) - set(codes))
                if missing:
                    raise ConfigError(f"{run_dir / 'report.md'} has no exit status for {', '.join(missing)}: not a run of {name} {label}")
                last_action = {e["target"]: e["action"] for e in read_events(run_dir / "chaos.jsonl")}  # killed on purpose, not restarted:
                code = 0 if all(c == 0 or last_action.get(p) == "kill" for p, c in codes.items()) else 1  # as the launcher counts a run
                launched = (run_dir / "up.out").read_text() if (run_dir / "up.out").exists() else ""
                quotas = "CPU quotas (cgroup" in launched or "-core quota)" in (run_dir / "report.md").read_text()  # else it slept
                as_run = dataclasses.replace(config, duration_s=planned or config.duration_s, island_cpus=config.island_cpus if quotas else 0.0)
                results.append(_collect(label + (f" #{k}" if len(reuse) > 1 else ""), as_run, run_dir, code))
    if not results:
        raise ConfigError(f"no run of experiment {name} (a {name}/<run>/report.md) in {', '.join(map(str, reuse))}")
    command = f"dloco experiment {name} " + " ".join(f"--from {folder}" for folder in reuse)
    return _write_up(name, description, results, command, 0.0, out_dir, log), results


def _write_up(name: str, description: str, results: list[RunResult], command: str, seconds: float, out_dir: Path, log) -> str:
    """The suite's Markdown (OUT/<name>.md) and plots (OUT/experiments/), after the merger's model is measured."""
    from cluster.experimentplots import plot

    log(f"dloco experiment {name}: evaluating the merger's model during each run (replaying its log)")
    measure_global(results, log=log)
    text = summarize(name, description, results, command, seconds)
    plot(name, results, out_dir / "experiments")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(text)
    return text

