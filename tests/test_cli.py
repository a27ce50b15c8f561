"""The `dloco` command line: the codec benchmark's JSON contract and clear errors for bad
arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dloco import protocol


def dloco(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", *args], capture_output=True, text=True, timeout=timeout
    )


def test_bench_codec_json_has_every_figure():
    run = dloco("bench", "codec", "--json", "--mib", "8", "--reps", "2")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["memcpy_gbps"] > 0
    assert set(result["codecs"]) == set(protocol.CODEC_NAMES)
    for name, stats in result["codecs"].items():
        for key in (
            "quantize_gbps",
            "dequantize_gbps",
            "roundtrip_max_rel_err",
            "wire_bytes_per_param",
            "frame_encode_gbps",
            "frame_decode_gbps",
        ):
            # rates and sizes are positive; an error may be 0 (fp32)
            assert stats[key] > 0 or (key == "roundtrip_max_rel_err" and stats[key] >= 0), (
                name,
                key,
            )
    codecs = result["codecs"]
    assert codecs["fp32"]["roundtrip_max_rel_err"] == 0
    # half a step of the largest block
    assert codecs["int8"]["roundtrip_max_rel_err"] <= 0.5 / 127 * (1 + 1e-5)
    assert codecs["int4"]["roundtrip_max_rel_err"] <= 0.5 / 7 * (1 + 1e-5)
    assert (
        codecs["int4"]["wire_bytes_per_param"] <= 0.53
        and codecs["int8"]["wire_bytes_per_param"] <= 1.02
    )
    # progress goes to stderr, the figures to stdout
    assert "bench codec: int4" in run.stderr


@pytest.mark.timeout(240)
def test_bench_merger_json_folds_every_delta_and_says_where_the_time_went():
    """A small model, one round: the benchmark folds every delta it sent (it raises otherwise) and
    accounts for the loop thread and the fold worker; its 2-core bound is above what it measured."""
    run = dloco(
        "bench",
        "merger",
        "--json",
        "--params",
        "400000",
        "--rounds",
        "1",
        "--passes",
        "2",
        timeout=220,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["params"] > 300_000 and result["codec"] == "int4" and result["folds"] >= 1
    # four islands' int4 deltas
    assert result["wire_bytes"] > result["params"] * 4 * 0.5
    assert (
        result["merger_ingest_gbps"] > 0
        and result["cold_ingest_gbps"] > 0
        and result["raw_zmq_recv_gbps"] > 0
    )
    assert (
        len(result["warm_ingest_gbps_samples"]) == 2
        and result["merger_ingest_gbps"] in result["warm_ingest_gbps_samples"]
    )
    assert result["loop_busy_s"] > 0 and result["fold_worker_busy_s"] > 0 and result["cores"] >= 1
    assert result["cpu_bound_gbps"] >= result["merger_ingest_gbps"]


@pytest.mark.timeout(240)
def test_bench_merger_shards_splits_the_same_work_over_shard_processes():
    """--shards 1,2: every shard folds every delta of its fragments (each pass raises otherwise);
    two shards carry the same wire bytes as one, each about half, and the CPU is accounted per
    shard; bad counts are refused."""
    run = dloco(
        "bench",
        "merger",
        "--json",
        "--params",
        "400000",
        "--rounds",
        "1",
        "--passes",
        "1",
        "--shards",
        "1,2",
        timeout=220,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    shards = json.loads(run.stdout)["shards"]
    assert (
        sorted(shards) == ["1", "2"]
        and shards["1"]["vs_first"] == 1.0
        and len(shards["2"]["shard_cpu_s"]) == 2
    )
    assert all(r["ingest_gbps"] > 0 and r["cpu_s_per_gb"] > 0 for r in shards.values())
    assert (
        shards["2"]["wire_bytes"]
        == sum(shards["2"]["shard_wire_bytes"])
        == shards["1"]["wire_bytes"]
    )
    # 4 fragments of equal size, 2 each
    assert min(shards["2"]["shard_wire_bytes"]) > 0.4 * shards["1"]["wire_bytes"]
    assert (
        dloco("bench", "merger", "--shards", "1,0").returncode == 2
        and dloco("bench", "merger", "--shards", "8").returncode == 2
    )


def test_bench_codec_table_is_the_default():
    run = dloco("bench", "codec", "--mib", "4", "--reps", "1")
    assert run.returncode == 0 and "memcpy" in run.stdout and "int4" in run.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (("bench", "codec", "--mib", "0"), "positive integer"),
        (("bench", "codec", "--block", "100", "--mib", "4"), "power of two"),
        (("bench", "nosuch"), "invalid choice"),
        ((), "required"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(args, message):
    run = dloco(*args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
