"""An island in the simulator's virtual time: its lives, its steps, its unsent work per fragment,
its `Outbox` and its uplink (`LinkShaper`), and what of its work is still undecided at the end.
The events that drive it are the engine's (sim/engine.py).
"""

from __future__ import annotations

import math
import random

from dloco.island.exchange import due_offset
from dloco.island.outbox import Outbox, PendingDelta
from dloco.island.shaper import LinkShaper
from dloco.sim.results import IslandRun
from dloco.sim.scenario import Island, Scenario


class SimIsland:
    def __init__(self, index: int, spec: Island, scenario: Scenario) -> None:
        self.index, self.spec, self.run = index, spec, IslandRun(spec.name)
        self.alive, self.epoch, self.delta_id = False, 0, 0
        # epoch -> when that life ended
        self.died_at: dict[int, float] = {}
        # deltas taken from its outbox and not yet at the merger (any life's): tokens, x q
        self.in_flight = self.in_flight_useful = 0.0
        # its step times' noise (spec.step_cv)
        self.rng = random.Random(scenario.seed * 1_000_003 + index)
        self.fragments = scenario.fragments
        self.new_life(scenario)

    def new_life(self, scenario: Scenario) -> None:
        self.epoch += 1
        # steps of this life, and when the last of them ended (set when it joins)
        self.step, self.clock = 0, math.inf
        # per fragment, since its last send
        self.unsent_steps = [0] * self.fragments
        self.outbox = Outbox()
        link = self.spec.link
        self.uplink = LinkShaper(None if link.up_bps is None else link.up_bps / 8, link.rtt_s / 2)
        # the delta being sent, and when its last byte leaves
        self.wire: tuple[PendingDelta, float] | None = None

    def steps_by(self, when: float) -> int:
        """Steps of this life done by `when` (before its next due step, which has its own event)."""
        return min(
            self.next_due - 1,
            self.step + max(0, int((when - self.clock) / self.spec.step_s + 1e-9)),
        )

    def train_until(self, step: int, now: float) -> None:
        """Trained from its clock until `now` (busy all along), completing steps up to `step`."""
        self.run.compute_s += max(0.0, now - self.clock)
        self.clock = max(self.clock, now)
        done = step - self.step
        if done <= 0:
            return
        self.step = step
        self.run.trained_tokens += done * self.spec.tokens_per_step
        self.unsent_steps = [n + done for n in self.unsent_steps]

    def set_next_due(self, h: int, p: int) -> tuple[int, float]:
        """Its next step after which one of P fragments is due every `h` steps
        (exchange.due_offset), kept as `next_due`, and the seconds until that step ends (noisy with
        `step_cv`)."""
        step = self.step + 1
        nxt = min(step + (due_offset(f, p, h) - step) % h for f in range(p))
        self.next_due = nxt
        steps, spec = nxt - self.step, self.spec
        seconds = steps * spec.step_s
        if spec.step_cv > 0:
            seconds = max(
                0.1 * seconds,
                self.rng.gauss(seconds, math.sqrt(steps) * spec.step_cv * spec.step_s),
            )
        return nxt, seconds

    def undecided(self, s: Scenario, delta_bytes: list[int]) -> tuple[float, float]:
        """At the end: the tokens in the outbox and not yet due, and what they will be worth at
        best. A queued delta leaves once the uplink has sent what is ahead of it, and the outbox
        sums its fragment's next deltas into it meanwhile: it will cover its steps plus that
        wait."""
        end, spec = s.duration_s, self.spec
        rate = None if spec.link.up_bps is None else spec.link.up_bps / 8
        leaves, covers = max(end, self.uplink.free_at), {}
        tokens = useful = 0.0
        while (delta := self.outbox.take()) is not None:
            covers[delta.fragment] = delta.steps + (leaves - end) / spec.step_s
            tokens, useful = (
                tokens + delta.tokens,
                useful + delta.tokens * s.quality(covers[delta.fragment]),
            )
            leaves += delta_bytes[delta.fragment] / rate if rate else 0.0
        h = spec.interval or s.interval
        # on time, or summed
        due = [
            (steps * spec.tokens_per_step, covers.get(f, h))
            for f, steps in enumerate(self.unsent_steps)
        ]
        return tokens + sum(t for t, _ in due), useful + sum(
            t * s.quality(steps) for t, steps in due
        )
