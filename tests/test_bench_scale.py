"""`dloco bench scale`: the pure computations against hand-derived values, and one small run of the
whole command whose JSON is checked for structure and sanity (never for speed: the machine is
shared).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dloco.benchmarks import scale, scale_goals
from dloco.benchmarks.scale_island import unique_nbytes
from dloco.benchmarks.scale_model import (
    bytes_per_param,
    count,
    depth_for,
    model_shapes,
    parse_sizes,
)
from dloco.protocol.errors import ConfigError

# what the merger holds per parameter (of its share) with the float32 state
FLOAT32_STATE = {"parameters": 4.0, "optimizer": 4.0, "other_jax_arrays": 0.0, "served": 4.0}


def test_sizes_read_as_the_command_line_writes_them():
    assert parse_sizes("10M,50M, 1.5G,2000,3k") == [
        ("10M", 10_000_000),
        ("50M", 50_000_000),
        ("1.5G", 1_500_000_000),
        ("2000", 2000),
        ("3k", 3000),
    ]
    for bad in ("10X", "", "M", "0", "10M,,50M"):
        with pytest.raises(ConfigError):
            parse_sizes(bad)


def test_depth_grows_with_the_cube_root_of_the_size():
    # params ~ 49152 depth^3: 10 M -> 5.88 -> 6; 125 M -> 13.65 -> 14; 350 M -> 19.25 -> 19; tiny
    # models keep 2 blocks
    assert [depth_for(n) for n in (10_000_000, 125_000_000, 350_000_000, 1000)] == [6, 14, 19, 2]


def test_a_gpt_like_model_of_10m_by_hand():
    """6 blocks of width 384: attention and norms 6 (4 * 384^2 + 9 * 384) = 3,559,680; embeddings
    and final norm (256 + 1024 + 2) * 384 = 492,288; the MLP's hidden width (10,000,000 - both) //
    (6 * 769) = 1289, which takes 6 * 1289 * 769 = 5,947,446: 9,999,414 in all, 76 tensors (12 per
    block and 4)."""
    shapes = model_shapes(10_000_000)
    assert count(shapes) == 9_999_414 and len(shapes) == 76
    assert shapes["blocks/00/attn/qkv/kernel"] == (384, 1152) and shapes[
        "blocks/05/mlp/in/kernel"
    ] == (384, 1289)
    assert shapes["embed/tokens"] == (256, 384) and shapes["embed/positions"] == (1024, 384)


def test_350m_by_hand_and_every_size_just_below_its_target():
    # 19 blocks of width 1216, hidden 5102: 112,585,792 + 19 * 5102 * 2433 + 1282 * 1216 =
    # 349,994,858
    assert count(model_shapes(350_000_000)) == 349_994_858
    for params in (1_000_000, 3_000_000, 50_000_000, 125_000_000):
        shapes = model_shapes(params)
        depth, width = depth_for(params), 64 * depth_for(params)
        # less than one hidden unit per block short
        assert 0 <= params - count(shapes) < depth * (2 * width + 1)
    with pytest.raises(ConfigError, match="too small"):
        # 2 blocks of width 128 need 297,472 before the MLP
        model_shapes(100_000)


def test_stage_figures_by_hand():
    samples = {stage: [2.0, 1.0, 3.0] for stage in scale_goals.STAGES}
    figures = scale_goals.stage_figures(samples, params=1_000_000_000, memcpy_s=0.5)
    for stage in scale_goals.STAGES:
        # median 2 s; 4e9 bytes / 2 s = 2 GB/s; memcpy did the same bytes in 0.5 s: 0.25 of its
        # speed; 2 ns per parameter
        assert figures[stage]["seconds"] == 2.0 and figures[stage]["gbps"] == pytest.approx(2.0)
        assert figures[stage]["vs_memcpy"] == pytest.approx(0.25) and figures[stage][
            "ns_per_param"
        ] == pytest.approx(2.0)


def test_linear_fit_finds_the_fixed_part_and_the_slope():
    assert scale_goals.linear_fit(
        [(1_000_000, 15_000_000.0), (2_000_000, 25_000_000.0), (4_000_000, 45_000_000.0)]
    ) == pytest.approx((5e6, 10.0))
    assert scale_goals.linear_fit([(1000, 20_000.0)]) == (0.0, 20.0)


def _size(label: str, params: int, ns: dict[str, float]) -> dict:
    return {
        "label": label,
        "params": params,
        "ns_per_param": sum(ns.values()),
        "stages": {s: {"ns_per_param": v} for s, v in ns.items()},
    }


def test_linear_goal_names_the_stage_that_grew():
    small = _size("10M", 10_000_000, {stage: 2.0 for stage in scale_goals.STAGES})
    large = _size(
        "100M", 100_000_000, {**{stage: 2.0 for stage in scale_goals.STAGES}, "merger_ingest": 10.0}
    )
    goal = scale_goals.linear_goal([large, small])
    # 4 x 2 + 10 against 5 x 2
    assert goal["ratio"] == pytest.approx(18 / 10) and not goal["met"]
    assert goal["stage_growth"]["merger_ingest"] == pytest.approx(5.0) and goal["stage_growth"][
        "island_send"
    ] == pytest.approx(1.0)
    assert goal["why"] == "merger_ingest: 10.00 ns/param at 100M against 2.00 at 10M (5.00x)"
    # 1.45x
    assert scale_goals.linear_goal(
        [small, _size("20M", 20_000_000, {stage: 2.9 for stage in scale_goals.STAGES})]
    )["met"]
    assert "why" not in scale_goals.linear_goal([small])


def test_memory_goals_say_what_misses_them():
    rises = {"model": 4.0, "genesis": 16.0, "join": 0.0, "ingest": 13.0, "announce": 0.0}
    held = {"parameters": 4.0, "optimizer": 4.0, "other_jax_arrays": 0.0, "served": 4.0}
    merger = {
        "label": "200M",
        "merger": {
            "bytes_per_param": 33.0,
            "rise_bytes_per_param": rises,
            "held_bytes_per_param": held,
        },
    }
    goal = scale_goals.merger_goal(merger)
    # the last that rose
    assert not goal["met"] and goal["why"].startswith("the peak is set in phase ingest: the rounds")
    assert "holds 12.0 B/param (parameters 4.0, optimizer 4.0, served 4.0)" in goal["why"]
    assert goal["why"].endswith(
        "peak after each phase: model 4.0, genesis 20.0, join 20.0, ingest 33.0, announce 33.0"
    )
    # at the limit
    assert scale_goals.merger_goal(
        {"label": "1M", "merger": {"bytes_per_param": 12.0, "rise_bytes_per_param": {}}}
    )["met"]
    held = {"served": 4.0, "anchors": 4.0, "error_feedback": 4.0, "retransmit": 0.52}
    goal = scale_goals.island_goal(
        {"label": "200M", "island": {"bytes_per_param": 14.7, "held_bytes_per_param": held}}
    )
    assert (
        not goal["met"]
        and goal["why"].startswith("served 4.00 B/param")
        and "retransmit 0.52" in goal["why"]
    )
    assert "why" not in scale_goals.island_goal(
        {"label": "1M", "island": {"bytes_per_param": 7.9, "held_bytes_per_param": held}}
    )


def test_shared_memory_counts_once_and_rss_per_parameter():
    a = np.zeros(10, np.float32)
    assert unique_nbytes([a, a.reshape(2, 5), a[:5], np.ones(3, np.float64)]) == 40 + 24
    assert bytes_per_param(peak_kib=3000, baseline_kib=1000, params=1024) == 2000.0


def dloco(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", *args], capture_output=True, text=True, timeout=timeout
    )


def test_a_bad_size_is_refused_before_any_work():
    run = dloco("bench", "scale", "--sizes", "10M,10X", timeout=60)
    assert run.returncode == 2 and "10X" in run.stderr


def test_memory_needed_by_hand():
    # 8.67 GB: the two processes peaked at 3.56 and 3.50 GB at 200 M; the merger 7 above its 4 + 4
    # + 4, the island side 15 above its served value's 4
    assert scale.memory_needed(200_000_000) == (1 << 30) + 38 * 200_000_000
    # 16-bit momentum and served value, the light island: 7 + 4 + 2 + 2 and 2 + 2
    state = scale.MergerState(
        scale.OuterConfig(momentum_dtype="bfloat16"),
        scale.SnapshotConfig("fp32", "int4", served_dtype="bf16"),
    )
    assert scale.memory_needed(10**9, state, light=True) == (1 << 30) + 19 * 10**9
    assert scale.memory_needed(10**9, state) == (1 << 30) + 32 * 10**9
    # two merger shards hold a share each: the same per parameter, a second process's runtime
    assert scale.memory_needed(10**9, state, True, shards=2) == (3 << 29) + 19 * 10**9


def test_more_shards_than_fragments_are_refused_before_any_work():
    run = dloco("bench", "scale", "--sizes", "1M", "--fragments", "2", "--shards", "3", timeout=60)
    assert run.returncode == 2 and "--shards 3" in run.stderr and "2 fragments" in run.stderr


@pytest.mark.skipif(
    not Path("/proc/meminfo").exists(), reason="the memory check reads Linux's /proc/meminfo"
)
def test_a_size_too_large_for_this_machine_is_refused_before_any_work():
    run = dloco("bench", "scale", "--sizes", "10M,1000G", timeout=60)
    assert (
        run.returncode == 2
        and "1000G needs about 38001.1 GB" in run.stderr
        and "give smaller --sizes" in run.stderr
        and "or --light-island" in run.stderr
    )
    light = dloco("bench", "scale", "--sizes", "1000G", "--light-island", timeout=60)
    assert light.returncode == 2 and "25001.1 GB" in light.stderr and "light island" in light.stderr


# a merger process, an island process and the broker's sockets: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bench_scale_json_has_every_stage_and_the_memory_figures():
    run = dloco("bench", "scale", "--json", "--sizes", "1M", "--reps", "1", timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    # progress on stderr, the figures on stdout
    assert "bench scale: 1M:" in run.stderr
    result = json.loads(run.stdout)
    assert result["fragments"] == 4 and result["reps"] == 1 and "4 x params" in result["unit"]
    (size,) = result["sizes"]
    assert (
        size["params"] == count(model_shapes(1_000_000))
        and size["memcpy_gbps"] > 0
        and size["join"]["fits"]
    )
    assert set(size["stages"]) == set(scale_goals.STAGES)
    for stage, figures in size["stages"].items():
        assert figures["seconds"] > 0 and len(figures["samples_s"]) == 1, stage
        assert all(
            math.isfinite(figures[key]) and figures[key] > 0
            for key in ("gbps", "vs_memcpy", "ns_per_param")
        ), (stage, figures)
    merger, island = size["merger"], size["island"]
    for memory in (merger, island):
        assert (
            math.isfinite(memory["bytes_per_param"])
            and memory["memory_kib"]["peak"] >= memory["memory_kib"]["baseline"] > 0
        )
        assert sum(memory["rise_bytes_per_param"].values()) == pytest.approx(
            memory["bytes_per_param"]
        )
    # the state both hold, exactly: the merger's parameters, momentum and served value; the island's
    # served value (float32), anchors' offsets and residuals (int8 in blocks of 256: 260 bytes a
    # block), and int4 chunks with their headers
    assert merger["held_bytes_per_param"] == pytest.approx(FLOAT32_STATE)
    # the join, then a diff per fold
    assert merger["counters"] == {"merger/snapshot_full": 4, "merger/snapshot_diff": 8}
    held = island["held_bytes_per_param"]
    assert (
        held["served"] == 4.0
        and 260 / 256 <= held["anchors"] == held["error_feedback"] < 1.03
        and 0.5 < held["retransmit"] < 0.6
    )
    assert set(result["goals"]) == {"linear_cost", "merger_rss", "island_rss", "island_plain_rss"}
    # without error feedback: no residuals
    plain = size["island_plain"]["held_bytes_per_param"]
    assert plain["error_feedback"] == 0 and plain["served"] == held["served"]
    assert all(
        isinstance(goal["met"], bool) and (goal["met"] or goal["why"])
        for goal in result["goals"].values()
    )
    # one size: nothing to grow
    assert result["goals"]["linear_cost"]["ratio"] == 1.0
    table = scale.summary(result).splitlines()
    assert any(line.split()[0] == "1M" for line in table[2:]) and table[-4].startswith(
        "goal linear cost"
    )
    # as at 350 M: the summary says an island could not join
    size["join"] = {**size["join"], "fits": False}
    assert "would not join" in scale.summary(result).splitlines()[-1]


def _one_million(*options: str) -> dict:
    """`dloco bench scale --json` at 1M, one timed round, with `options`: its JSON."""
    run = dloco("bench", "scale", "--json", "--sizes", "1M", "--reps", "1", *options, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


# a merger process, an island process and the broker's sockets: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bench_scale_holds_16_bit_state_when_asked():
    """--momentum-dtype bfloat16 --served-dtype bf16: the merger's momentum and served value and
    the island's served value take 2 bytes a parameter; --fragments is the partition's."""
    result = _one_million(
        "--fragments", "8", "--momentum-dtype", "bfloat16", "--served-dtype", "bf16"
    )
    assert (result["fragments"], result["momentum_dtype"], result["served_dtype"]) == (
        8,
        "bfloat16",
        "bf16",
    )
    (size,) = result["sizes"]
    assert size["merger"]["held_bytes_per_param"] == pytest.approx(
        {"parameters": 4.0, "optimizer": 2.0, "other_jax_arrays": 0.0, "served": 2.0}
    )
    assert size["merger"]["counters"] == {"merger/snapshot_full": 8, "merger/snapshot_diff": 16}
    for key in ("island", "island_plain"):
        assert size[key]["held_bytes_per_param"]["served"] == 2.0


# a merger process, an island process and the broker's sockets: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_light_island_sends_and_checks_every_fragment():
    """--light-island: no model on the island side, the merger's work and figures as before."""
    result = _one_million("--light-island")
    assert result["island_side"] == "light" and "light island" in scale.summary(result)
    (size,) = result["sizes"]
    # every fragment joined and a diff of each adopted per round (the pipeline checks both), and
    # the merger's state as with the full island
    assert size["merger"]["counters"] == {"merger/snapshot_full": 4, "merger/snapshot_diff": 8}
    assert size["merger"]["held_bytes_per_param"] == pytest.approx(FLOAT32_STATE)
    assert all(figures["seconds"] > 0 for figures in size["stages"].values())


# two merger processes, an island process and the broker's sockets: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_merger_shards_each_hold_and_serve_their_share():
    """--shards 2: each shard process folds, holds and serves its own fragments; its memory is per
    parameter of its share."""
    result = _one_million("--light-island", "--shards", "2")
    assert result["shards"] == 2 and "merger shards at 1M: fragments 0,2" in scale.summary(result)
    (size,) = result["sizes"]
    shards = size["merger_shards"]
    assert [shard["fragments"] for shard in shards] == [[0, 2], [1, 3]]
    assert sum(shard["params"] for shard in shards) == size["params"]
    for shard in shards:
        # its two fragments joined in full, then a diff of each per round (warm-up and one timed)
        assert shard["counters"] == {"merger/snapshot_full": 2, "merger/snapshot_diff": 4}
        # its share's parameters, momentum and served value, and nothing of the other shard's
        assert shard["held_bytes_per_param"] == pytest.approx(FLOAT32_STATE)
    assert size["merger"] == max(shards, key=lambda shard: shard["bytes_per_param"])
    assert all(figures["seconds"] > 0 for figures in size["stages"].values())
