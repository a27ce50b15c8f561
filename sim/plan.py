"""`dloco plan`: a scenario simulated (sim/engine.py) beside the synchronous baselines (sim/baselines.py),
as one dict that prints as Markdown or JSON; `--target-util` inverts utilisation to link speed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dloco.sim.baselines import SyncResult, needed_bps, sync_diloco, sync_dp
from dloco.sim.engine import SimResult, simulate
from dloco.sim.scenario import Scenario

TARGET_ROUNDS = 20  # --target-util simulates this many rounds of the slowest island per probe (or the scenario's length if shorter)
BYTES_PER_VALUE_MERGER = 4 + 4 + 4  # the merger's fp32 value, its Nesterov momentum, and the last served value (diff snapshots)


def plan(s: Scenario) -> dict:
    result = simulate(s)
    dp, diloco = sync_dp(s), sync_diloco(s)
    return report(result, dp, diloco)


def report(result: SimResult, dp: SyncResult, diloco: SyncResult) -> dict:
    s = result.scenario
    trained = sum(run.trained_tokens for run in result.islands)
    up = sum(run.bytes_up for run in result.islands)
    down = sum(run.bytes_down for run in result.islands)
    islands = [{
        "name": run.name, "step_s": spec.step_s, "tokens_per_step": spec.tokens_per_step,
        "up_gbps": None if spec.link.up_bps is None else spec.link.up_bps / 1e9,
        "down_gbps": None if spec.link.down_bps is None else spec.link.down_bps / 1e9, "rtt_ms": spec.link.rtt_s * 1000,
        "utilisation": result.utilisation(run), "busy": run.compute_s / s.duration_s,
        "sync_dp_utilisation": dp.utilisation[run.name], "sync_diloco_utilisation": diloco.utilisation[run.name],
        "trained_tokens": run.trained_tokens, "lost_tokens": round(run.lost_tokens), "rejected": dict(run.rejected),
        "deltas_sent": run.deltas_sent, "deltas_summed": run.deltas_summed, "failures": run.failures,
        "bytes_up_per_token": run.bytes_up / max(run.trained_tokens, 1), "bytes_down_per_token": run.bytes_down / max(run.trained_tokens, 1),
    } for run, spec in zip(result.islands, s.islands)]
    folds = sum(result.folds)
    staleness = dict(sorted(result.staleness.items()))
    decoupled_tokens_s = result.useful_tokens_s
    return {
        "scenario": {"islands": len(s.islands), "params": s.params, "fragments": s.fragments, "interval": s.interval, "codec": s.codec,
                     "duration_s": s.duration_s, "failures": len(s.failures), "merger": dataclasses.asdict(s.merger),
                     "merger_gbps": s.merger_bytes_s * 8 / 1e9},
        "islands": islands,
        "cluster": {
            "decoupled_tokens_s": decoupled_tokens_s, "sync_dp_tokens_s": dp.tokens_s, "sync_diloco_tokens_s": diloco.tokens_s,
            "speedup_vs_sync_dp": decoupled_tokens_s / dp.tokens_s, "speedup_vs_sync_diloco": decoupled_tokens_s / diloco.tokens_s,
            "seconds_per_mtoken": {"decoupled": 1e6 / decoupled_tokens_s, "sync-dp": 1e6 / dp.tokens_s, "sync-diloco": 1e6 / diloco.tokens_s},
            "goodput": {"decoupled": result.goodput, "sync-dp": dp.goodput, "sync-diloco": diloco.goodput},
            "bytes_per_token": {"decoupled": {"up": up / max(trained, 1), "down": down / max(trained, 1)},
                                "sync-dp": {"up": dp.bytes_up_per_token, "down": dp.bytes_down_per_token},
                                "sync-diloco": {"up": diloco.bytes_up_per_token, "down": diloco.bytes_down_per_token}},
            "sync_dp_round_s": dp.round_s, "sync_dp_exchange_s": dp.exchange_s, "sync_diloco_round_s": diloco.round_s,
        },
        "merger": {
            "folds_per_fragment": list(result.folds), "folds": folds,
            "ingest_bytes_s": up / s.duration_s, "fold_worker_busy": result.fold_busy_s / s.duration_s,
            "memory_bytes": s.params * BYTES_PER_VALUE_MERGER + result.peak_pending_bytes, "peak_pending_bytes": result.peak_pending_bytes,
            "staleness": staleness,
        },
        "events": result.events,
    }


def target_util(s: Scenario, target: float) -> dict:
    """Per island, the link speed (both ways; the others' links as given) at which its decoupled
    utilisation reaches `target`; for the synchronous modes, the speed every link needs."""
    require_target(target)
    s = dataclasses.replace(s, duration_s=min(s.duration_s, TARGET_ROUNDS * s.longest_round_s()))
    per_island = {}
    for island in s.islands:
        def util(bps: float) -> float:
            result = simulate(s.with_links(bps, only=island.name))
            return result.utilisation(next(run for run in result.islands if run.name == island.name))
        per_island[island.name] = _bisect(util, target)
    return {"target": target, "decoupled_gbps": {name: None if bps is None else bps / 1e9 for name, bps in per_island.items()},
            "sync_dp_gbps": _gbps(needed_bps("sync-dp", s, target)), "sync_diloco_gbps": _gbps(needed_bps("sync-diloco", s, target))}


def require_target(target: float) -> None:
    from dloco.protocol.errors import require
    require(0 < target < 1, f"--target-util must be in (0, 1), got {target}")


def _gbps(bps: float | None) -> float | None:
    return None if bps is None else bps / 1e9


def _bisect(util, target: float, lo: float = 1e6, hi: float = 1e13, steps: int = 24) -> float | None:
    """The smallest link speed (bits/s, to ~5 %) with util(speed) >= target; None if even `hi` falls short.
    Utilisation does not fall as a link gets faster (a bisection on the log scale)."""
    if util(hi) < target:
        return None
    if util(lo) >= target:
        return lo
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        if util(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1.05:
            break
    return hi


def markdown(p: dict, target: dict | None = None) -> str:
    sc, cl, mg = p["scenario"], p["cluster"], p["merger"]
    lines = [f"# dloco plan: {sc['islands']} islands, {sc['params']:,} parameters, P = {sc['fragments']}, H = {sc['interval']}, "
             f"{sc['codec']}, {sc['duration_s'] / 3600:.2f} h simulated, {sc['failures']} failures", "",
             "## Islands", "",
             "| island | step s | link up/down Gbit/s, RTT ms | utilisation (decoupled) | busy | sync-DP | sync-DiLoCo | "
             "up B/token | down B/token | deltas sent (summed) | rejected | failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i in p["islands"]:
        lines.append(f"| {i['name']} | {i['step_s']:.3g} | {_g(i['up_gbps'])}/{_g(i['down_gbps'])}, {i['rtt_ms']:.0f} | {i['utilisation']:.3f} | "
                     f"{i['busy']:.3f} | {i['sync_dp_utilisation']:.3f} | {i['sync_diloco_utilisation']:.3f} | {i['bytes_up_per_token']:.3g} | "
                     f"{i['bytes_down_per_token']:.3g} | {i['deltas_sent']} ({i['deltas_summed']}) | "
                     f"{', '.join(f'{k} {v}' for k, v in i['rejected'].items()) or '-'} | {i['failures']} |")
    bpt = cl["bytes_per_token"]
    lines += ["", "## Cluster", "",
              "| | decoupled | sync-DP | sync-DiLoCo |", "|---|---|---|---|",
              f"| useful tokens/s | {cl['decoupled_tokens_s']:,.0f} | {cl['sync_dp_tokens_s']:,.0f} | {cl['sync_diloco_tokens_s']:,.0f} |",
              f"| seconds per million tokens | {cl['seconds_per_mtoken']['decoupled']:.3g} | {cl['seconds_per_mtoken']['sync-dp']:.3g} | "
              f"{cl['seconds_per_mtoken']['sync-diloco']:.3g} |",
              f"| goodput (of the chips' peak, with failures) | {cl['goodput']['decoupled']:.3f} | {cl['goodput']['sync-dp']:.3f} | "
              f"{cl['goodput']['sync-diloco']:.3f} |",
              f"| bytes per token, up / down | {bpt['decoupled']['up']:.3g} / {bpt['decoupled']['down']:.3g} | "
              f"{bpt['sync-dp']['up']:.3g} / {bpt['sync-dp']['down']:.3g} | {bpt['sync-diloco']['up']:.3g} / {bpt['sync-diloco']['down']:.3g} |",
              "", f"Decoupled is **{cl['speedup_vs_sync_dp']:.1f}x** sync-DP's tokens per second and {cl['speedup_vs_sync_diloco']:.2f}x "
              f"sync-DiLoCo's (sync-DP: a {cl['sync_dp_round_s']:.3g} s step, {cl['sync_dp_exchange_s']:.3g} s of it the all-reduce).",
              "", "## Merger", "",
              f"- folds: {mg['folds']} ({', '.join(map(str, mg['folds_per_fragment']))} per fragment); staleness of folded deltas: "
              f"{', '.join(f'{k}: {v}' for k, v in mg['staleness'].items())}",
              f"- ingest: {mg['ingest_bytes_s'] * 8 / 1e9:.3g} Gbit/s of deltas; the fold worker busy {mg['fold_worker_busy']:.1%} of the time "
              f"at {sc['merger_gbps']:.3g} Gbit/s folded",
              f"- memory: {mg['memory_bytes'] / 2**30:.3g} GiB (value, momentum and served value in fp32, plus at most "
              f"{mg['peak_pending_bytes'] / 2**30:.3g} GiB of deltas waiting for a fold)"]
    if target is not None:
        lines += ["", f"## Link speed for utilisation {target['target']}", "",
                  "| island | decoupled: its own link, Gbit/s |", "|---|---|"]
        lines += [f"| {name} | {_g(gbps, 'unreachable')} |" for name, gbps in target["decoupled_gbps"].items()]
        lines += ["", f"For the slowest island (which paces every round) to be {target['target']} busy, every link needs: "
                  f"sync-DP {_speed(target['sync_dp_gbps'], 'unreachable at any speed (latency, or the merger)')}, "
                  f"sync-DiLoCo {_speed(target['sync_diloco_gbps'], 'unreachable at any speed')} "
                  "(faster islands wait for it whatever the link)."]
    return "\n".join(lines) + "\n"


def _speed(gbps: float | None, none: str) -> str:
    return none if gbps is None else f"{gbps:.3g} Gbit/s"


def _g(value: float | None, none: str = "unlimited") -> str:
    return none if value is None else f"{value:.3g}"


def write_json(p: dict, path: Path | None = None) -> str:
    text = json.dumps(p, indent=2, sort_keys=True)
    if path is not None:
        Path(path).write_text(text + "\n")
    return text
