"""`dloco plan`: a scenario simulated (sim/engine.py) beside the synchronous baselines
(sim/baselines.py), as one dict that prints as Markdown or JSON; `--target-util` inverts utilisation
to link speed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dloco.protocol import Codec
from dloco.protocol.errors import require
from dloco.sim.baselines import SyncResult, sync_diloco, sync_dp
from dloco.sim.engine import SimResult, fragment_sizes, simulate, wire_bytes
from dloco.sim.scenario import Scenario

# --target-util's default window: rounds of the slowest island per probe (or the scenario's length
# if shorter)
TARGET_ROUNDS = 20
# fold workers busy this share of the run or more: at capacity, a backlog grows (reported, and its
# deltas not counted)
OVERLOADED = 0.95
# the merger's fp32 value, its Nesterov momentum, and the last served value (diff snapshots)
BYTES_PER_VALUE_MERGER = 4 + 4 + 4


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
    s = result.scenario
    trained = sum(run.trained_tokens for run in result.islands)
    up = sum(run.bytes_up for run in result.islands)
    down = sum(run.bytes_down for run in result.islands)
    islands = [
        {
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
        for run, spec in zip(result.islands, s.islands)
    ]
    folds = sum(result.folds)
    staleness = dict(sorted(result.staleness.items()))
    decoupled_tokens_s = result.useful_tokens_s
    load = result.fold_load
    return {
        "scenario": {
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
        },
        "islands": islands,
        "cluster": {
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
        },
        "merger": {
            "folds_per_fragment": list(result.folds),
            "folds": folds,
            "ingest_bytes_s": up / s.duration_s,
            "fold_worker_busy": min(1.0, load),
            "fold_load": load,
            "overloaded": load >= OVERLOADED,
            "backlog_s": max(result.backlog_s),
            "queued_bytes": result.queued_bytes,
            "queued_tokens": round(result.queued_tokens),
            "memory_bytes": s.params * BYTES_PER_VALUE_MERGER + result.peak_pending_bytes,
            "peak_pending_bytes": result.peak_pending_bytes,
            "staleness": staleness,
        },
        "events": result.events,
    }


MODES = ("decoupled", "sync-dp", "sync-diloco")


def utilisation_at(
    mode: str, s: Scenario, bps: float, scale: str = "all", window_rounds: int = TARGET_ROUNDS
) -> float:
    """The steady utilisation, in `mode`, of the islands whose links are at `bps` (`scale` "all":
    every island's, weighted by its tokens per second; else that island's), over `window_rounds`
    rounds of the slowest island after the slowest start-up download at that speed."""
    probe = s.with_links(bps, only=None if scale == "all" else scale)
    probe = dataclasses.replace(
        probe, duration_s=_startup_s(probe) + window_rounds * s.longest_round_s(), failures=()
    )
    names = {i.name for i in s.islands} if scale == "all" else {scale}
    rates = {i.name: i.tokens_per_step / i.step_s for i in s.islands if i.name in names}
    if mode == "decoupled":
        result = simulate(probe)
        share = {run.name: result.utilisation(run) for run in result.islands if run.name in names}
    else:
        share = (sync_dp if mode == "sync-dp" else sync_diloco)(probe).utilisation
    return sum(share[name] * rate for name, rate in rates.items()) / sum(rates.values())


def target_util(
    s: Scenario, targets: list[float], scale: str = "all", window_rounds: int = TARGET_ROUNDS
) -> dict:
    """For each target U and each mode, the link speed (both ways) from which the steady utilisation
    of the scaled islands stays at least U: every link scaled together (`scale` "all"), one island's
    (its name; the others as given), or each island's in turn ("each"; identical islands once).
    Each probe simulates the start-up download, then `window_rounds` rounds of the slowest island,
    without failures; the start-up is reported apart."""
    for target in targets:
        require_target(target)
    names = [i.name for i in s.islands]
    require(
        scale in ("all", "each", *names),
        f"--scale must be all, each or an island's name ({', '.join(names[:8])}), got {scale!r}",
    )
    require(window_rounds >= 1, f"--window-rounds must be >= 1, got {window_rounds}")
    scales = names if scale == "each" else [scale]
    signature = {name: _signature(s, name) for name in scales}
    answers: dict = {}
    for target in targets:
        per_scale, done = {}, {}
        for name in scales:
            key = signature[name]
            if key not in done:
                done[key] = {
                    mode: _gbps(
                        _bisect(
                            lambda bps, mode=mode, name=name: utilisation_at(
                                mode, s, bps, name, window_rounds
                            ),
                            target,
                            rel=1.05 if mode == "decoupled" else 1.001,
                        )
                    )
                    for mode in MODES
                }
            per_scale[name] = done[key]
        answers[str(target)] = per_scale
    ceilings = {
        name: {mode: utilisation_at(mode, s, 1e15, name, window_rounds) for mode in MODES}
        for name in scales
    }
    return {
        "targets": targets,
        "scale": scale,
        "window_s": window_rounds * s.longest_round_s(),
        "gbps": answers,
        "ceiling": ceilings,
        "startup_gbit": _startup_bits(s) / 1e9,
    }


def _signature(s: Scenario, name: str):
    """What makes scaling one island's link give the same answer as another's: everything but its
    name."""
    if name == "all":
        return "all"
    island = next(i for i in s.islands if i.name == name)
    return tuple(
        getattr(island, field.name) for field in dataclasses.fields(island) if field.name != "name"
    )


def _startup_s(s: Scenario) -> float:
    """The longest first download of the model over the islands' own links (none for one holding
    it)."""
    bits = _startup_bits(s)
    return max(
        (0.0 if i.holds_model or i.link.down_bps is None else bits / i.link.down_bps) + i.link.rtt_s
        for i in s.islands
    )


def _startup_bits(s: Scenario) -> float:
    """The first download of every fragment in full (the snapshot codec), framed: bits."""
    codec = Codec(s.snapshots.snapshot_codec, s.block)
    return 8.0 * sum(wire_bytes(n, codec) for n in fragment_sizes(s.params, s.fragments))


def require_target(target: float) -> None:
    require(0 < target < 1, f"--target-util must be in (0, 1), got {target}")


def _gbps(bps: float | None) -> float | None:
    return None if bps is None else bps / 1e9


def _bisect(
    util, target: float, lo: float = 1e5, hi: float = 1e15, rel: float = 1.05
) -> float | None:
    """The smallest link speed (bits/s, to `rel`) from which util(speed) >= target, for speeds on a
    grid of factors of 4 below `hi` (utilisation need not be monotone in link speed: the answer is
    where it last crosses the target, from above); None if even `hi` falls short."""
    if util(hi) < target:
        return None
    good = hi
    while good / 4 >= lo and util(good / 4) >= target:
        good /= 4
    if good / 4 < lo:
        return good
    bad = good / 4
    while good / bad > rel:
        mid = (good * bad) ** 0.5
        if util(mid) >= target:
            good = mid
        else:
            bad = mid
    return good


def markdown(p: dict, target: dict | None = None) -> str:
    sc, cl, mg, tk = p["scenario"], p["cluster"], p["merger"], p["cluster"]["tokens"]
    lines = [
        (
            f"# dloco plan: {sc['islands']} islands, {sc['params']:,} parameters, P ="
            f" {sc['fragments']}, H = {sc['interval']}, {sc['codec']},"
            f" {sc['duration_s'] / 3600:.2f} h simulated, {sc['failures']} failures"
        ),
        "",
        (
            "A folded token counts q(H) of the steps H its delta covered (q(1) = 1: sync-DP):"
            f" {_quality(sc['quality'])}."
        ),
        "",
        "## Islands",
        "",
        (
            "| island | step s | link up/down Gbit/s, RTT ms | utilisation (decoupled, steady) |"
            " whole run | start-up s | real H median / p95 (its H) | sync-DP | sync-DiLoCo | up"
            " B/token | down B/token | deltas sent (summed) | rejected | failures |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i in p["islands"]:
        h = i["real_interval"]
        lines.append(
            f"| {i['name']} | {i['step_s']:.3g} | {_g(i['up_gbps'])}/{_g(i['down_gbps'])},"
            f" {i['rtt_ms']:.0f} | {i['utilisation']:.3f} | {i['window_utilisation']:.3f} |"
            f" {i['startup_s']:.3g} | {_g(h['median'], '-')} / {_g(h['p95'], '-')}"
            f" ({i['interval']}) | {i['sync_dp_utilisation']:.3f} |"
            f" {i['sync_diloco_utilisation']:.3f} | {i['bytes_up_per_token']:.3g} |"
            f" {i['bytes_down_per_token']:.3g} | {i['deltas_sent']} ({i['deltas_summed']}) |"
            f" {', '.join(f'{k} {v}' for k, v in i['rejected'].items()) or '-'} | {i['failures']} |"
        )
    bpt, spm = cl["bytes_per_token"], cl["seconds_per_mtoken"]
    assumed = (
        " (assumed: `dloco bench merger` on 2 cores; set [sim] merger_gbps)"
        if sc["merger_gbps_assumed"]
        else ""
    )
    link = (
        ""
        if sc["merger_link_gbps"] is None
        else f" behind its own {sc['merger_link_gbps']:.3g} Gbit/s link"
    )
    lines += [
        "",
        "## Cluster",
        "",
        (
            f"Tokens: {tk['trained']:,} trained, {tk['folded']:,} folded, **{tk['useful']:,}"
            f" useful** ({tk['lost']:,} lost or rejected, {tk['queued_at_merger']:,} still queued"
            f" at the merger, {tk['undecided']:,} not yet sent at the end)."
        ),
        "",
        "| | decoupled | sync-DP | sync-DiLoCo |",
        "|---|---|---|---|",
        (
            f"| useful tokens/s (steady) | {cl['decoupled_tokens_s']:,.0f} |"
            f" {cl['sync_dp_tokens_s']:,.0f} | {cl['sync_diloco_tokens_s']:,.0f} |"
        ),
        (
            f"| seconds per million useful tokens | {_g(spm['decoupled'], 'never')} |"
            f" {spm['sync-dp']:.3g} | {spm['sync-diloco']:.3g} |"
        ),
        (
            "| goodput (useful tokens of the chips' peak, whole run, with failures) |"
            f" {cl['goodput']['decoupled']:.3f} | {cl['goodput']['sync-dp']:.3f} |"
            f" {cl['goodput']['sync-diloco']:.3f} |"
        ),
        (
            f"| bytes per token, up / down | {bpt['decoupled']['up']:.3g} /"
            f" {bpt['decoupled']['down']:.3g} | {bpt['sync-dp']['up']:.3g} /"
            f" {bpt['sync-dp']['down']:.3g} | {bpt['sync-diloco']['up']:.3g} /"
            f" {bpt['sync-diloco']['down']:.3g} |"
        ),
        "",
        (
            f"Decoupled is **{cl['speedup_vs_sync_dp']:.1f}x** sync-DP's useful tokens per second"
            f" and {cl['speedup_vs_sync_diloco']:.2f}x sync-DiLoCo's. sync-DP: {sc['sync_dp']} (a"
            f" {cl['sync_dp_round_s']:.3g} s step, {cl['sync_dp_exchange_s']:.3g} s of it exposed"
            f" exchange); sync-DiLoCo: {sc['sync_diloco']}."
        ),
        "",
        "## Merger",
        "",
        (
            f"- folds: {mg['folds']} ({', '.join(map(str, mg['folds_per_fragment']))} per"
            " fragment); staleness of folded deltas:"
            f" {', '.join(f'{k}: {v}' for k, v in mg['staleness'].items())}; real H of folded"
            f" deltas: median {_g(cl['real_interval']['median'], '-')}, p95"
            f" {_g(cl['real_interval']['p95'], '-')}"
        ),
        (
            f"- ingest: {mg['ingest_bytes_s'] * 8 / 1e9:.3g} Gbit/s of deltas;"
            f" {sc['merger_shards']} shard(s), each folding {sc['merger_gbps']:.3g}"
            f" Gbit/s{assumed}{link}; fold workers busy {mg['fold_worker_busy']:.1%}"
        ),
        (
            f"- memory: {mg['memory_bytes'] / 2**30:.3g} GiB (value, momentum and served value in"
            f" fp32, plus at most {mg['peak_pending_bytes'] / 2**30:.3g} GiB of deltas waiting for"
            " a fold)"
        ),
    ]
    if mg["overloaded"]:
        lines.append(
            f"- **overloaded**: the folding asked of it is {mg['fold_load']:.2f}x its capacity; at"
            f" the end {mg['backlog_s']:.3g} s of folding were ahead of it and"
            f" {mg['queued_bytes'] / 2**30:.3g} GiB of deltas ({mg['queued_tokens']:,} tokens)"
            " waited, not counted useful"
        )
    if target is not None:
        lines += ["", *target_markdown(target)]
    return "\n".join(lines) + "\n"


def target_markdown(t: dict) -> list[str]:
    scaled = {
        "all": "every island's link, together",
        "each": "each island's link in turn, the others as given",
    }.get(t["scale"], f"{t['scale']}'s link, the others as given")
    lines = [
        f"## Link speed for a steady utilisation ({scaled})",
        "",
        (
            "Gbit/s each way from which the utilisation that counts (useful share; for the"
            " synchronous modes the compute share of a round, weighted by the islands' tokens per"
            f" second) stays at least U over {t['window_s']:.0f} s after the start-up. Apart from"
            f" it, joining downloads the model once: {t['startup_gbit']:.3g} Gbit, that many"
            " seconds at 1 Gbit/s."
        ),
        "",
        "| U | scaled | decoupled | sync-DP | sync-DiLoCo |",
        "|---|---|---|---|---|",
    ]
    for target, per_scale in t["gbps"].items():
        for name, modes in per_scale.items():
            lines.append(
                f"| {target} | {name} | "
                + " | ".join(
                    _g(modes[mode], f"unreachable (at most {t['ceiling'][name][mode]:.3f})")
                    for mode in MODES
                )
                + " |"
            )
    return lines


def _speed(gbps: float | None, none: str) -> str:
    return none if gbps is None else f"{gbps:.3g} Gbit/s"


def _g(value: float | None, none: str = "unlimited") -> str:
    return none if value is None else f"{value:.3g}"


def _quality(q: dict) -> str:
    points = ", ".join(f"q({h}) = {f:.3f}" for h, f in q["points"])
    return f"{points}; past H = {q['points'][-1][0]} extrapolated, linear in ln H ({q['source']})"


def write_json(p: dict, path: Path | None = None) -> str:
    text = json.dumps(p, indent=2, sort_keys=True)
    if path is not None:
        Path(path).write_text(text + "\n")
    return text
