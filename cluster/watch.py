"""`dloco up`'s watch over a running cluster: the live view refreshed, the chaos schedule fired as
the run reaches each event's point (logged to chaos.jsonl), a process that crashed noticed, and the
run ended at its bound (steps, tokens) or its limit (duration_s), with what it had left undone
(analysis.verdict).
"""

from __future__ import annotations

import json
import time
from typing import TextIO

from dloco.analysis import verdict
from dloco.analysis.progress import RunProgress, island_stage
from dloco.cluster import chaos
from dloco.cluster.liveview import LiveView
from dloco.cluster.processes import Cluster


class Watch:
    """The run as the launcher watches it; `problems` are what made it fail, `dead` the processes
    that ended by themselves, `warned` the auxiliary ones already reported."""

    def __init__(self, cluster: Cluster, out: TextIO) -> None:
        self.cluster, self.config, self.run_dir, self.out = (
            cluster,
            cluster.config,
            cluster.run_dir,
            out,
        )
        self.islands = [r.name for r in self.config.regions]
        self.interval = {
            region.name: self.config.interval_of(region) for region in self.config.regions
        }
        self.progress = RunProgress(self.run_dir, self.islands)
        self.pending = list(self.config.chaos)
        self.interrupted = False
        self.problems: list[str] = []
        self.dead: list[str] = []
        self.warned: set[str] = set()

    def interrupt(self, *_) -> None:
        """The signal handler of Ctrl-C and SIGTERM: the watch ends at its next turn."""
        self.interrupted = True

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def run(self) -> None:
        """Until the run ends: its bound, its limit, a crash or an interrupt."""
        progress = self.progress
        # the run's clock (duration, chaos times) starts with the processes
        started = time.monotonic()
        view = LiveView(self.config, self.run_dir, self.out)
        with open(self.run_dir / "chaos.jsonl", "a") as chaos_log:
            # where the run was when the last event fired
            armed = chaos.Progress(0.0, dict(progress.steps), 0, dict(progress.folded))
            while not self.interrupted:
                progress.update()
                now = chaos.Progress(
                    time.monotonic() - started,
                    dict(progress.steps),
                    progress.folds,
                    dict(progress.folded),
                )
                # before any kill: a crash must not pass for a chaos kill
                self.dead = self.crashed()
                self.warn_auxiliary()
                armed = self.fire(now, armed, chaos_log)
                if self.dead:
                    dead = ", ".join(self.dead)
                    self.say(f"dloco up: {dead} exited early; see {self.run_dir / 'logs'}")
                    codes = (f"{n} {self.cluster.processes[n].returncode}" for n in self.dead)
                    self.problems.append(f"{dead} exited early ({', '.join(codes)})")
                    break
                if self.ended(now, armed):
                    break
                view.refresh(now.elapsed_s)
                busy = self.pending or self.config.max_steps or self.config.tokens
                time.sleep(0.25 if busy else 1.0)

    def crashed(self) -> list[str]:
        """The processes the run needs that ended by themselves; with a budget, not an island that
        stopped cleanly (it stops by itself once it hears the budget is spent)."""
        dead = self.cluster.unexpectedly_dead()
        if self.config.tokens:
            dead = [
                name
                for name in dead
                if not (
                    name.partition(".")[0] in self.islands
                    and self.cluster.processes[name].returncode == 0
                )
            ]
        return dead

    def warn_auxiliary(self) -> None:
        """Once per auxiliary process that ended: the run goes on without it."""
        for name, code in self.cluster.auxiliary_ended().items():
            if name not in self.warned:
                self.warned.add(name)
                self.say(
                    f"dloco up: WARNING: {name} exited with {code} (see"
                    f" {self.run_dir / 'logs' / name}.log); the run goes on without it"
                )

    def fire(self, now: chaos.Progress, armed: chaos.Progress, chaos_log: TextIO) -> chaos.Progress:
        """The chaos events due now, in order, each logged; returns where the run was when the last
        one fired.  An event whose process had ended by itself makes it dead instead."""
        while not self.dead and self.pending and chaos.due(self.pending[0], now, armed):
            event = self.pending.pop(0)
            # it had ended by itself
            if self.cluster.act(event.action, event.target) is not None:
                self.dead = [event.target]
                break
            chaos_log.write(
                json.dumps(
                    {
                        "at_s": round(now.elapsed_s, 3),
                        "wall": time.time(),
                        "action": event.action,
                        "target": event.target,
                        "process": self.cluster.killed_as.get(event.target, event.target),
                        "when": str(event),
                        **self.cluster.effect(event.target),
                    }
                )
                + "\n"
            )
            chaos_log.flush()
            self.say(f"dloco up: chaos {event} done")
            armed = now
        return armed

    def ended(self, now: chaos.Progress, armed: chaos.Progress) -> bool:
        """Whether the run is over: its steps trained, its budget spent, or its duration up (then
        what a run bounded by work had not done is a problem)."""
        config, progress = self.config, self.progress
        wanted = verdict.targets(
            self.islands,
            self.cluster.down,
            config.max_steps,
            self.interval,
            armed.steps if config.chaos and not self.pending else None,
        )
        left = verdict.short(progress.steps, wanted)
        if config.max_steps and not left and not self.pending:
            return True
        spent = progress.tokens >= config.tokens or all(
            self.cluster.processes[name].poll() is not None
            for name in self.cluster.processes
            if name.partition(".")[0] in self.islands
        )
        if config.tokens and spent and not self.pending:
            return True
        if now.elapsed_s >= config.duration_s:
            self.problems += self.unfinished(left)
            return True
        return False

    def unfinished(self, left: dict[str, int]) -> list[str]:
        """At the duration limit: the budget not spent, the islands short of their steps (and where
        each was), the chaos events never reached."""
        config, progress = self.config, self.progress
        problems = []
        if config.tokens:
            problems += verdict.budget_unspent(progress.tokens, config.tokens, config.duration_s)
            problems += verdict.unreached(
                [str(e) for e in self.pending], progress.steps, progress.folds, progress.folded
            )
        if config.max_steps:
            stages = {
                name: island_stage(
                    self.run_dir / "logs" / f"{name}.log",
                    progress.last_step[name],
                    progress.steps[name],
                    target,
                )
                for name, target in left.items()
            }
            problems += verdict.unfinished(stages, config.duration_s)
            problems += verdict.unreached(
                [str(e) for e in self.pending], progress.steps, progress.folds, progress.folded
            )
        return problems
