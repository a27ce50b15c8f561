"""`dloco bench scale`: what each stage of a delta's trip costs as the model grows.

For each model size (GPT-like tensors, benchmarks/scale_model.py; P = 4 fragments; int4 deltas up,
int4 diffs down) one delta of every fragment, so every parameter once, goes through the real code
of five stages (benchmarks/scale_pipeline.py says which functions): island send, broker forward,
merger ingest (reassemble, admit, log, fold), snapshot diff, island adopt.  Each stage's median
over `reps` rounds (after one warm-up round) is given in GB/s of float32 parameter bytes
(4 x params / seconds) and as a ratio to memcpy: `np.copyto` of the same bytes, measured in the
same run before and after the pipeline.  Memory: the merger's peak resident set above its imports
(its own process, benchmarks/scale_merger.py) and the island's exchange state above its training
state (benchmarks/scale_island.py), per parameter.

Goals, judged at the largest size: the summed per-parameter cost within 1.5x of the smallest
size's (linear growth); the merger at most 20 bytes per parameter; the island's exchange state at
most 12.  A missed goal names the stage, phase or structure that misses it.  The computations on
the figures are pure functions, tested against hand-derived values.  A size whose pipeline would
not fit in the memory available is refused before anything runs (the machine may be shared).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np

from dloco.benchmarks.scale_island import island_state_process
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

STAGES = ("island_send", "broker_forward", "merger_ingest", "snapshot_diff", "island_adopt")
FRAGMENTS = 4
# per-parameter cost at the largest size over that at the smallest
LINEAR_LIMIT = 1.5
# bytes of resident memory per parameter: parameters, momentum and the served value
MERGER_LIMIT = 12.0
# bytes of exchange state per parameter, error feedback on
ISLAND_LIMIT = 8.0
# What a size needs at once: the merger's process (~26-35 B/param) beside this one's island side
# (~15), measured at 200 M (BENCHMARKS.md), and the runtimes; a size that would not fit is refused
# up front.
NEED_BYTES_PER_PARAM = 50
NEED_FIXED_BYTES = 1 << 30
# What raises the merger's peak in each phase (benchmarks/scale_merger.py), for a missed goal's
# reason.
MERGER_PHASES = {
    "model": "the initial model, as `dloco merger` loads it (4 B/param)",
    "genesis": (
        "the core's outer momentum (4 B/param; the genesis log record writes the parameters as they"
        " lie)"
    ),
    "warm_up": (
        "compiling the fold kernels and taking each fragment's outer step once (its new parameters"
        " and momentum, thrown away; the allocator keeps what is freed)"
    ),
    "join": (
        "the full snapshots: each fragment encoded in fp32 and decoded as the value served (4"
        " B/param kept)"
    ),
    "ingest": (
        "the rounds on top of the state (parameters, momentum and served value: 12 B/param): a"
        " fold's new parameters and momentum beside the old, the diff's copies, and the freed"
        " memory the allocator keeps (merger/memory.py: up to 512 MiB, one heap for every thread)"
    ),
    "announce": (
        "the snapshot diffs (a host copy of the fragment, the change, its codes, the new served"
        " value)"
    ),
}
ISLAND_STRUCTURES = {
    "served": "the merger's value as received, which diffs apply to",
    "anchors": "each fragment's anchor, a host copy of theta at its last send",
    "error_feedback": "what quantization left out, carried into the next delta",
    "retransmit": "int4 chunks kept until the merger's cursor covers them",
}


def memory_needed(params: int) -> int:
    """Bytes of memory a size's pipeline holds at its peak, both processes together (an
    estimate)."""
    return NEED_FIXED_BYTES + NEED_BYTES_PER_PARAM * params


def stage_figures(samples: dict[str, list[float]], params: int, memcpy_s: float) -> dict[str, dict]:
    """Per stage: median seconds, GB/s of the 4 x params float32 bytes, ratio to memcpy (the same
    bytes: memcpy seconds over the stage's), nanoseconds per parameter."""
    figures = {}
    for stage in STAGES:
        seconds = statistics.median(samples[stage])
        figures[stage] = {
            "seconds": seconds,
            "samples_s": list(samples[stage]),
            "gbps": gbps(4 * params, seconds),
            "vs_memcpy": memcpy_s / seconds,
            "ns_per_param": seconds / params * 1e9,
        }
    return figures


def linear_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (fixed, per_param) of value = fixed + per_param * params; one point: (0, value
    / params)."""
    if len(points) == 1:
        return 0.0, points[0][1] / points[0][0]
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )
    return mean_y - slope * mean_x, slope


def linear_goal(sizes: list[dict]) -> dict:
    """Summed ns/param at the largest size over the smallest's; a miss names the stage that grew
    most."""
    small, large = min(sizes, key=lambda s: s["params"]), max(sizes, key=lambda s: s["params"])
    ratio = large["ns_per_param"] / small["ns_per_param"]
    growth = {
        stage: large["stages"][stage]["ns_per_param"] / small["stages"][stage]["ns_per_param"]
        for stage in STAGES
    }
    # the stage that adds most to the growth: its extra ns/param at the largest size
    worst = max(
        STAGES,
        key=lambda stage: (
            large["stages"][stage]["ns_per_param"] - small["stages"][stage]["ns_per_param"]
        ),
    )
    goal = {
        "limit": LINEAR_LIMIT,
        "ratio": ratio,
        "met": ratio <= LINEAR_LIMIT,
        "stage_growth": growth,
        "smallest": small["label"],
        "largest": large["label"],
    }
    if not goal["met"]:
        goal["why"] = (
            f"{worst}: {large['stages'][worst]['ns_per_param']:.2f} ns/param at {large['label']}"
            f" against {small['stages'][worst]['ns_per_param']:.2f} at {small['label']}"
            f" ({growth[worst]:.2f}x)"
        )
    return goal


def merger_goal(largest: dict) -> dict:
    """The merger's bytes per parameter at the largest size.  A miss names the phase that set the
    peak (the last that raised it), the state the merger holds, and the peak after each phase."""
    value = largest["merger"]["bytes_per_param"]
    goal = {
        "limit": MERGER_LIMIT,
        "bytes_per_param": value,
        "met": value <= MERGER_LIMIT,
        "size": largest["label"],
    }
    if not goal["met"]:
        rises, held = (
            largest["merger"]["rise_bytes_per_param"],
            largest["merger"]["held_bytes_per_param"],
        )
        phase = [name for name, rise in rises.items() if rise > 0.05][-1]
        peaks = itertools.accumulate(rises.values())
        goal["why"] = (
            f"the peak is set in phase {phase}: {MERGER_PHASES.get(phase, phase)}. The state itself"
            f" holds {sum(held.values()):.1f} B/param ("
            + ", ".join(f"{name} {b:.1f}" for name, b in held.items() if b)
            + "); peak after each phase: "
            + ", ".join(f"{name} {b:.1f}" for name, b in zip(rises, peaks))
        )
    return goal


def island_goal(largest: dict) -> dict:
    """The island's exchange state per parameter at the largest size; a miss names what it holds,
    largest first."""
    value = largest["island"]["bytes_per_param"]
    goal = {
        "limit": ISLAND_LIMIT,
        "bytes_per_param": value,
        "met": value <= ISLAND_LIMIT,
        "size": largest["label"],
    }
    if not goal["met"]:
        held = sorted(largest["island"]["held_bytes_per_param"].items(), key=lambda item: -item[1])
        goal["why"] = "; ".join(
            f"{name} {b:.2f} B/param ({ISLAND_STRUCTURES.get(name, name)})" for name, b in held
        )
    return goal


def run(
    sizes: str = "10M,50M,125M,350M",
    reps: int = 3,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict:
    wanted_sizes, available = parse_sizes(sizes), available_bytes()
    # a shared machine must not run out of memory halfway through
    for label, wanted in wanted_sizes:
        if available is not None and memory_needed(wanted) > available:
            raise ScaleBenchError(
                f"{label} needs about {memory_needed(wanted) / 1e9:.1f} GB at once"
                f" ({NEED_BYTES_PER_PARAM} B/param: the merger and the island side),"
                f" {available / 1e9:.1f} GB are available: give smaller --sizes"
            )
    results = []
    for label, wanted in wanted_sizes:
        shapes = model_shapes(wanted)
        params = count(shapes)

        def say(line: str, label: str = label) -> None:
            log(f"bench scale: {label}: {line}")

        say(f"{params:,} parameters in {len(shapes)} tensors; memcpy reference ...")
        memcpy = [_memcpy(shapes, reps)]
        say("pipeline (merger process starting: model, genesis, compiling) ...")
        pipeline = measure(shapes, FRAGMENTS, reps, say)
        gc.collect()
        memcpy.append(_memcpy(shapes, reps))
        say("island exchange state (own process) ...")
        island = _island_state(shapes)
        results.append(
            _size_result(label, shapes, params, statistics.median(memcpy), pipeline, island)
        )
        say(
            f"{results[-1]['ns_per_param']:.2f} ns/param over the stages; merger"
            f" {results[-1]['merger']['bytes_per_param']:.1f} B/param, island"
            f" {results[-1]['island']['bytes_per_param']:.1f} B/param"
        )
    largest = max(results, key=lambda s: s["params"])
    fits = {
        kind: dict(
            zip(
                ("fixed_bytes", "bytes_per_param"),
                linear_fit(
                    [(s["params"], s[kind]["bytes_per_param"] * s["params"]) for s in results]
                ),
            )
        )
        for kind in ("merger", "island")
    }
    return {
        "unit": (
            "GB/s of float32 parameter bytes (4 x params / seconds); vs_memcpy: np.copyto of the"
            " same bytes in the same run over the stage (1 = as fast as memcpy)"
        ),
        "fragments": FRAGMENTS,
        "codec": "int4",
        "snapshot_diff_codec": "int4",
        "reps": reps,
        "cores": len(os.sched_getaffinity(0)),
        "sizes": results,
        "rss_fit": fits,
        "goals": {
            "linear_cost": linear_goal(results),
            "merger_rss": merger_goal(largest),
            "island_rss": island_goal(largest),
        },
    }


def _memcpy(shapes: dict, reps: int) -> float:
    arrays = [np.full(shape, 0.5, np.float32) for shape in shapes.values()]
    return memcpy_seconds(arrays, reps)


def _island_state(shapes: dict) -> dict:
    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    process = spawn.Process(
        target=island_state_process,
        args=(child_conn, shapes, FRAGMENTS),
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
    label: str, shapes: dict, params: int, memcpy_s: float, pipeline: dict, island: dict
) -> dict:
    stages = stage_figures(pipeline["stages"], params, memcpy_s)
    depth = depth_for(params)
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
        "merger": {
            **_memory(pipeline["merger_memory_kib"], params),
            "counters": pipeline["merger_counters"],
            "held_bytes_per_param": {
                name: nbytes / params
                for name, nbytes in pipeline["merger_memory_kib"]["held"].items()
            },
        },
        "island": {
            **_memory(island["memory_kib"], params),
            "held_bytes_per_param": {
                name: nbytes / params for name, nbytes in island["held_bytes"].items()
            },
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
        ),
        f"{'size':>6} {'params':>13} {'memcpy':>6} "
        + " ".join(f"{s.replace('_', ' '):>15}" for s in STAGES)
        + f" {'ns/param':>8} {'merger B/p':>10} {'island B/p':>10}",
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
        ("merger RSS", goals["merger_rss"], "merger"),
        ("island exchange state", goals["island_rss"], "island"),
    ):
        lines.append(
            f"goal {name}: {goal['bytes_per_param']:.1f} B/param at {goal['size']} (limit"
            f" {goal['limit']:g}): {_verdict(goal)}; fit over the sizes"
            f" {fit[kind]['fixed_bytes'] / 2**20:.0f} MiB + {fit[kind]['bytes_per_param']:.1f}"
            " B/param"
        )
    for size in result["sizes"]:
        join = size["join"]
        if not join["fits"]:
            need, budget = (
                join["full_snapshot_reassembly_bytes"] / 2**20,
                join["island_reassembly_budget"] / 2**20,
            )
            lines.append(
                f"note: at {size['label']} a fragment's full fp32 snapshot needs {need:.0f} MiB to"
                f" reassemble, over an island's {budget:.0f} MiB"
                " (island/snapshots.reassembly_budget): `dloco island` would not join it; this"
                " benchmark's island was given room"
            )
    return "\n".join(lines)


def _verdict(goal: dict) -> str:
    return "met" if goal["met"] else f"MISSED: {goal['why']}"
