"""`dloco plan --target-util`: utilisation inverted to link speed.  For each target U and each mode
(decoupled, sync-DP, sync-DiLoCo), the link speed from which the steady utilisation that counts
stays at least U: probes of the scenario at link speeds (sim/engine.py, sim/baselines.py), each
the start-up download and then a window of rounds, bisected on a grid.
"""

from __future__ import annotations

import dataclasses

from dloco.protocol import Codec
from dloco.protocol.errors import require
from dloco.sim.baselines import sync_diloco, sync_dp
from dloco.sim.engine import simulate
from dloco.sim.scenario import Scenario
from dloco.sim.wire import fragment_sizes, wire_bytes

# --target-util's default window: rounds of the slowest island per probe (or the scenario's length
# if shorter)
TARGET_ROUNDS = 20
# the modes compared, in the order of their columns
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
