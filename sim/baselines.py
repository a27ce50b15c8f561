"""The synchronous baselines at their best practice, in closed form: every island waits for every
other every round.

- sync-dp: data parallelism across regions, a ring all-reduce of bf16 gradients after every step
  (2 (n-1)/n of the gradient's bytes over each island's link, 2 (n-1) latencies; the slowest link
  paces the ring), `dp_overlap` of it hidden behind the backward pass (2/3 of a step), as gradient
  buckets are reduced while the rest of the backward runs.
- sync-diloco: every H steps a ring all-reduce of each island's whole-model delta among the islands
  (the scenario's codec, or `diloco_codec`), no merger in the path; with an overlap depth tau
  (`overlap_steps`) the exchange may hide behind tau inner steps of the next round.  Its tokens
  count q(H) each (sim/quality.py), sync-dp's 1.

A round takes the slowest island's compute plus the exchange that does not hide; an island's
utilisation is its own compute over that.  A failure anywhere stops every island for the failed
one's downtime plus `restart_s` (no quorum goes on without it).
"""

from __future__ import annotations

import dataclasses

from dloco.protocol import Codec
from dloco.sim.scenario import Scenario
from dloco.sim.wire import wire_bytes

BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class SyncResult:
    mode: str
    # one synchronous round: compute of the slowest island plus the exchange
    round_s: float
    exchange_s: float
    steps_per_round: int
    # island -> compute share of a round
    utilisation: dict[str, float]
    # cluster tokens per second without failures
    tokens_s: float
    # times q of its interval: sync-DP-equivalent tokens
    useful_tokens_s: float
    bytes_up_per_token: float
    bytes_down_per_token: float
    # with the scenario's failures: useful_tokens_s x the share of time nobody is down, over the
    # chips' peak
    goodput: float
    # what was assumed, in words
    practice: str


def _link_bps(value: float | None) -> float:
    return float("inf") if value is None else value


def _stalled_share(s: Scenario) -> float:
    stalled = sum(failure.down_s + s.restart_s for failure in s.failures)
    return min(1.0, stalled / s.duration_s)


def _ring(s: Scenario, nbytes: float) -> tuple[float, float]:
    """(bytes each island moves each way, seconds) of a ring all-reduce of `nbytes` among the
    islands."""
    n = len(s.islands)
    if n == 1:
        return 0.0, 0.0
    ring_bps = min(min(_link_bps(i.link.up_bps), _link_bps(i.link.down_bps)) for i in s.islands)
    latency = max(i.link.rtt_s / 2 for i in s.islands)
    moved = 2 * (n - 1) / n * nbytes
    return moved, moved * 8 / ring_bps + 2 * (n - 1) * latency


def sync_dp(s: Scenario) -> SyncResult:
    moved, exchange = _ring(s, BF16_BYTES * s.params)
    backward = 2 / 3 * max(i.step_s for i in s.islands)
    exposed = exchange - min(s.dp_overlap * exchange, backward)
    practice = (
        f"ring all-reduce of bf16 gradients every step, {s.dp_overlap:.0%} of it may hide behind"
        " the backward pass"
    )
    return _result("sync-dp", s, 1, exposed, moved, moved, 1.0, practice)


def sync_diloco(s: Scenario) -> SyncResult:
    codec = s.diloco_codec or s.codec
    moved, exchange = _ring(s, wire_bytes(s.params, Codec(codec, s.block)))
    exposed = max(0.0, exchange - s.overlap_steps * max(i.step_s for i in s.islands))
    practice = (
        f"ring all-reduce of {codec} deltas every {s.interval} steps, overlap depth"
        f" {s.overlap_steps} steps"
    )
    return _result(
        "sync-diloco", s, s.interval, exposed, moved, moved, s.quality(s.interval), practice
    )


def _result(
    mode: str,
    s: Scenario,
    steps: int,
    exchange: float,
    up: float,
    down: float,
    quality: float,
    practice: str,
) -> SyncResult:
    compute = steps * max(i.step_s for i in s.islands)
    round_s = compute + exchange
    tokens = steps * sum(i.tokens_per_step for i in s.islands)
    tokens_s = tokens / round_s
    per_island_tokens = tokens / len(s.islands)
    return SyncResult(
        mode,
        round_s,
        exchange,
        steps,
        {i.name: steps * i.step_s / round_s for i in s.islands},
        tokens_s,
        tokens_s * quality,
        up / per_island_tokens,
        down / per_island_tokens,
        tokens_s * quality * (1 - _stalled_share(s)) / s.peak_tokens_s,
        practice,
    )
