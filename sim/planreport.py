"""`dloco plan`'s report (sim/plan.py) as Markdown, with the link speeds of `--target-util`
(sim/targetutil.py) when asked, or as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from dloco.sim.targetutil import MODES


def markdown(p: dict, target: dict | None = None) -> str:
    """The plan as Markdown: the scenario, its islands, the cluster against the synchronous
    baselines, the merger, and the link speeds for `--target-util` when given."""
    sc = p["scenario"]
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
        *_islands_markdown(p["islands"]),
        "",
        *_cluster_markdown(sc, p["cluster"]),
        "",
        *_merger_markdown(sc, p["cluster"], p["merger"]),
    ]
    if target is not None:
        lines += ["", *target_markdown(target)]
    return "\n".join(lines) + "\n"


def _islands_markdown(islands: list[dict]) -> list[str]:
    """The islands' table, a row each."""
    lines = [
        "## Islands",
        "",
        (
            "| island | step s | link up/down Gbit/s, RTT ms | utilisation (decoupled, steady) |"
            " whole run | start-up s | real H median / p95 (its H) | sync-DP | sync-DiLoCo | up"
            " B/token | down B/token | deltas sent (summed) | rejected | failures |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i in islands:
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
    return lines


def _cluster_markdown(sc: dict, cl: dict) -> list[str]:
    """Where the cluster's tokens went, and decoupled against the synchronous baselines."""
    bpt, spm, tk = cl["bytes_per_token"], cl["seconds_per_mtoken"], cl["tokens"]
    return [
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
    ]


def _merger_markdown(sc: dict, cl: dict, mg: dict) -> list[str]:
    """The merger's folds, ingest, memory, and its backlog when overloaded."""
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
    lines = [
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
            f"- memory: {mg['memory_bytes'] / 2**30:.3g} GiB (value, outer optimizer state and"
            f" served value, {mg['state_bytes_per_param']} B per parameter, plus at most"
            f" {mg['peak_pending_bytes'] / 2**30:.3g} GiB of deltas waiting for a fold)"
        ),
    ]
    if mg["overloaded"]:
        lines.append(
            f"- **overloaded**: the folding asked of it is {mg['fold_load']:.2f}x its capacity; at"
            f" the end {mg['backlog_s']:.3g} s of folding were ahead of it and"
            f" {mg['queued_bytes'] / 2**30:.3g} GiB of deltas ({mg['queued_tokens']:,} tokens)"
            " waited, not counted useful"
        )
    return lines


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
