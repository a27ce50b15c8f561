"""`dloco bench scale`'s figures and goals, computed from the measurements (pure, tested against
hand-derived values): each stage's rates, a linear fit of memory over the sizes, and the three
goals judged at the largest size, a missed one naming the stage, phase or structure that misses it.
"""

from __future__ import annotations

import itertools
import statistics

from dloco.benchmarks.timing import gbps

STAGES = ("island_send", "broker_forward", "merger_ingest", "snapshot_diff", "island_adopt")
# per-parameter cost at the largest size over that at the smallest
LINEAR_LIMIT = 1.5
# bytes of resident memory per parameter: parameters, momentum and the served value
MERGER_LIMIT = 12.0
# bytes of exchange state per parameter, error feedback on; off
ISLAND_LIMIT = 8.0
ISLAND_PLAIN_LIMIT = 4.5
# What a size's pipeline holds at its peak, per parameter, beyond the state's own bytes (parameters
# 4, momentum and served value in their dtypes): the merger's fold and runtime; the full island's
# theta, anchors and their temporaries; the light island's staging and chunks in flight.  Set from
# the peaks measured at 200 M (merger 17.5 B/param, island side 17.5 with float32 state) with a
# margin.
NEED_MERGER_ABOVE = 7
NEED_ISLAND_ABOVE = {"full": 15, "light": 2}
NEED_FIXED_BYTES = 1 << 30
# each merger shard beyond the first: its imports, runtime and compiled kernels
NEED_SHARD_BYTES = 1 << 29


def fixed_bytes(shards: int) -> int:
    """What the pipeline holds whatever the size: the processes' imports and runtimes."""
    return NEED_FIXED_BYTES + (shards - 1) * NEED_SHARD_BYTES


def memory_needed(
    params: int, momentum_bytes: int, served_bytes: int, island: str, shards: int = 1
) -> int:
    """Bytes a size's pipeline holds at its peak, every process together (an estimate): the
    merger's parameters, momentum and served value and what stands above them (shards hold a
    share each), and the island side (`island`: "full" or "light") with its served value."""
    merger = NEED_MERGER_ABOVE + 4 + momentum_bytes + served_bytes
    return fixed_bytes(shards) + (merger + NEED_ISLAND_ABOVE[island] + served_bytes) * params


# What raises the merger's peak in each phase (benchmarks/scale_merger.py), for a missed goal's
# reason.
MERGER_PHASES = {
    "model": "the initial model, as `dloco merger` loads it (4 B/param)",
    "genesis": (
        "the core's outer momentum (4 B/param; the genesis log record writes the parameters as they"
        " lie)"
    ),
    "warm_up": (
        "compiling the fold kernels (a zero delta merged per fragment: its merged direction and the"
        " kernels' working arrays, thrown away; the outer step is compiled from shapes)"
    ),
    "join": (
        "the full snapshots: each fragment encoded in fp32 and decoded as the value served (4"
        " B/param kept)"
    ),
    "ingest": (
        "the rounds on top of the state (parameters, momentum and served value: 12 B/param): one"
        " fold at a time computed beside the installed state (merger/state/pipeline.py), each with"
        " its fragment's merged direction and pseudo-gradient (the outer step is taken in place),"
        " and the first fold's device copy of the initial values; the deltas in flight"
    ),
    "announce": (
        "the snapshot diffs, a tensor at a time (its change and decoding) and the fragment's codes"
    ),
}
ISLAND_STRUCTURES = {
    "served": "the merger's value as received, which diffs apply to",
    "anchors": "each fragment's progress at its last send, held in int8 (island/exchange.py)",
    "error_feedback": "what quantization left out, carried into the next delta (int8)",
    "retransmit": "int4 chunks kept until the merger's cursor covers them",
}


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
    """The merger's bytes per parameter at the largest size (with shards: the shard with the most,
    per parameter of its own share).  A miss names the phase that set the peak (the last that
    raised it), the state the merger holds, and the peak after each phase."""
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


def island_goal(largest: dict, key: str = "island", limit: float = ISLAND_LIMIT) -> dict:
    """The island's exchange state per parameter at the largest size (`key`: "island", error
    feedback on, or "island_plain", off); a miss names what it holds, largest first."""
    value = largest[key]["bytes_per_param"]
    goal = {
        "limit": limit,
        "bytes_per_param": value,
        "met": value <= limit,
        "size": largest["label"],
    }
    if not goal["met"]:
        held = sorted(largest[key]["held_bytes_per_param"].items(), key=lambda item: -item[1])
        goal["why"] = "; ".join(
            f"{name} {b:.2f} B/param ({ISLAND_STRUCTURES.get(name, name)})" for name, b in held
        )
    return goal
