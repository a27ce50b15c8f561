"""The island's training loop.  It never blocks on the network: a `link` (optional) takes deltas
into a bounded background outbox and hands back snapshots that already arrived, both without
waiting.  Without a link (standalone) it is the single-island baseline, same code path."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dloco.island import exchange, schedule
from dloco.island.config import SyncConfig, TrainConfig
from dloco.island.joining import wait_for_model
from dloco.island.link import Link
from dloco.island.metrics import MetricsWriter
from dloco.island.task import examples_in
from dloco.island.train import Trainer


@dataclasses.dataclass
class FragmentProgress:
    anchor: exchange.Anchor
    version: int = 0
    steps: int = 0
    tokens: int = 0


class IslandLoop:
    def __init__(
        self,
        trainer: Trainer,
        batches: Iterator[Any],
        eval_batches: Sequence[Any],
        train: TrainConfig,
        sync: SyncConfig,
        metrics: MetricsWriter,
        link: Link | None = None,
        slowdown: float = 1.0,
        log=None,
        on_compiled: Callable[[], None] | None = None,
        count: Callable[[Any], int] | None = None,
        group=None,
    ) -> None:
        if slowdown < 1:
            raise ValueError(f"slowdown must be >= 1, got {slowdown}")
        self.trainer, self.batches, self.eval_batches = trainer, batches, eval_batches
        # what a batch adds to "tokens" (the task's Task.tokens_in)
        self.count = count if count is not None else examples_in
        self.train, self.sync, self.metrics = train, sync, metrics
        self.link, self.slowdown, self.log = link, slowdown, log
        # called once after step 1 (mostly compiling): a CPU quota starts there (island/cpugroup.py)
        self.on_compiled = on_compiled
        params = trainer.params()
        self.parts = exchange.partition({p: v.shape for p, v in params.items()}, sync.fragments)
        self.progress = [
            FragmentProgress(exchange.Anchor({p: params[p] for p in paths})) for paths in self.parts
        ]
        # tokens trained, seconds of the island's own work (training, evaluating), and when the
        # first step began
        self.tokens = 0
        self.compute_s = 0.0
        self.started = None
        # time spent blocked on the merger (synchronous modes only)
        self.wait_s = 0.0
        # set from a signal handler: finish the current step, then stop
        self.stop_requested = False
        # A multi-process island (island/group.py): the leader's parameter changes are staged and
        # reach every process once per step, with the stop requests, which all processes then agree
        # on.
        self.group = group
        self.staged: dict[str, np.ndarray] = {}
        self.group_stop = False
        # (step event, parameters after it): train.eval_trace
        self.trace: list[tuple[dict, dict[str, np.ndarray]]] = []
        # With a token budget: the cluster's progress in millionths, the leader's as agreed by
        # every process of a multi-process island (island/schedule.py)
        self.progress_ppm = 0

    def join(self, timeout_s: float) -> None:
        """Start from the merger's model: wait (once, before training) for a snapshot of every
        fragment and adopt it.  Raises JoinTimeout if the merger does not answer in time, and
        ModelMismatch (naming the first differing parameter) if its model is not this task's;
        returns early when a stop is requested (run() then stops before its first step)."""
        # on an error the others of a multi-process island learn it from the broken group
        if self.link is not None:
            self._join(timeout_s)
        # every process takes the leader's values (and a stop asked meanwhile)
        if self.group is not None:
            self._agree()

    def _join(self, timeout_s: float) -> None:
        theta = self.trainer.params()
        arrived = wait_for_model(
            self.link,
            {p: v.shape for p, v in theta.items()},
            len(self.progress),
            timeout_s,
            lambda: self.stop_requested,
            lambda endpoints: self.log and self.log.warning("hub_unreachable", endpoints=endpoints),
        )
        for fragment, version, tensors in arrived:
            self._set(exchange.adopt(theta, tensors, 0.0))
            self.progress[fragment] = FragmentProgress(exchange.Anchor.adopted(tensors), version)

    def run(self, max_steps: int | None = None) -> dict:
        max_steps = max_steps or self.train.max_steps
        self.started = time.perf_counter()
        held_out = self._evaluate()
        eval_loss = held_out["eval_loss"]
        self.metrics.write({"step": 0, "tokens": 0, **held_out, "time": 0.0, "wall": time.time()})
        loss, step = float("nan"), 0
        for step in range(1, max_steps + 1):
            if self._stopping():
                step -= 1
                break
            loss, grad_norm = self._step(step)
            if self.link is not None or self.group is not None:
                self._exchange(step)
            event = self._event(step, loss, grad_norm)
            # a power of two
            early = (
                self.train.eval_early and step < self.train.eval_every and step & (step - 1) == 0
            )
            if step % self.train.eval_every == 0 or early or step == max_steps or self._stopping():
                event.update(self._evaluate())
                eval_loss = event["eval_loss"]
                if self.log is not None:
                    self.log.info(
                        "eval",
                        step=step,
                        loss=round(loss, 4),
                        eval_loss=round(eval_loss, 4),
                        tokens=self.tokens,
                    )
            elif step <= self.train.eval_trace:
                self.trace.append(
                    (
                        {k: event[k] for k in ("step", "tokens", "time", "wall")},
                        {p: v.copy() for p, v in self.trainer.params().items()},
                    )
                )
            self.metrics.write(event)
        wall = time.perf_counter() - self.started
        return {
            "steps": step,
            "tokens": self.tokens,
            "loss": loss,
            "eval_loss": eval_loss,
            "seconds": wall,
            "steps_per_s": step / wall,
            "compute_util": self.compute_s / wall,
            **({"budget_progress": self.progress_ppm / 1e6} if self.train.budget_tokens else {}),
        }

    def _stopping(self) -> bool:
        """A stop asked (of any process of the island, as agreed) or the token budget spent."""
        return (
            self.group_stop if self.group is not None else self.stop_requested
        ) or self.budget_spent

    def _step(self, step: int) -> tuple[float, float]:
        """One inner step on the next batch, slowed down as an older chip would be; the tokens it
        trained counted.  Returns (loss, gradient norm)."""
        batch = next(self.batches)
        if self.train.budget_tokens:
            self.trainer.set_rate_scale(schedule.decay(self.progress_ppm / 1e6))
        began = time.perf_counter()
        loss, grad_norm = self.trainer.step(batch)
        compute = time.perf_counter() - began
        # an older chip: the same work takes `slowdown` times as long (step 1 is mostly
        # compiling)
        if self.slowdown > 1 and step > 1:
            time.sleep(compute * (self.slowdown - 1))
        # step 1: compiling, not slowed down
        self.compute_s += compute * self.slowdown if step > 1 else compute
        if step == 1 and self.on_compiled is not None:
            self.on_compiled()
        step_tokens = self.count(batch)
        self.tokens += step_tokens
        for progress in self.progress:
            progress.steps += 1
            progress.tokens += step_tokens
        self._follow_budget()
        return loss, grad_norm

    def _event(self, step: int, loss: float, grad_norm: float) -> dict:
        """The step's line of metrics (evaluations are added by `run`)."""
        event = {
            "step": step,
            "tokens": self.tokens,
            "loss": loss,
            "grad_norm": grad_norm,
            "time": time.perf_counter() - self.started,
            "wall": time.time(),
            "compute_util": self.compute_s / (time.perf_counter() - self.started),
            "bytes_sent": getattr(self.link, "bytes_sent", 0),
            # the highest delta id sent so far (ids count up from 1 per epoch)
            "deltas_sent": getattr(self.link, "deltas_sent", 0),
            "bytes_received": getattr(self.link, "bytes_received", 0),
            "bytes_received_values": getattr(self.link, "bytes_received_values", 0),
            "snapshot_version": [p.version for p in self.progress],
            "wait_s": self.wait_s,
        }
        if self.train.budget_tokens:
            event["budget_progress"] = self.progress_ppm / 1e6
        return event

    @property
    def budget_spent(self) -> bool:
        """The cluster has trained the run's token budget, as far as this island has heard: it stops
        (every process of a multi-process island at the same step: the progress is agreed)."""
        return bool(self.train.budget_tokens) and self.progress_ppm >= 1_000_000

    def _exchange(self, step: int) -> None:
        """Adopt snapshots that arrived; hand due fragments' deltas to the link.  Never waits
        (unless sync.blocking: the synchronous baselines).  In a multi-process island only the
        leader has a link; every process then agrees on what it changed (`_agree`).

        A delta is the change since the fragment was last adopted *or sent*: anchor - theta, after
        which the anchor moves to theta (as held: exchange.advance).  So two sends between
        adoptions carry disjoint work and the merger never counts a step twice.  Adoption resets
        the anchor to the global value."""
        if self.link is not None:
            self._adopt(self.link.snapshots())
            due = [
                p
                for p in exchange.due_fragments(step, self.sync.fragments, self.sync.interval)
                if self.progress[p].steps > 0
            ]
            if due:
                # before sending: a quick rejection counts
                unfolded = dict(self.link.unfolded) if self.sync.blocking else {}
                self._send(due)
                if self.sync.blocking:
                    self._wait_for_fold(
                        {fragment: self.progress[fragment].version for fragment in due}, unfolded
                    )
        if self.group is not None:
            self._agree()

    def _follow_budget(self) -> None:
        """Tell the link this life's tokens (its heartbeats carry them) and, with a budget, take the
        cluster's progress from what the merger said; in a multi-process island the leader's
        value reaches the others at `_agree`."""
        if self.link is not None and hasattr(self.link, "report_trained"):
            self.link.report_trained(self.tokens)
        if self.train.budget_tokens and (self.group is None or self.group.leader):
            view = schedule.cluster_view(getattr(self.link, "cluster_tokens", 0), self.tokens)
            self.progress_ppm = round(1e6 * schedule.progress(view, self.train.budget_tokens))

    def _set(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite parameters; in a multi-process island (the leader: only it adopts) also
        staged for the others, who take them at the next `_agree`."""
        self.trainer.set_params(values)
        if self.group is not None:
            self.staged.update(values)

    def _agree(self) -> None:
        """Every process of a multi-process island, once per step: the leader's staged changes
        reach the others (the leader already holds them), and a stop asked of any process holds
        for all of them from the next step (island/group.py)."""
        shared = [p.version for p in self.progress] + [self.progress_ppm]
        stop, shared, changed = self.group.agree(self.stop_requested, shared, self.staged)
        versions, self.progress_ppm = shared[:-1], shared[-1]
        self.staged = {}
        if not self.group.leader:
            if changed:
                self.trainer.set_params(changed)
            # what the metrics show: the leader's versions
            for progress, version in zip(self.progress, versions):
                progress.version = version
        self.group_stop = self.group_stop or stop

    def flush(self) -> int:
        """Leaving: send every fragment's unsent work (what the island trained since its last send
        of it, up to H steps each), so that the global model keeps it.  A delta of fewer than H
        steps weighs its share in the fold (merge.share_window), as any other.  Nothing is awaited
        here: the caller drains the link.  Returns how many deltas were sent."""
        if self.link is None:
            return 0
        # the work goes out on the newest global value ("replace" would drop it)
        if self.sync.adoption == "rebase":
            self._adopt(self.link.snapshots())
        unsent = [p for p, progress in enumerate(self.progress) if progress.steps > 0]
        self._send(unsent)
        return len(unsent)

    def _send(self, due: list[int]) -> None:
        theta = self.trainer.params()
        for fragment in due:
            progress = self.progress[fragment]
            # the next delta counts from here: what was just sent is never sent again
            delta, anchor = exchange.advance(progress.anchor, theta)
            self.link.publish(fragment, progress.version, delta, progress.steps, progress.tokens)
            self.progress[fragment] = FragmentProgress(anchor, progress.version)

    def _adopt(self, arrived: list) -> None:
        """Take newer global fragments.  With adoption "rebase" (the default) the island's progress
        on the fragment since its last send stays on top of the new value and goes out, whole, in
        the next delta; "replace" overwrites it (adopt-on-arrival: a snapshot arriving just before a
        send throws away up to H steps of the island's work on that fragment).  A delta's
        base_version is then the version its work was last rebased onto: part of that work was done
        on older versions, which the staleness bound does not see; so is a delta of the fragment
        still in the link's outbox (`rebase_unsent`: work held across a partition goes out on the
        newest value, not rejected as stale).  Snapshots are full values: of several versions of
        one fragment only the newest is taken."""
        newest: dict[int, tuple[int, dict]] = {}
        for fragment, version, tensors in arrived:
            if version > max(self.progress[fragment].version, newest.get(fragment, (-1, None))[0]):
                newest[fragment] = (version, tensors)
        if not newest:
            return
        theta = self.trainer.params()
        for fragment, (version, tensors) in newest.items():
            progress = self.progress[fragment]
            anchor = exchange.Anchor.adopted(tensors)
            # after a send theta - anchor is what holding the anchor rounded off: kept too
            unsent = progress.steps > 0 or progress.anchor.offset is not None
            if self.sync.adoption == "rebase" and unsent:
                residual = self.link.take_residuals(tensors) if self.sync.error_feedback else {}
                self._set(exchange.rebase(theta, progress.anchor.values(), tensors, residual))
                self.progress[fragment] = FragmentProgress(
                    anchor, version, progress.steps, progress.tokens
                )
            # replace, or nothing unsent to keep: the same
            else:
                self._set(exchange.adopt(theta, tensors, self.sync.alpha))
                self.progress[fragment] = FragmentProgress(anchor, version)
            if self.sync.adoption == "rebase" and self.link is not None:
                self.link.rebase_unsent(fragment, version)

    def evaluate_trace(self, budget_s: float) -> int:
        """Evaluate the parameters copied after each of the first `train.eval_trace` steps, now that
        training is over.  An evaluation costs about two training steps here, so evaluating at every
        early step would slow the early steps it measures; the copy costs milliseconds.  The result
        is exactly what an evaluation at that step would give (tested), written as an event
        with that step's time and tokens and `deferred: true`.  The final parameters are restored.
        Stops after `budget_s` seconds or when a stop is requested (the caller clears the first
        one): a launcher waits for islands to exit.  Returns how many were evaluated."""
        deadline, count = time.monotonic() + budget_s, 0
        final = self.trainer.params() if self.trace else None
        for event, params in self.trace:
            if self.stop_requested or time.monotonic() > deadline:
                break
            self.trainer.set_params(params)
            self.metrics.write(
                {
                    **event,
                    **_held_out(self.trainer.evaluate_all(self.eval_batches)),
                    "deferred": True,
                }
            )
            count += 1
        if final is not None:
            self.trainer.set_params(final)
        self.trace = []
        return count

    def _evaluate(self) -> dict[str, float]:
        """Held-out loss and the task's metrics, as metric fields (eval_loss, eval_<name>).  Its
        time counts as compute: `compute_util` is the share of wall time spent on the island's own
        work (training steps, evaluations), not waiting or bookkeeping."""
        began = time.perf_counter()
        results = self.trainer.evaluate_all(self.eval_batches)
        self.compute_s += time.perf_counter() - began
        return _held_out(results)

    def _wait_for_fold(self, sent: dict[int, int], unfolded: dict[int, int]) -> None:
        """The synchronous baselines: training stops until every fragment just sent comes back in a
        newer version (the merger folds a round once it has every island's delta), or its delta is
        settled without a fold (rejected: no fold will bring it back).  This wait is what
        `compute_util` shows and what the decoupled mode never does."""
        began = time.perf_counter()
        while not self.stop_requested:
            self._adopt(self.link.snapshots())
            if exchange.fold_wait_over(
                sent, {f: self.progress[f].version for f in sent}, unfolded, self.link.unfolded
            ):
                break
            time.sleep(0.001)
        self.wait_s += time.perf_counter() - began


def _held_out(results: Mapping[str, float]) -> dict[str, float]:
    return {f"eval_{name}": value for name, value in results.items()}
