"""The `bytes` suite's comparison: bytes per token up and down against `sync-avg` (an fp32
all-reduce's bytes), the merger's model at equal cluster tokens and at equal time against the
former default, the islands' utilisation, and the suite's goals — each met, or how far off.  Pure
functions of the runs' results (suites/suiteresults.RunResult: each island's last step event, the
merger's model over the run)."""

from __future__ import annotations

import numpy as np

# the suite's labels of the baseline and of the former default
SYNC_AVG, REFERENCE = "sync-avg", "every-fold-int4"
# fewer bytes than sync-avg; within 1.5 % at equal tokens; busy
GOAL_RATIO, GOAL_QUALITY, GOAL_BUSY = 800.0, 0.015, 0.97


def _per_token(result, key: str) -> float:
    tokens = sum(e.get("tokens", 0) for e in result.last.values())
    return sum(e.get(key, 0) for e in result.last.values()) / tokens if tokens else float("nan")


def per_token(result) -> tuple[float, float]:
    """(bytes up, bytes down) per token the cluster trained."""
    return _per_token(result, "bytes_sent"), _per_token(result, "bytes_received")


def values_per_token(result) -> float:
    """Bytes per token of the full values the islands received (the model at the start,
    catch-ups)."""
    return _per_token(result, "bytes_received_values")


def down_over_up(result) -> dict[str, tuple[float, float]]:
    """Each island's bytes received over bytes sent: in all, and past the full values it received
    (the model at the start, a catch-up): what the downlink costs for as long as the run goes on."""
    return {
        name: (
            e["bytes_received"] / e["bytes_sent"],
            (e["bytes_received"] - e.get("bytes_received_values", 0)) / e["bytes_sent"],
        )
        for name, e in result.last.items()
        if e.get("bytes_sent")
    }


def _global_at(result, key: str, x: float) -> float | None:
    """The merger's model's loss at `x` of `key` (since_start or cluster_tokens), linear between the
    measured moments and from the initial model at 0; None past the last moment."""
    curve = result.global_curve
    if not curve or x > curve[-1][key] + 1e-9:
        return None
    return float(
        np.interp(
            x,
            [0.0] + [p[key] for p in curve],
            [result.global_before] + [p["eval_loss"] for p in curve],
        )
    )


def global_at_time(result, seconds: float) -> float | None:
    """The merger's model's loss `seconds` after the cluster's first step."""
    return _global_at(result, "since_start", seconds)


def global_at_tokens(result, tokens: float) -> float | None:
    """The merger's model's loss when the cluster had trained `tokens`."""
    return _global_at(result, "cluster_tokens", tokens)


def equal_tokens(results: list) -> int | None:
    """The fewest cluster tokens any decoupled run trained (sync-avg, far behind, is left out: the
    suite's own equal-tokens column is at its few tokens)."""
    return min(
        (
            r.global_curve[-1]["cluster_tokens"]
            for r in results
            if r.global_curve and _base(r.label)[0] != SYNC_AVG
        ),
        default=None,
    )


def _gap(value: float | None, reference: float | None) -> float | None:
    return None if value is None or reference is None else value / reference - 1


def _base(label: str) -> tuple[str, str]:
    """A label and its repeat suffix (`--from` several folders labels runs "name #k")."""
    name, _, k = label.partition(" #")
    return name, f" #{k}" if k else ""


def _peer(results: list, run, name: str):
    """The run called `name` of the same repeat as `run` (else of any repeat), or None."""
    same = [r for r in results if r.label == name + _base(run.label)[1]]
    return (same or [r for r in results if _base(r.label)[0] == name] or [None])[0]


def _dp_total(results: list, run) -> float | None:
    dp = _peer(results, run, SYNC_AVG)
    return sum(per_token(dp)) if dp else None


def lines(results: list) -> list[str]:
    """The suite's table of bytes and quality and its goals, as Markdown lines; each run against
    the references of its own repeat."""
    common = min(
        (r.global_curve[-1]["since_start"] for r in results if r.global_curve), default=None
    )
    tokens = equal_tokens(results)
    out = [
        "",
        (
            "| run | bytes up / token | bytes down / token (full values) |"
            f" vs {SYNC_AVG} (past full values) | down / up per island (past full values) |"
            f" merger's model at {tokens or 0:,} cluster tokens | at {common or 0:.0f} s |"
            f" vs {REFERENCE} (tokens, time) | least busy island |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        up, down = per_token(r)
        values, dp_total, ref = (
            values_per_token(r),
            _dp_total(results, r),
            _peer(results, r, REFERENCE),
        )
        ratio = (
            f"{_x(_over(dp_total, up + down))} ({_x(_over(dp_total, up + down - values))})"
            if _base(r.label)[0] != SYNC_AVG
            else "1x"
        )
        at_time = None if common is None else global_at_time(r, common)
        at_tokens = None if tokens is None else global_at_tokens(r, tokens)
        gaps = [
            _gap(
                at_tokens, None if ref is None or tokens is None else global_at_tokens(ref, tokens)
            ),
            _gap(at_time, None if ref is None or common is None else global_at_time(ref, common)),
        ]
        busy = min(
            (e.get("compute_util", float("nan")) for e in r.last.values()), default=float("nan")
        )
        out.append(
            f"| {r.label} | {up:.2f} | {down:.2f} ({values:.2f}) | {ratio} |"
            f" {', '.join(f'{a:.2f} ({b:.2f})' for a, b in down_over_up(r).values())} |"
            f" {_num(at_tokens)} | {_num(at_time)} | {', '.join(_pct(g) for g in gaps)} |"
            f" {busy:.2f} |"
        )
    return out + [""] + goals(results)


def goals(results: list) -> list[str]:
    """For each run other than the two references: the three goals, met or by how much not."""
    out, tokens = [], equal_tokens(results)
    for r in results:
        if _base(r.label)[0] in (SYNC_AVG, REFERENCE) or tokens is None:
            continue
        dp_total, ref = _dp_total(results, r), _peer(results, r, REFERENCE)
        ratio, lasting = (
            _over(dp_total, sum(per_token(r))),
            _over(dp_total, sum(per_token(r)) - values_per_token(r)),
        )
        gap = _gap(global_at_tokens(r, tokens), ref and global_at_tokens(ref, tokens))
        busy = min((e.get("compute_util", 0.0) for e in r.last.values()), default=0.0)
        checks = [
            (
                "bytes",
                ratio is not None and ratio >= GOAL_RATIO,
                (
                    f"{_x(ratio)} fewer bytes than {SYNC_AVG} (goal {GOAL_RATIO:.0f}x;"
                    f" {_x(lasting)} past the full values, which a longer run spreads over more"
                    " tokens)"
                ),
            ),
            (
                "quality",
                gap is not None and gap <= GOAL_QUALITY,
                (
                    f"merger's model {_pct(gap)} against {REFERENCE} at equal tokens (goal ≤"
                    f" +{100 * GOAL_QUALITY:.1f} %)"
                ),
            ),
            ("busy", busy >= GOAL_BUSY, f"least busy island {busy:.2f} (goal ≥ {GOAL_BUSY})"),
        ]
        out.append(
            f"- {r.label}: "
            + "; ".join(f"{'met' if ok else 'NOT met'}: {what}" for _, ok, what in checks)
            + "."
        )
    return out


def _over(a: float | None, b: float) -> float | None:
    return a / b if a and b > 0 else None


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f} %"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}x"
