"""The quality suite's plan (suites/quality.py runs it): its budgets, its seeds and the baselines'
settings, each run's cluster file, and the tuning grids of the baselines."""

from __future__ import annotations

import dataclasses

from dloco.cluster.config import ClusterConfig
from dloco.cluster.modes import MODES as RUN_MODES
from dloco.cluster.sections import ModelSection
from dloco.protocol.errors import ConfigError
from dloco.suites.qualityreport import LINKED, MODES, label
from dloco.suites.transforms import unlinked

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


def short(tokens: int) -> str:
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


def at_interval(config: ClusterConfig, interval: int) -> ClusterConfig:
    """`config` at H = `interval`; a region with its own H keeps its ratio to the cluster's (at
    least one step per fragment)."""
    regions = tuple(
        dataclasses.replace(
            r,
            interval=max(config.sync.fragments, r.interval * interval // config.sync.interval),
        )
        if r.interval
        else r
        for r in config.regions
    )
    return dataclasses.replace(
        config, sync=dataclasses.replace(config.sync, interval=interval), regions=regions
    )


def _quick(c: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(at_interval(c, QUICK_INTERVAL), model=QUICK_MODEL, eval_every=12)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the suite runs at each budget besides the modes: seeds, and each baseline's tuned
    settings (the defaults are the tuning tables' best: EXPERIMENTS.md, "Quality")."""

    seeds: tuple[int, ...] = (0,)
    # sync-dp's peak learning rate at the global batch (None: the islands' default), the best of
    # its tuning grid at 2 M (twice the islands' default: EXPERIMENTS.md, "Quality")
    dp_lr: float | None = 6e-3
    # sync-diloco's outer (lr, momentum): the mode's own, the best of its grid at H = 12 and 2 M
    diloco_outer: tuple[float, float] = (
        RUN_MODES["sync-diloco"].merger["outer_lr"],
        RUN_MODES["sync-diloco"].merger["outer_momentum"],
    )


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
# of the islands' default, at the global batch; sync-diloco's outer lr x momentum at two H;
# decoupled's H at the profile's outer lr (out to H = 384: the planner's quality curve,
# sim/quality.py), its outer lr at the profile's H, the larger outer lrs at H = 384, at the
# profile's H the outer lrs without momentum (sync-diloco's best kind of outer step), and other
# numbers of fragments at the profile's H and outer step (P = 1: the whole model every H, as
# sync-diloco; 6: the most a half-speed region's H = 6 has steps for).
DP_LR_FACTORS = (0.5, 1.0, 2.0, 4.0)
DILOCO_GRID = {"interval": (12, 48), "lr": (0.15, 0.35, 0.7, 1.0), "momentum": (0.0, 0.9)}
DECOUPLED_GRID = {
    "interval": (6, 12, 24, 48, 96, 192, 384),
    "lr": (0.07, 0.15, 0.35, 0.7),
    "lr_without_momentum": (0.35, 0.7, 1.0, 1.4),
    "fragments": (1, 2, 6),
}
TUNABLE = ("sync-dp", "sync-diloco", "decoupled")
# seconds a synchronous round may wait for its islands (an island waits twice that for its fold)
SYNC_WAIT_S = 1800.0


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
        config = unlinked(dataclasses.replace(config, model=model))
    if mode == "sync-diloco":
        lr, momentum = settings.diloco_outer
        # Classic DiLoCo whatever the machine's load: a round waits for every island, and an
        # island for its round's fold, however long a busy machine makes them.
        config = dataclasses.replace(
            config,
            sync=dataclasses.replace(config.sync, settle_timeout_s=2 * SYNC_WAIT_S),
            mode_merger=(
                ("outer_lr", lr),
                ("outer_momentum", momentum),
                ("quorum_timeout_s", SYNC_WAIT_S),
            ),
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


def _decoupled_grid(base: ClusterConfig, budget: int, seed: int) -> list[tuple[str, ClusterConfig]]:
    """Decoupled's H (each region's own H scaled with it) at the profile's outer lr, then its outer
    lr at the profile's H (a line through the profile along each lever), then the larger outer lrs
    at the longest H, where a run has only a few outer steps per fragment, then the outer lrs
    without momentum at the profile's H (their tag ends in -m0), then other numbers of fragments
    at the profile's H and outer step (-p1, -p2, -p6)."""
    lr0 = base.merger.outer_lr
    h0 = base.sync.interval
    settings = [(h, lr0, None, None) for h in DECOUPLED_GRID["interval"]]
    settings += [(h0, lr, None, None) for lr in DECOUPLED_GRID["lr"] if lr != lr0]
    longest = max(DECOUPLED_GRID["interval"])
    settings += [(longest, lr, None, None) for lr in DECOUPLED_GRID["lr"] if lr > lr0]
    settings += [(h0, lr, 0.0, None) for lr in DECOUPLED_GRID["lr_without_momentum"]]
    settings += [(h0, lr0, None, p) for p in DECOUPLED_GRID["fragments"]]
    runs = []
    for interval, lr, momentum, fragments in settings:
        config = at_interval(base.with_mode("decoupled").with_tokens(budget), interval)
        merger = dataclasses.replace(config.merger, outer_lr=lr)
        tag = f"h{interval}-lr{lr:g}"
        if momentum is not None:
            merger = dataclasses.replace(merger, outer_momentum=momentum)
            tag += f"-m{momentum:g}"
        if fragments is not None:
            sync = dataclasses.replace(config.sync, fragments=fragments)
            config = dataclasses.replace(config, sync=sync)
            tag += f"-p{fragments}"
        config = dataclasses.replace(config, seed=seed, merger=merger)
        runs.append((label("decoupled", budget, seed, tag), _bounded(config, budget)))
    return runs


def tuning_plan(
    base: ClusterConfig, budget: int, quick: bool, mode: str, settings: Settings = Settings()
) -> list[tuple[str, ClusterConfig]]:
    """A mode's tuning grid at `budget` (seed: the first of `settings`): sync-dp's peak lr
    (DP_LR_FACTORS times the islands' default), sync-diloco's outer lr x momentum at each H of
    DILOCO_GRID, or decoupled's H and outer lr (DECOUPLED_GRID).  Each run's label names its
    setting."""
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
    if mode == "decoupled":
        return _decoupled_grid(base, budget, seed)
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
