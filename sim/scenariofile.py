"""A scenario file (TOML) read into a `Scenario` (sim/scenario.py): every section and key checked,
the offender named."""

from __future__ import annotations

import tomllib
from pathlib import Path

from dloco.cluster.sections import MergerSection
from dloco.protocol.errors import ConfigError, require
from dloco.sim.chips import CHIPS
from dloco.sim.quality import MEASURED, QualityCurve
from dloco.sim.scenario import DEFAULT_DP_OVERLAP, Island, Link, Scenario, step_seconds

SECTIONS = {"model", "sync", "merger", "sim", "islands", "quality"}
ISLAND_KEYS = {
    "name",
    "count",
    "step_s",
    "chip",
    "chips",
    "mfu",
    "tokens_per_step",
    "up_gbps",
    "down_gbps",
    "rtt_ms",
    "step_cv",
    "interval",
    "holds_model",
}
# the keys of each section but [merger] (merger/config.py's) and [[islands]] (ISLAND_KEYS)
SECTION_KEYS = {
    "model": {"params"},
    "sync": {"fragments", "interval", "codec", "block"},
    "sim": {
        "duration_s",
        "restart_s",
        "merger_gbps",
        "mtbf_s",
        "down_s",
        "seed",
        "merger_shards",
        "merger_link_gbps",
        "fold_overhead_s",
        "dp_overlap",
        "diloco_codec",
        "overlap_steps",
    },
    "quality": {"intervals", "factors", "source"},
}


def load(path: str | Path) -> Scenario:
    """A scenario file (TOML): [model] params, [sync] fragments/interval/codec, [merger] the
    merger's keys (merger/config.py), [sim] duration_s/restart_s/merger_gbps/mtbf_s/down_s, and
    [[islands]] name, count, step_s or chip/chips/mfu, tokens_per_step, up_gbps, down_gbps, rtt_ms,
    step_cv, interval, holds_model.  [sim] also: merger_shards, merger_link_gbps, fold_overhead_s,
    dp_overlap, diloco_codec, overlap_steps; [quality] intervals and factors (sim/quality.py)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read scenario {path}: {error}") from None
    unknown = set(data) - SECTIONS
    require(not unknown, f"{path}: unknown sections {sorted(unknown)}")
    params = data.get("model", {}).get("params")
    require(
        isinstance(params, (int, float)) and params >= 1,
        f"{path}: [model] params must be a number >= 1, got {params!r}",
    )
    islands = [
        island for entry in data.get("islands", []) for island in _islands(path, entry, params)
    ]
    sync, sim, merger, quality = (
        data.get("sync", {}),
        data.get("sim", {}),
        data.get("merger", {}),
        data.get("quality"),
    )
    for section, keys in SECTION_KEYS.items():
        extra = set(data.get(section, {})) - keys
        require(not extra, f"{path}: unknown keys in [{section}]: {sorted(extra)}")
    scenario = Scenario(
        tuple(islands),
        int(params),
        int(sync.get("fragments", 4)),
        int(sync.get("interval", 48)),
        sync.get("codec", "int4"),
        int(sync.get("block", 256)),
        seed=int(sim.get("seed", 0)),
        merger=_merger_section(path, merger),
        merger_bytes_s=None if "merger_gbps" not in sim else float(sim["merger_gbps"]) * 1e9 / 8,
        fold_overhead_s=float(sim.get("fold_overhead_s", 0.002)),
        merger_shards=sim.get("merger_shards", 1),
        merger_link_bps=_bps(sim.get("merger_link_gbps")),
        dp_overlap=float(sim.get("dp_overlap", DEFAULT_DP_OVERLAP)),
        diloco_codec=sim.get("diloco_codec", ""),
        overlap_steps=sim.get("overlap_steps", 0),
        quality=_quality(path, quality),
        duration_s=float(sim.get("duration_s", 3600.0)),
        restart_s=float(sim.get("restart_s", 60.0)),
    )
    if "mtbf_s" in sim:
        scenario = scenario.with_mtbf(
            float(sim["mtbf_s"]), float(sim.get("down_s", 600.0)), int(sim.get("seed", 0))
        )
    return scenario


def _islands(path: Path, entry: dict, params: float) -> list[Island]:
    """One [[islands]] entry: `count` islands (named NAME-0, NAME-1, ... when more than one), each
    step timed as given or from its chips."""
    extra = set(entry) - ISLAND_KEYS
    require(not extra, f"{path}: unknown keys in [[islands]]: {sorted(extra)}")
    tokens = entry.get("tokens_per_step", 0)
    if "step_s" in entry:
        step = float(entry["step_s"])
    else:
        chip = entry.get("chip")
        require(
            chip in CHIPS,
            f"{path}: island {entry.get('name')!r} needs step_s, or chip (one of"
            f" {sorted(CHIPS)}) and chips",
        )
        step = step_seconds(
            params,
            tokens,
            int(entry.get("chips", 1)),
            CHIPS[chip].bf16_flops,
            float(entry.get("mfu", 0.4)),
        )
    link = Link(
        _bps(entry.get("up_gbps")),
        _bps(entry.get("down_gbps")),
        float(entry.get("rtt_ms", 0.0)) / 1000,
    )
    count = int(entry.get("count", 1))
    return [
        Island(
            entry["name"] if count == 1 else f"{entry['name']}-{k}",
            step,
            int(tokens),
            link,
            step_cv=float(entry.get("step_cv", 0.0)),
            interval=entry.get("interval", 0),
            holds_model=bool(entry.get("holds_model", False)),
        )
        for k in range(count)
    ]


def _quality(path: Path, quality: dict | None) -> QualityCurve:
    """The [quality] section's curve, or the measured one without it."""
    if quality is None:
        return MEASURED
    return QualityCurve.of(
        quality.get("intervals", []),
        quality.get("factors", []),
        str(quality.get("source", path.name)),
    )


def _merger_section(path: Path, keys: dict) -> MergerSection:
    try:
        return MergerSection(**keys)
    except TypeError as error:
        raise ConfigError(f"{path}: [merger]: {error}") from None


def _bps(gbps) -> float | None:
    return None if gbps in (None, 0) else float(gbps) * 1e9
