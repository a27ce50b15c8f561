"""`dloco plan`: a scenario simulated (sim/engine.py) beside the synchronous baselines
(sim/baselines.py), as one dict that prints as Markdown or JSON (sim/planreport.py);
`--target-util` inverts utilisation to link speed (sim/targetutil.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dloco.cluster.sections import MergerSection
from dloco.merger.config import OuterConfig, SnapshotConfig
from dloco.sim.baselines import SyncResult, sync_diloco, sync_dp
from dloco.sim.engine import simulate
from dloco.sim.results import IslandRun, SimResult
from dloco.sim.scenario import Island, Scenario

# fold workers busy this share of the run or more: at capacity, a backlog grows (reported, and its
# deltas not counted)
OVERLOADED = 0.95
# the outer optimizer's buffers per parameter: Nesterov's momentum; Round and Delayed Nesterov's
# momentum and a round's sum of pseudo-gradients (merger/fold/outer.py)
OUTER_BUFFERS = {"sgd": 0, "nesterov": 1, "round_nesterov": 2, "delayed_nesterov": 2}


def merger_bytes_per_value(merger: MergerSection) -> int:
    """What the merger holds per parameter: its float32 value, its outer optimizer's buffers (in
    `momentum_dtype`) and, with diff snapshots, the value served to islands (in `served_dtype`)."""
    buffers = OUTER_BUFFERS[merger.outer] * OuterConfig.MOMENTUM_BYTES[merger.momentum_dtype]
    served = (
        0
        if merger.snapshot_diff_codec == "none"
        else SnapshotConfig.SERVED_BYTES[merger.served_dtype]
    )
    return 4 + buffers + served


def plan(s: Scenario) -> dict:
    result = simulate(s)
    dp, diloco = sync_dp(s), sync_diloco(s)
    return report(result, dp, diloco)


def _spread(values: list[int]) -> dict:
    """Median and 95th percentile (None when nothing was folded)."""
    if not values:
        return {"median": None, "p95": None}
    return {"median": float(np.median(values)), "p95": float(np.percentile(values, 95))}


def report(result: SimResult, dp: SyncResult, diloco: SyncResult) -> dict:
    """The plan: the scenario, each island, the cluster's tokens and speed against the synchronous
    baselines, the merger's load, and the run's events."""
    s = result.scenario
    return {
        "scenario": _scenario_report(s, dp, diloco),
        "islands": [
            _island_report(result, run, spec, dp, diloco)
            for run, spec in zip(result.islands, s.islands)
        ],
        "cluster": _cluster_report(result, dp, diloco),
        "merger": _merger_report(result),
        "events": result.events,
    }


def _scenario_report(s: Scenario, dp: SyncResult, diloco: SyncResult) -> dict:
    """What was simulated, and how the baselines run at their best practice."""
    return {
        "islands": len(s.islands),
        "params": s.params,
        "fragments": s.fragments,
        "interval": s.interval,
        "codec": s.codec,
        "duration_s": s.duration_s,
        "failures": len(s.failures),
        "merger": dataclasses.asdict(s.merger),
        "merger_gbps": s.fold_bytes_s * 8 / 1e9,
        "merger_gbps_assumed": s.merger_bytes_s is None,
        "merger_shards": s.merger_shards,
        "merger_link_gbps": None if s.merger_link_bps is None else s.merger_link_bps / 1e9,
        "quality": {
            "points": [list(point) for point in s.quality.points],
            "source": s.quality.source,
        },
        "sync_dp": dp.practice,
        "sync_diloco": diloco.practice,
    }


def _island_report(
    result: SimResult, run: IslandRun, spec: Island, dp: SyncResult, diloco: SyncResult
) -> dict:
    """One island: its settings, utilisation in each mode, tokens, deltas and bytes per token."""
    s = result.scenario
    return {
        "name": run.name,
        "step_s": spec.step_s,
        "tokens_per_step": spec.tokens_per_step,
        "interval": spec.interval or s.interval,
        "up_gbps": None if spec.link.up_bps is None else spec.link.up_bps / 1e9,
        "down_gbps": None if spec.link.down_bps is None else spec.link.down_bps / 1e9,
        "rtt_ms": spec.link.rtt_s * 1000,
        "utilisation": result.utilisation(run),
        "window_utilisation": result.window_utilisation(run),
        "busy": run.compute_s / s.duration_s,
        "startup_s": run.startup_s,
        "real_interval": _spread(run.intervals),
        "sync_dp_utilisation": dp.utilisation[run.name],
        "sync_diloco_utilisation": diloco.utilisation[run.name],
        "trained_tokens": run.trained_tokens,
        "folded_tokens": round(run.folded_tokens),
        "useful_tokens": round(run.useful_tokens),
        "undecided_tokens": round(run.undecided_tokens),
        "lost_tokens": round(run.lost_tokens),
        "rejected": dict(run.rejected),
        "deltas_sent": run.deltas_sent,
        "deltas_summed": run.deltas_summed,
        "failures": run.failures,
        "bytes_up_per_token": run.bytes_up / max(run.trained_tokens, 1),
        "bytes_down_per_token": run.bytes_down / max(run.trained_tokens, 1),
    }


def _cluster_report(result: SimResult, dp: SyncResult, diloco: SyncResult) -> dict:
    """The whole cluster: where its tokens went, and its speed, goodput and bytes per token against
    the synchronous baselines'."""
    trained = sum(run.trained_tokens for run in result.islands)
    up = sum(run.bytes_up for run in result.islands)
    down = sum(run.bytes_down for run in result.islands)
    decoupled_tokens_s = result.useful_tokens_s
    return {
        "tokens": {
            "trained": trained,
            "folded": round(sum(run.folded_tokens for run in result.islands)),
            "useful": round(sum(run.useful_tokens for run in result.islands)),
            "undecided": round(sum(run.undecided_tokens for run in result.islands)),
            "queued_at_merger": round(result.queued_tokens),
            "lost": round(sum(run.lost_tokens for run in result.islands)),
        },
        "real_interval": _spread([h for fragment in result.intervals for h in fragment]),
        "decoupled_tokens_s": decoupled_tokens_s,
        "sync_dp_tokens_s": dp.useful_tokens_s,
        "sync_diloco_tokens_s": diloco.useful_tokens_s,
        "speedup_vs_sync_dp": decoupled_tokens_s / dp.useful_tokens_s,
        "speedup_vs_sync_diloco": decoupled_tokens_s / diloco.useful_tokens_s,
        "seconds_per_mtoken": {
            "decoupled": 1e6 / decoupled_tokens_s if decoupled_tokens_s else None,
            "sync-dp": 1e6 / dp.useful_tokens_s,
            "sync-diloco": 1e6 / diloco.useful_tokens_s,
        },
        "goodput": {
            "decoupled": result.goodput,
            "sync-dp": dp.goodput,
            "sync-diloco": diloco.goodput,
        },
        "bytes_per_token": {
            "decoupled": {"up": up / max(trained, 1), "down": down / max(trained, 1)},
            "sync-dp": {"up": dp.bytes_up_per_token, "down": dp.bytes_down_per_token},
            "sync-diloco": {
                "up": diloco.bytes_up_per_token,
                "down": diloco.bytes_down_per_token,
            },
        },
        "sync_dp_round_s": dp.round_s,
        "sync_dp_exchange_s": dp.exchange_s,
        "sync_diloco_round_s": diloco.round_s,
    }


def _merger_report(result: SimResult) -> dict:
    """The merger: its folds, ingest, load and backlog, memory, and the staleness it folded."""
    s = result.scenario
    up = sum(run.bytes_up for run in result.islands)
    load = result.fold_load
    return {
        "folds_per_fragment": list(result.folds),
        "folds": sum(result.folds),
        "ingest_bytes_s": up / s.duration_s,
        "fold_worker_busy": min(1.0, load),
        "fold_load": load,
        "overloaded": load >= OVERLOADED,
        "backlog_s": max(result.backlog_s),
        "queued_bytes": result.queued_bytes,
        "queued_tokens": round(result.queued_tokens),
        "memory_bytes": s.params * merger_bytes_per_value(s.merger) + result.peak_pending_bytes,
        "state_bytes_per_param": merger_bytes_per_value(s.merger),
        "peak_pending_bytes": result.peak_pending_bytes,
        "staleness": dict(sorted(result.staleness.items())),
    }
