"""`dloco bench merger --shards 1,2`: merger ingest with the fragments split over S merger shards.

For each S, S shard processes run side by side, each the real pipeline of benchmarks/merger_pass.py
over its own fragments' deltas (f % S == its index: what the islands' publishers send it once
they filter by topic), with its own sender process.  The shards start every pass together (the
parent releases them at once); the pass's aggregate ingest is all shards' wire bytes over the
time from the first shard's first message to the last shard's last synced fold.  Reported per
S: the median warm pass's aggregate, its ratio to one shard's in the same run, and each shard's
CPU seconds (its process: loop thread and fold worker) per pass and per GB.  On 2 cores with the
senders sharing them, no gain is expected: the figure says what a second shard costs here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from dloco.benchmarks.timing import gbps


def _pass_of(results: list[dict]) -> dict:
    """One pass of S shards run together: aggregate wire bytes per second, and each shard's CPU."""
    began = min(r["ended_at"] - r["seconds"] for r in results)
    ended = max(r["ended_at"] for r in results)
    wire = sum(r["wire_bytes"] for r in results)
    return {
        "ingest_gbps": gbps(wire, ended - began),
        "seconds": ended - began,
        "wire_bytes": wire,
        "shard_cpu_s": [r["cpu_s"] for r in results],
        "shard_seconds": [r["seconds"] for r in results],
        "shard_wire_bytes": [r["wire_bytes"] for r in results],
    }


def _run_shards(
    count: int, params: int, fragments: int, islands: int, rounds: int, passes: int, log
) -> list[dict]:
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "dloco.benchmarks.merger_shards",
                "--child",
                f"{index}/{count}",
                "--params",
                str(params),
                "--fragments",
                str(fragments),
                "--islands",
                str(islands),
                "--rounds",
                str(rounds),
                "--passes",
                str(passes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for index in range(count)
    ]
    done = []
    try:
        for number in range(1 + passes):
            # each has compiled its folds and built its state: ready for the pass
            for child in children:
                line = child.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(
                        f"a shard process of {count} stopped before pass {number} (exit"
                        f" {child.poll()}): {line!r}"
                    )
            log(
                f"bench merger: {count} shard(s),"
                f" {'cold pass' if number == 0 else f'warm pass {number} of {passes}'} ..."
            )
            for child in children:
                child.stdin.write("go\n")
                child.stdin.flush()
            done.append(_pass_of([json.loads(child.stdout.readline()) for child in children]))
        for child in children:
            if child.wait(timeout=120) != 0:
                raise RuntimeError(f"a shard process of {count} exited with {child.returncode}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    return done


def run(
    params: int,
    fragments: int,
    islands: int,
    rounds: int,
    passes: int,
    shard_counts: list[int],
    log=lambda line: print(line, file=sys.stderr),
) -> dict:
    if any(count > fragments for count in shard_counts):
        from dloco.protocol.errors import ConfigError

        raise ConfigError(
            f"--shards {shard_counts}: a shard needs a fragment of its own (--fragments"
            f" {fragments})"
        )
    by_count = {}
    for count in shard_counts:
        passes_done = _run_shards(count, params, fragments, islands, rounds, passes, log)
        warm = sorted(passes_done[1:], key=lambda p: p["seconds"])
        median = warm[len(warm) // 2]
        by_count[count] = {
            "ingest_gbps": round(median["ingest_gbps"], 3),
            "samples_gbps": [round(p["ingest_gbps"], 3) for p in passes_done[1:]],
            "shard_cpu_s": median["shard_cpu_s"],
            "shard_busy": [
                round(c / s, 2) for c, s in zip(median["shard_cpu_s"], median["shard_seconds"])
            ],
            "cpu_s_per_gb": round(sum(median["shard_cpu_s"]) / (median["wire_bytes"] / 1e9), 2),
            "wire_bytes": median["wire_bytes"],
            "shard_wire_bytes": median["shard_wire_bytes"],
        }
    reference = by_count[shard_counts[0]]["ingest_gbps"]
    for result in by_count.values():
        result["vs_first"] = round(result["ingest_gbps"] / reference, 3)
    return {
        "params": params,
        "fragments": fragments,
        "islands": islands,
        "rounds": rounds,
        "shards": by_count,
    }


def summary(result: dict) -> str:
    parts = [
        f"{count} shard(s): {r['ingest_gbps']:.3f} GB/s (x{r['vs_first']:.2f}; samples"
        f" {r['samples_gbps']}), CPU s per shard {r['shard_cpu_s']} (busy {r['shard_busy']} of a"
        f" core), {r['cpu_s_per_gb']} CPU s per GB"
        for count, r in result["shards"].items()
    ]
    return (
        f"merger ingest by shards ({result['params']:,} params, {result['islands']} islands x"
        f" {result['fragments']} fragments): " + "; ".join(parts)
    )


def _child(args: argparse.Namespace) -> None:
    """One shard: warm up, then for each pass wait for the parent's go and print the pass as
    JSON."""
    import zmq

    from dloco.benchmarks.delta_sender import synthetic_shapes
    from dloco.benchmarks.merger_pass import merger_pass, warm_up
    from dloco.merger.config import MergeConfig, MergerConfig, RoundConfig
    from dloco.merger.memory import keep_freed_memory
    from dloco.protocol import shards

    index, count = shards.parse(args.child)
    owned = shards.owned(index, count, args.fragments)
    keep_freed_memory()
    config = MergerConfig(
        MergeConfig(max_staleness=args.rounds),
        round=RoundConfig(quorum=args.islands, grace_cap_s=0.0),
    )
    warm_up(config, synthetic_shapes(args.params, args.fragments), args.fragments, args.islands)
    context = zmq.Context()
    for _ in range(1 + args.passes):
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        result = merger_pass(
            context, config, args.params, args.fragments, args.islands, args.rounds, owned=owned
        )
        print(
            json.dumps({k: result[k] for k in ("wire_bytes", "seconds", "cpu_s", "ended_at")}),
            flush=True,
        )
    context.destroy(linger=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--params", "--fragments", "--islands", "--rounds", "--passes"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--child", required=True, metavar="I/N")
    _child(parser.parse_args())
