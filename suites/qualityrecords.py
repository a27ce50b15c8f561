"""A quality run's result as a file of its own (`<label>.json`, committed under
experiments/results/quality/): what the suite's tables and plots read, without the run's logs, so
that `dloco experiment quality --from-results DIR` rebuilds them without running anything.

A record holds the run's mode, budget, seed and settings, the commit that trained it and the one
that evaluated it (a "+dirty" one had uncommitted changes in the checkout), the final model
on the whole validation and test splits, the shared model's curve (validation batches, against
cluster tokens and seconds), and each island's evaluations and last step (trimmed to the keys the
tables use).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

from dloco.cluster.config import ClusterConfig
from dloco.island.config import TrainConfig
from dloco.suites.suiteresults import RunResult

VERSION = 1
EVAL_KEYS = ("step", "tokens", "since_start", "eval_loss", "life")
LAST_KEYS = ("step", "tokens", "compute_util", "bytes_sent", "bytes_received")


def commit() -> str:
    """The checkout's commit (with "+dirty" when it has uncommitted changes), or "unknown"."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if head and dirty else head or "unknown"


# in a run directory: the commit that trained the run (its record may be written later, by another)
TRAINED_AT = "commit"


def mark_trained(run_dir: Path) -> None:
    """Note the commit that trains the run in RUN_DIR (before it starts)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / TRAINED_AT).write_text(commit() + "\n")


def trained_at(run_dir: Path | None) -> str:
    try:
        return (run_dir / TRAINED_AT).read_text().strip() if run_dir else "unknown"
    except OSError:
        return "unknown"


def settings_of(config: ClusterConfig) -> dict:
    """The settings that distinguish the suite's runs: the inner lr and batch, H and P, the codec,
    the outer step."""
    sync, merger = config.effective()
    return {
        "inner_lr": config.model.lr if config.model.lr is not None else TrainConfig.lr,
        "batch": config.model.batch,
        "interval": sync.interval,
        "fragments": sync.fragments,
        "codec": sync.codec,
        "outer": merger.outer,
        "outer_lr": merger.outer_lr,
        "outer_momentum": merger.outer_momentum,
        "island_cpus": config.island_cpus,
    }


def of(result: RunResult) -> dict:
    config = result.config
    return {
        "version": VERSION,
        "label": result.label,
        "mode": config.mode,
        "budget": config.tokens,
        "seed": config.seed,
        "settings": settings_of(config),
        "commit": trained_at(result.run_dir),
        "evaluated_at": commit(),
        "final": result.final,
        "before": result.global_before,
        "after": result.global_after,
        "curve": result.global_curve,
        "evals": {
            name: [{k: e[k] for k in EVAL_KEYS if k in e} for e in events]
            for name, events in result.evals.items()
        },
        "last": {name: {k: e[k] for k in LAST_KEYS if k in e} for name, e in result.last.items()},
    }


def save(record: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record['label']}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def load_all(folder: Path) -> list[dict]:
    """Every record in `folder`, by label."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("version") == VERSION:
            records.append(record)
    return records


def result_of(record: dict, base: ClusterConfig) -> RunResult:
    """A record as a suite result: its config rebuilt from `base` (the cluster file the suite
    starts from) with the record's mode, budget and seed, and the outer step it ran (a record of
    a former profile keeps its own)."""
    config = dataclasses.replace(
        base.with_mode(record["mode"]).with_tokens(record["budget"] or None), seed=record["seed"]
    )
    ran = record.get("settings", {})
    if record["mode"] == "decoupled" and {"outer_lr", "outer_momentum"} <= ran.keys():
        merger = dataclasses.replace(
            config.merger, outer_lr=ran["outer_lr"], outer_momentum=ran["outer_momentum"]
        )
        config = dataclasses.replace(config, merger=merger)
    result = RunResult(
        record["label"],
        config,
        0,
        record["before"],
        record["after"],
        record["evals"],
        record["last"],
    )
    result.global_curve = record["curve"]
    result.final = record["final"]
    return result
