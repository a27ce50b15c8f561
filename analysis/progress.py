"""A running cluster's progress, read from its files as they grow (`dloco up` checks its bounds and
budgets on it): every island's steps and tokens and the merger's folds (`RunProgress`), and where
an island's current life is (`island_stage`: why one did not finish)."""

from __future__ import annotations

from pathlib import Path

from dloco.analysis.runinfo import JsonTail, merger_logs, read_events


class RunProgress:
    """A running cluster's progress, read from its files as they grow: every island's training steps
    (all its lives, from metrics/<island>.jsonl), the merger's folds (logs/merger.log) and, per
    island, the folds that took one of its deltas.  `update`
    reads only what was appended since the last call."""

    def __init__(self, run_dir: Path, islands: list[str]) -> None:
        self.run_dir = run_dir
        # steps made, every life
        self.steps = {name: 0 for name in islands}
        # the step number of the current life
        self.last_step = {name: 0 for name in islands}
        # the current life's tokens
        self._life_tokens = {name: 0 for name in islands}
        # every earlier life's
        self._past_tokens = {name: 0 for name in islands}
        self.folds = 0
        # folds with one of the island's deltas, every merger life
        self.folded = {name: 0 for name in islands}
        self._tails: dict[Path, JsonTail] = {}

    def update(self) -> None:
        for name in self.steps:
            for event in self._new_events(self.run_dir / "metrics" / f"{name}.jsonl"):
                if event.get("deferred") or "step" not in event:
                    continue
                self.last_step[name] = event["step"]
                self.steps[name] += event["step"] > 0
                # a new life: its counters start again
                if event["step"] == 0:
                    self._past_tokens[name] += self._life_tokens[name]
                    self._life_tokens[name] = 0
                else:
                    self._life_tokens[name] = event.get("tokens", self._life_tokens[name])
        for event in (
            e
            for name in merger_logs(self.run_dir)
            for e in self._new_events(self.run_dir / "logs" / name)
        ):
            if event.get("event") == "fold":
                self.folds += 1
                for island in set(event.get("contributors", ())) & self.folded.keys():
                    self.folded[island] += 1

    @property
    def tokens(self) -> int:
        """Tokens trained by the whole cluster: every island, every life."""
        return sum(self._past_tokens.values()) + sum(self._life_tokens.values())

    def _new_events(self, path: Path) -> list[dict]:
        """The complete JSON lines appended to `path` since the last call (a line being written
        waits)."""
        if path not in self._tails:
            self._tails[path] = JsonTail(path)
        return self._tails[path].new()


def island_stage(log_path: Path, life_step: int, made: int, max_steps: int) -> str:
    """Where an island's current life is, from its log: starting, joining, compiling or stepping.
    life_step: the step number of its current life; made: its steps in every life."""
    stage = "starting (importing JAX, reading the corpus, building the model)"
    for event in read_events(log_path):
        name = event.get("event")
        # the first line of every life
        if name == "corpus":
            stage = "starting (importing JAX, reading the corpus, building the model)"
        elif name == "model":
            stage = "joining (waiting for the merger's model)"
        elif name == "joined":
            stage = "compiling (its first step)"
    if stage.startswith("compiling") and life_step > 0:
        stage = f"stepping ({made} of {max_steps} steps made)"
    return stage
