"""The synchronous baselines, in closed form: every island waits for every other every round.

- sync-dp: data parallelism across regions, a ring all-reduce of bf16 gradients after every step
  (2 (n-1)/n of the gradient's bytes over each island's link, 2 (n-1) latencies; the slowest link
  paces the ring), no overlap of communication with compute.
- sync-diloco: DiLoCo as `dloco up --mode sync-diloco` runs it: every H steps each island sends its
  whole-model delta (the scenario's codec) to the merger and waits for the new model (its snapshot
  codec, or diff codec) before training on.

A round takes the slowest island's compute plus the exchange; an island's utilisation is its own
compute over that.  A failure anywhere stops every island for the failed one's downtime plus
`restart_s` (no quorum goes on without it).
"""

from __future__ import annotations

import dataclasses

from dloco.protocol import Codec
from dloco.sim.engine import wire_bytes
from dloco.sim.scenario import Scenario

BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class SyncResult:
    mode: str
    round_s: float  # one synchronous round: compute of the slowest island plus the exchange
    exchange_s: float
    steps_per_round: int
    utilisation: dict[str, float]  # island -> compute share of a round
    tokens_s: float  # cluster tokens per second without failures
    bytes_up_per_token: float
    bytes_down_per_token: float
    goodput: float  # with the scenario's failures: tokens_s x the share of time nobody is down, over the chips' peak


def _link_bps(value: float | None) -> float:
    return float("inf") if value is None else value


def _stalled_share(s: Scenario) -> float:
    stalled = sum(failure.down_s + s.restart_s for failure in s.failures)
    return min(1.0, stalled / s.duration_s)


def sync_dp(s: Scenario) -> SyncResult:
    n = len(s.islands)
    grad = BF16_BYTES * s.params
    ring_bps = min(min(_link_bps(i.link.up_bps), _link_bps(i.link.down_bps)) for i in s.islands)
    latency = max(i.link.rtt_s / 2 for i in s.islands)
    moved = 2 * (n - 1) / n * grad if n > 1 else 0.0
    exchange = moved * 8 / ring_bps + 2 * (n - 1) * latency
    return _result("sync-dp", s, 1, exchange, moved, moved)


def sync_diloco(s: Scenario) -> SyncResult:
    up = wire_bytes(s.params, Codec(s.codec, s.block))
    snapshots = s.snapshots
    down_codec = snapshots.snapshot_codec if snapshots.snapshot_diff_codec == "none" else snapshots.snapshot_diff_codec
    down = wire_bytes(s.params, Codec(down_codec, s.block))
    fold = s.fold_overhead_s + up * len(s.islands) / s.merger_bytes_s
    exchange = max(up * 8 / _link_bps(i.link.up_bps) + down * 8 / _link_bps(i.link.down_bps) + i.link.rtt_s for i in s.islands) + fold
    return _result("sync-diloco", s, s.interval, exchange, up, down)


def _result(mode: str, s: Scenario, steps: int, exchange: float, up: float, down: float) -> SyncResult:
    compute = steps * max(i.step_s for i in s.islands)
    round_s = compute + exchange
    tokens = steps * sum(i.tokens_per_step for i in s.islands)
    tokens_s = tokens / round_s
    per_island_tokens = tokens / len(s.islands)
    return SyncResult(mode, round_s, exchange, steps, {i.name: steps * i.step_s / round_s for i in s.islands}, tokens_s,
                      up / per_island_tokens, down / per_island_tokens, tokens_s * (1 - _stalled_share(s)) / s.peak_tokens_s)


def needed_bps(mode: str, s: Scenario, target: float) -> float | None:
    """The link speed (every island's, both ways) at which the slowest island, which paces every
    round, is busy `target` of the time (faster islands wait longer: no link speed helps them);
    None if latency alone keeps it below."""
    slowest = max(i.step_s for i in s.islands)
    probe = sync_dp if mode == "sync-dp" else sync_diloco
    unlimited = probe(s.with_links(1e30))
    round_needed = unlimited.steps_per_round * slowest / target  # round time at which the slowest island is `target` busy
    if round_needed <= unlimited.round_s:
        return None
    lo, hi = 1e3, 1e15
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        if probe(s.with_links(mid)).round_s <= round_needed:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1.001:
            break
    return hi
