"""`dloco bench scale`: what each stage of a delta's trip costs as the model grows.

For each model size (GPT-like tensors, benchmarks/scale_model.py; P = 4 fragments; int4 deltas up,
int4 diffs down) one delta of every fragment, so every parameter once, goes through the real code
of five stages (benchmarks/scale_pipeline.py says which functions): island send, broker forward,
merger ingest (reassemble, admit, log, fold), snapshot diff, island adopt.  Each stage's median
over `reps` rounds (after one warm-up round) is given in GB/s of float32 parameter bytes
(4 x params / seconds) and as a ratio to memcpy: `np.copyto` of the same bytes, measured in the
same run before and after the pipeline.  Memory: the merger's peak resident set above its imports
(its own process, benchmarks/scale_merger.py) and the island's exchange state above its training
state (benchmarks/scale_island.py), per parameter.  With `--shards N` the merger is N processes,
each folding, logging and serving its share of the fragments; each one's memory is per parameter
of its share, and the merger's figure is the largest of them.

Goals, judged at the largest size: the summed per-parameter cost within 1.5x of the smallest
size's (linear growth); the merger at most 12 bytes per parameter (with shards: each shard, of
its share); the island's exchange state at most 8.  A missed goal names the stage, phase or
structure that misses it.  The computations on the figures are pure functions, tested against
hand-derived values (benchmarks/scale_goals.py).  A size whose pipeline would not fit in the
memory available is refused before anything runs (the machine may be shared); the estimate counts
the merger's state in its dtypes.  Where a whole island does not fit beside the merger,
`--light-island` runs the island side without a model (benchmarks/scale_sides.py): the merger's
two stages and both memory figures are measured as before, the island's two stages without
`exchange.advance` and the rebase.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np

from dloco.benchmarks import scale_goals
from dloco.benchmarks.scale_goals import (
    ISLAND_PLAIN_LIMIT,
    STAGES,
    island_goal,
    linear_fit,
    linear_goal,
    merger_goal,
    stage_figures,
)
from dloco.benchmarks.scale_island import island_state_process
from dloco.benchmarks.scale_merger import MergerState
from dloco.benchmarks.scale_model import (
    available_bytes,
    bytes_per_param,
    count,
    depth_for,
    model_shapes,
    parse_sizes,
)
from dloco.benchmarks.scale_pipeline import WAIT_S, ScaleBenchError, measure
from dloco.benchmarks.timing import gbps, memcpy_seconds
from dloco.merger.config import OuterConfig, SnapshotConfig
from dloco.protocol import partition

FRAGMENTS = 4


def memory_needed(
    params: int, state: MergerState = MergerState(), light: bool = False, shards: int = 1
) -> int:
    """Bytes a size's pipeline holds at its peak, every process together (an estimate)."""
    return scale_goals.memory_needed(
        params,
        OuterConfig.MOMENTUM_BYTES[state.outer.momentum_dtype],
        SnapshotConfig.SERVED_BYTES[state.snapshots.served_dtype],
        "light" if light else "full",
        shards,
    )


def run(
    sizes: str = "10M,50M,125M,350M",
    reps: int = 3,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    momentum_dtype: str = OuterConfig.momentum_dtype,
    served_dtype: str = SnapshotConfig.served_dtype,
    fragments: int = FRAGMENTS,
    light_island: bool = False,
    shards: int = 1,
) -> dict:
    wanted_sizes = parse_sizes(sizes)
    if not 1 <= shards <= fragments:
        raise ScaleBenchError(
            f"--shards {shards}: each merger shard folds at least one of the {fragments} fragments"
            " (give 1 <= shards <= fragments)"
        )
    state = MergerState(
        OuterConfig(momentum_dtype=momentum_dtype),
        SnapshotConfig("fp32", "int4", served_dtype=served_dtype),
    )
    _refuse_what_does_not_fit(wanted_sizes, available_bytes(), state, light_island, shards)
    results = [
        _measure_size(label, wanted, reps, fragments, state, light_island, shards, log)
        for label, wanted in wanted_sizes
    ]
    largest = max(results, key=lambda s: s["params"])
    return {
        "unit": (
            "GB/s of float32 parameter bytes (4 x params / seconds); vs_memcpy: np.copyto of the"
            " same bytes in the same run over the stage (1 = as fast as memcpy)"
        ),
        "fragments": fragments,
        # merger processes, each folding its share of the fragments; "merger" is the one with the
        # most bytes per parameter of its share
        "shards": shards,
        "codec": "int4",
        "snapshot_diff_codec": "int4",
        "momentum_dtype": momentum_dtype,
        "served_dtype": served_dtype,
        # the conductor's island: the measured code path, or the light one (benchmarks/scale_sides)
        "island_side": "light" if light_island else "full",
        "reps": reps,
        "cores": len(os.sched_getaffinity(0)),
        "sizes": results,
        "rss_fit": _rss_fits(results),
        "goals": {
            "linear_cost": linear_goal(results),
            "merger_rss": merger_goal(largest),
            "island_rss": island_goal(largest),
            "island_plain_rss": island_goal(largest, "island_plain", ISLAND_PLAIN_LIMIT),
        },
    }


def _refuse_what_does_not_fit(
    wanted_sizes: list[tuple[str, int]],
    available: int | None,
    state: MergerState,
    light: bool,
    shards: int,
) -> None:
    """ScaleBenchError for the first size that needs more memory than is available: a shared
    machine must not run out of memory halfway through."""
    for label, wanted in wanted_sizes:
        need = memory_needed(wanted, state, light, shards)
        if available is not None and need > available:
            raise ScaleBenchError(
                f"{label} needs about {need / 1e9:.1f} GB at once"
                f" ({(need - scale_goals.fixed_bytes(shards)) / wanted:.0f} B/param: the merger and"
                f" the {'light ' if light else ''}island side), {available / 1e9:.1f} GB are"
                " available: give smaller --sizes"
                + ("" if light else ", or --light-island (no model on the island side)")
            )


def _measure_size(
    label: str,
    wanted: int,
    reps: int,
    fragments: int,
    state: MergerState,
    light: bool,
    shards: int,
    log: Callable[[str], None],
) -> dict:
    """One size: memcpy before and after the pipeline, the pipeline, the island's state."""
    shapes = model_shapes(wanted)
    params = count(shapes)

    def say(line: str) -> None:
        log(f"bench scale: {label}: {line}")

    say(f"{params:,} parameters in {len(shapes)} tensors; memcpy reference ...")
    memcpy = [_memcpy(shapes, reps)]
    say(
        f"pipeline ({shards} merger process{'es' if shards > 1 else ''} starting: model, genesis,"
        " compiling) ..."
    )
    pipeline = measure(shapes, fragments, reps, say, state, light, shards)
    gc.collect()
    memcpy.append(_memcpy(shapes, reps))
    say("island exchange state (own process) ...")
    islands = {
        key: _island_state(shapes, fragments, state.snapshots.served, error_feedback)
        for key, error_feedback in (("island", True), ("island_plain", False))
    }
    result = _size_result(label, shapes, fragments, statistics.median(memcpy), pipeline, islands)
    say(
        f"{result['ns_per_param']:.2f} ns/param over the stages; merger"
        f" {result['merger']['bytes_per_param']:.1f} B/param, island"
        f" {result['island']['bytes_per_param']:.1f} B/param"
    )
    return result


def _rss_fits(results: list[dict]) -> dict:
    """Merger and island memory over the sizes, fitted as fixed bytes + bytes per parameter."""
    return {
        kind: dict(
            zip(
                ("fixed_bytes", "bytes_per_param"),
                linear_fit(
                    [
                        (n, s[kind]["bytes_per_param"] * n)
                        for s in results
                        # a merger shard: per parameter of its share
                        for n in [s[kind].get("params", s["params"])]
                    ]
                ),
            )
        )
        for kind in ("merger", "island", "island_plain")
    }


def _memcpy(shapes: dict, reps: int) -> float:
    arrays = [np.full(shape, 0.5, np.float32) for shape in shapes.values()]
    return memcpy_seconds(arrays, reps)


def _island_state(shapes: dict, fragments: int, served: str | None, error_feedback: bool) -> dict:
    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    process = spawn.Process(
        target=island_state_process,
        args=(child_conn, shapes, fragments, served, error_feedback),
        name="bench-scale-island",
        daemon=True,
    )
    process.start()
    try:
        if not conn.poll(WAIT_S):
            raise ScaleBenchError(f"the island-state process did not answer within {WAIT_S:.0f} s")
        kind, figures = conn.recv()
        if kind == "error":
            raise ScaleBenchError(f"the island-state process failed:\n{figures}")
        return figures
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.terminate()


def _size_result(
    label: str, shapes: dict, fragments: int, memcpy_s: float, pipeline: dict, islands: dict
) -> dict:
    params = count(shapes)
    stages = stage_figures(pipeline["stages"], params, memcpy_s)
    depth = depth_for(params)
    parts = partition(shapes, fragments)
    shards = [
        _merger_memory(
            shard, count({path: shapes[path] for f in shard["fragments"] for path in parts[f]})
        )
        for shard in pipeline["shards"]
    ]
    return {
        "label": label,
        "params": params,
        "tensors": len(shapes),
        "depth": depth,
        "width": 64 * depth,
        "hidden": shapes["blocks/00/mlp/in/kernel"][1],
        "memcpy_gbps": gbps(4 * params, memcpy_s),
        "stages": stages,
        "seconds_per_param": sum(s["seconds"] for s in stages.values()) / params,
        "ns_per_param": sum(s["ns_per_param"] for s in stages.values()),
        # each merger shard per parameter of its own share; "merger": the one with the most
        "merger_shards": shards,
        "merger": max(shards, key=lambda shard: shard["bytes_per_param"]),
        # the island's exchange state, error feedback on ("island") and off ("island_plain")
        **{
            key: {
                **_memory(island["memory_kib"], params),
                "held_bytes_per_param": {
                    name: nbytes / params for name, nbytes in island["held_bytes"].items()
                },
            }
            for key, island in islands.items()
        },
        # A fp32 fragment larger than an island's reassembly budget
        # (island/snapshots.reassembly_budget) could not be joined by `dloco island`; this
        # benchmark's island is given room.
        "join": {
            "full_snapshot_reassembly_bytes": pipeline["full_snapshot_reassembly_bytes"],
            "island_reassembly_budget": pipeline["island_reassembly_budget"],
            "fits": (
                pipeline["full_snapshot_reassembly_bytes"] <= pipeline["island_reassembly_budget"]
            ),
        },
    }


def _merger_memory(shard: dict, params: int) -> dict:
    """A merger process's memory per parameter of the `params` it folds."""
    kib = shard["memory_kib"]
    return {
        "fragments": shard["fragments"],
        "params": params,
        **_memory(kib, params),
        "counters": shard["counters"],
        "held_bytes_per_param": {name: nbytes / params for name, nbytes in kib["held"].items()},
    }


def _memory(kib: dict, params: int) -> dict:
    return {
        "bytes_per_param": bytes_per_param(kib["peak"], kib["baseline"], params),
        "rise_bytes_per_param": {
            phase: rise * 1024 / params for phase, rise in kib["rises"].items()
        },
        "memory_kib": kib,
    }


def summary(result: dict) -> str:
    lines = [
        (
            "bench scale: each stage in GB/s of float32 parameter bytes (4 x params / s) and, in"
            f" brackets, x memcpy (np.copyto of the same bytes, this run); P={result['fragments']},"
            f" int4 up and down, median of {result['reps']} rounds, {result['cores']} cores"
            + (
                "; light island (no model: its send and adoption leave out exchange.advance and"
                " the rebase)"
                if result["island_side"] == "light"
                else ""
            )
        ),
        f"{'size':>6} {'params':>13} {'memcpy':>6} "
        + " ".join(f"{s.replace('_', ' '):>15}" for s in STAGES)
        + f" {'ns/param':>8} {'merger B/p' if result['shards'] == 1 else 'shard B/p':>10}"
        + f" {'island B/p':>10}",
    ]
    for size in result["sizes"]:
        stages = " ".join(
            f"{s['gbps']:7.2f} ({s['vs_memcpy']:5.3f})" for s in size["stages"].values()
        )
        lines.append(
            f"{size['label']:>6} {size['params']:>13,} {size['memcpy_gbps']:6.2f} {stages}"
            f" {size['ns_per_param']:8.2f} {size['merger']['bytes_per_param']:10.1f}"
            f" {size['island']['bytes_per_param']:10.1f}"
        )
    goals, fit = result["goals"], result["rss_fit"]
    linear = goals["linear_cost"]
    lines.append(
        f"goal linear cost: {linear['largest']} costs {linear['ratio']:.2f}x the ns/param of"
        f" {linear['smallest']} (limit {linear['limit']}): {_verdict(linear)}"
    )
    for name, goal, kind in (
        (
            "merger RSS"
            if result["shards"] == 1
            else f"merger RSS (the most of {result['shards']} shards, per parameter of its share)",
            goals["merger_rss"],
            "merger",
        ),
        ("island exchange state", goals["island_rss"], "island"),
        ("island exchange state, no error feedback", goals["island_plain_rss"], "island_plain"),
    ):
        lines.append(
            f"goal {name}: {goal['bytes_per_param']:.1f} B/param at {goal['size']} (limit"
            f" {goal['limit']:g}): {_verdict(goal)}; fit over the sizes"
            f" {fit[kind]['fixed_bytes'] / 2**20:.0f} MiB + {fit[kind]['bytes_per_param']:.1f}"
            " B/param"
        )
    lines.extend(_notes(result))
    return "\n".join(lines)


def _notes(result: dict) -> list[str]:
    """Each merger shard's memory (with shards), and the sizes whose full snapshot an island's own
    budget would not reassemble."""
    notes = []
    if result["shards"] > 1:
        for size in result["sizes"]:
            notes.append(
                f"merger shards at {size['label']}: "
                + "; ".join(
                    f"fragments {','.join(map(str, shard['fragments']))}: {shard['params']:,}"
                    f" params, {shard['bytes_per_param']:.1f} B/param"
                    for shard in size["merger_shards"]
                )
            )
    for size in result["sizes"]:
        join = size["join"]
        if not join["fits"]:
            need, budget = (
                join["full_snapshot_reassembly_bytes"] / 2**20,
                join["island_reassembly_budget"] / 2**20,
            )
            notes.append(
                f"note: at {size['label']} a fragment's full fp32 snapshot needs {need:.0f} MiB to"
                f" reassemble, over an island's {budget:.0f} MiB"
                " (island/snapshots.reassembly_budget): `dloco island` would not join it; this"
                " benchmark's island was given room"
            )
    return notes


def _verdict(goal: dict) -> str:
    return "met" if goal["met"] else f"MISSED: {goal['why']}"
