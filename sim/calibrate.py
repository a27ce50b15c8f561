"""`dloco plan --calibrate RUN_DIR`: simulate a finished `dloco up` run and set prediction beside
measurement.

The scenario comes from the run itself: its regions, links and settings (RUN_DIR/cluster.json, or
the cluster file given), each island's measured step time (its metrics, compile step left out) and
start, the merger's measured fold time (its log), and every fragment's bytes on the wire from
encoding the run's own initial model (init.npz) with the real codecs and chunking.  What is
compared: compute utilisation per island, folds per fragment, bytes per token up and down per
island, and the staleness of the folded deltas; listed beside them, each island's deltas sent and
summed, and what the simulator does not model (a delta bus that dropped, a drain cut short).
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

import numpy as np

from dloco import protocol
from dloco.analysis.runinfo import RunDirError, merger_folds, read_events
from dloco.cluster.records import RunCluster
from dloco.sim.engine import simulate
from dloco.sim.scenario import Island, Link, Scenario

TOLERANCE = 0.15


def load_run(run_dir: Path, config: Path | None = None) -> tuple[Scenario, dict]:
    """(the scenario of a finished run, what was measured in it)."""
    run_dir = Path(run_dir)
    cluster = _cluster(run_dir, config)
    series = {region.name: _steps(run_dir, region.name) for region in cluster.regions}
    # the earliest start of an island's training loop
    reference = min(
        (steps[0]["wall"] - steps[0]["time"] for steps in series.values()), default=None
    )
    islands, measured = [], {"islands": {}}
    for region in cluster.regions:
        island = _island(region, series[region.name], reference)
        islands.append(island)
        measured["islands"][region.name] = _measured_island(
            run_dir, region.name, series[region.name], island.step_s
        )
    end = max([0.0, *(steps[-1]["wall"] - reference for steps in series.values())])
    # every shard's (and a standby's after a takeover)
    folds = merger_folds(run_dir)
    if not folds:
        raise RunDirError(f"{run_dir}: the merger's log has no folds")
    sync, merger = cluster.sync, cluster.merger
    per_fragment = collections.Counter(e["fragment"] for e in folds)
    measured["folds_per_fragment"] = [per_fragment[p] for p in range(sync.fragments)]
    measured["staleness"] = collections.Counter(s for e in folds for s in e["staleness"])
    fold_s = statistics.median(e["fold_ms"] for e in folds) / 1000
    scenario = Scenario(
        tuple(islands),
        _params(run_dir),
        sync.fragments,
        sync.interval,
        sync.codec,
        sync.block,
        merger=merger,
        merger_bytes_s=1e15,
        fold_overhead_s=fold_s,
        duration_s=end,
        restart_s=0.0,
        wire=_wire(run_dir, sync, merger),
    )
    return scenario, measured


def _cluster(run_dir: Path, config: Path | None) -> RunCluster:
    """The run's cluster (RUN_DIR/cluster.json, or the cluster file `config`), if calibration can
    simulate it."""
    if config is not None:
        from dloco.cluster.config import load

        cluster = RunCluster.of(load(config))
    else:
        cluster = RunCluster.read(run_dir)
    if cluster.mode != "decoupled" or cluster.sync.adoption != "rebase":
        raise RunDirError(
            f"{run_dir}: calibration simulates decoupled runs with adoption 'rebase', this one ran "
            f"{cluster.mode} with {cluster.sync.adoption!r}"
        )
    return cluster


def _steps(run_dir: Path, name: str) -> list[dict]:
    """Island `name`'s steps as its metrics log them, those evaluated after training left out."""
    events = read_events(run_dir / "metrics" / f"{name}.jsonl")
    if any(e.get("life", 0) for e in events):
        raise RunDirError(
            f"{run_dir}: island {name} restarted; calibration simulates runs without chaos"
        )
    # deferred: evaluated after training
    steps = [e for e in events if e.get("step", 0) >= 1 and "wall" in e and not e.get("deferred")]
    if len(steps) < 3:
        raise RunDirError(
            f"{run_dir}: island {name} has {len(steps)} steps in its metrics;"
            " calibration needs a finished run"
        )
    return steps


def _island(region, steps: list[dict], reference: float) -> Island:
    """A region as the simulator's island: its link, and its step time, noise and start measured
    (`reference`: the cluster's first training loop's start)."""
    first, last = steps[0], steps[-1]
    step_s = (last["time"] - first["time"]) / (last["step"] - first["step"])
    link = Link(_bps(region.uplink_mbps), _bps(region.downlink_mbps), region.rtt_ms / 1000)
    gaps = [
        b["time"] - a["time"] for a, b in zip(steps[1:], steps[2:]) if b["step"] == a["step"] + 1
    ]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps) if len(gaps) > 1 else 0.0
    return Island(
        region.name,
        step_s,
        round(last["tokens"] / last["step"]),
        link,
        start_s=max(0.0, first["wall"] - reference - step_s),
        step_cv=cv,
        # decoupled (checked above): a region's own H, if it has one
        interval=region.interval,
    )


def _measured_island(run_dir: Path, name: str, steps: list[dict], step_s: float) -> dict:
    """What island `name` measured: compute utilisation, steps, step time, bytes per token."""
    last = steps[-1]
    # bytes up: from the island's summary after its drain when there is one (every delta of its
    # work sent; its last step's line misses what its uplink still had queued, as much as the
    # link lags)
    events = [e for e in read_events(run_dir / "logs" / f"{name}.log") if isinstance(e, dict)]
    done = [e for e in events if e.get("event") == "done"]
    sent = (
        done[-1]["bytes_sent"] / done[-1]["tokens"]
        if done and "bytes_sent" in done[-1] and done[-1].get("tokens")
        else None
    )
    summary = done[-1] if done else {}
    return {
        "compute_util": last["compute_util"],
        "steps": last["step"],
        "step_s": step_s,
        "bytes_up_per_token": sent if sent is not None else last["bytes_sent"] / last["tokens"],
        "bytes_down_per_token": last["bytes_received"] / last["tokens"],
        # What the simulator does not model: a delta bus that dropped (a starved process misses
        # ZMTP heartbeats) holds deltas in the outbox, summed; a drain cut short leaves some unsent.
        "deltas": {
            "sent": summary.get("deltas_sent"),
            "summed": summary.get("summed"),
            "bus_drops": summary.get("links", {}).get("delta-bus", {}).get("down"),
            "drained": not any(e.get("event") == "drain_incomplete" for e in events),
        },
    }


def _bps(mbps: float | None) -> float | None:
    return None if not mbps else mbps * 1e6


def _params(run_dir: Path) -> int:
    return sum(int(np.prod(shape)) for shape in _shapes(run_dir).values())


def _shapes(run_dir: Path) -> dict[str, tuple[int, ...]]:
    try:
        with np.load(run_dir / "init.npz") as npz:
            return {name: tuple(npz[name].shape) for name in npz.files}
    except (OSError, ValueError) as error:
        raise RunDirError(f"cannot read {run_dir / 'init.npz'}: {error}") from None


def _wire(run_dir: Path, sync, merger) -> tuple[tuple[int, int, int], ...]:
    """Per fragment, bytes on the wire of a delta, of a snapshot on the bus and of a full snapshot:
    the run's model encoded with the real codecs, chunked and framed as the processes do."""
    shapes = _shapes(run_dir)
    zeros = {path: np.zeros(shape, np.float32) for path, shape in shapes.items()}

    def nbytes(tensors: dict, codec: protocol.Codec, limit: int) -> int:
        plans = protocol.split_fragment(tensors, codec, limit)
        total = 0
        for index, plan in enumerate(plans):
            message = protocol.DeltaChunk(
                sender="calibrate",
                epoch=1,
                seq=1,
                delta_id=1,
                fragment=0,
                base_version=0,
                chunk_index=index,
                chunk_count=len(plans),
                steps=1,
                tokens=1,
                model="0" * 16,
                codec=codec,
                slices=plan.slices,
                payloads=plan.payloads,
            )
            total += sum(memoryview(frame).nbytes for frame in protocol.encode(message))
        return total

    wire = []
    for paths in protocol.partition(shapes, sync.fragments):
        part = {path: zeros[path] for path in paths}
        full = nbytes(
            part,
            protocol.Codec(merger.snapshot_codec, sync.block),
            protocol.DEFAULT_MAX_CHUNK_BYTES,
        )
        diff = merger.snapshot_diff_codec
        wire.append(
            (
                nbytes(part, protocol.Codec(sync.codec, sync.block), sync.chunk_bytes),
                (
                    full
                    if diff == "none"
                    else nbytes(
                        part, protocol.Codec(diff, sync.block), protocol.DEFAULT_MAX_CHUNK_BYTES
                    )
                ),
                full,
            )
        )
    return tuple(wire)


def calibrate(run_dir: Path, config: Path | None = None) -> dict:
    scenario, measured = load_run(run_dir, config)
    result = simulate(scenario)
    rows, deltas = [], {}
    for run, spec in zip(result.islands, scenario.islands):
        m = measured["islands"][run.name]
        deltas[run.name] = {
            "predicted": {"sent": run.deltas_sent, "summed": run.deltas_summed},
            "measured": m["deltas"],
        }
        life = scenario.duration_s - spec.start_s
        predicted = {
            "compute_util": run.compute_s / life if life > 0 else 0.0,
            "bytes_up_per_token": run.bytes_up / max(run.trained_tokens, 1),
            "bytes_down_per_token": run.bytes_down / max(run.trained_tokens, 1),
        }
        for key, value in predicted.items():
            rows.append(_row(f"{run.name}: {key.replace('_', ' ')}", value, m[key]))
    for fragment, (got, want) in enumerate(zip(result.folds, measured["folds_per_fragment"])):
        rows.append(_row(f"folds of fragment {fragment}", got, want))
    sim_stale, run_stale = _distribution(result.staleness), _distribution(measured["staleness"])
    rows.append(
        _row(
            "mean staleness of folded deltas",
            _mean(result.staleness),
            _mean(measured["staleness"]),
            absolute=0.15,
        )
    )
    return {
        "rows": rows,
        "staleness": {"simulated": sim_stale, "measured": run_stale},
        # per island: deltas sent and summed (measured: from its summary after the drain)
        "deltas": deltas,
        "within": sum(row["within"] for row in rows),
        "of": len(rows),
        "duration_s": scenario.duration_s,
    }


def _row(name: str, predicted: float, measured: float, absolute: float = 0.0) -> dict:
    error = (
        (predicted - measured) / measured if measured else (0.0 if predicted == 0 else float("inf"))
    )
    within = abs(error) <= TOLERANCE or abs(predicted - measured) <= absolute
    return {
        "metric": name,
        "predicted": predicted,
        "measured": measured,
        "error": error,
        "within": within,
    }


def _distribution(counts: collections.Counter) -> dict[int, float]:
    total = sum(counts.values())
    return {k: counts[k] / total for k in sorted(counts)} if total else {}


def _mean(counts: collections.Counter) -> float:
    total = sum(counts.values())
    return sum(k * v for k, v in counts.items()) / total if total else 0.0


def markdown(c: dict, run_dir: Path) -> str:
    lines = [
        f"# dloco plan --calibrate {run_dir}",
        "",
        (
            f"{c['within']} of {c['of']} within {TOLERANCE:.0%} (mean staleness: or within 0.15"
            f" versions); {c['duration_s']:.0f} s simulated."
        ),
        "",
        "| metric | predicted | measured | error |",
        "|---|---|---|---|",
    ]
    for row in c["rows"]:
        lines.append(
            f"| {row['metric']} | {row['predicted']:.4g} | {row['measured']:.4g} |"
            f" {row['error']:+.1%}{'' if row['within'] else ' **out**'} |"
        )
    lines += ["", "Deltas sent (of them summed in the outbox):", ""]
    for name, d in c["deltas"].items():
        got, want = d["predicted"], d["measured"]
        lines.append(
            f"- {name}: predicted {got['sent']} ({got['summed']}),"
            + (
                f" measured {want['sent']} ({want['summed']})"
                if want["sent"] is not None
                else " measured: no summary in its log"
            )
            + (f"; its delta bus dropped {want['bus_drops']} times" if want["bus_drops"] else "")
            + ("" if want["drained"] else "; its drain was cut short")
        )
    sim, run = c["staleness"]["simulated"], c["staleness"]["measured"]
    lines += [
        "",
        "Staleness of folded deltas (share of deltas):",
        "",
        "| staleness | predicted | measured |",
        "|---|---|---|",
    ]
    lines += [
        f"| {k} | {sim.get(k, 0):.3f} | {run.get(k, 0):.3f} |" for k in sorted(set(sim) | set(run))
    ]
    return "\n".join(lines) + "\n"


def to_json(c: dict) -> str:
    return json.dumps(c, indent=2, sort_keys=True, default=str)
