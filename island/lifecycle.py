"""How an island process ends, once its training loop has returned or its group has broken.

In order (`Ending.finish`): a multi-process island's processes pass JAX's shutdown barrier
together (the leader first flushes what it holds back, so that every process takes part in the
same last steps); a CPU-quota'd island leaves its quota (sending and evaluating are not the
emulated chip's work); the leader flushes, drains what it sent until the merger has settled it,
adds the link's counters to the summary and closes the link, so that nobody waits on it while it
evaluates its trace (`--eval-trace`, within TRACE_BUDGET_S; a second SIGTERM skips or cuts it).

`Ending.group_lost`: another process of the island died.  The leader still drains what it sent,
for at most half the group's timeout (after it, JAX's coordination service ends the survivors),
then the process exits (3) at once: JAX's shutdown barrier would wait for the dead process and
then abort this one.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, NoReturn

from dloco.island.cpugroup import CpuGroupError

# --eval-trace after training, at most this long: a launcher waits 150 s for a stopped island
# (cluster/processes.py STOP_TIMEOUT_S), which drains first, up to 30 s.
TRACE_BUDGET_S = 90.0
GROUP_LOST_EXIT = 3


@dataclasses.dataclass
class Ending:
    """What an island process holds when its loop ends (see the module's text)."""

    # island/loop.py IslandLoop
    loop: Any
    # island/network.py NetworkLink, or None: standalone, or not the group's leader
    link: Any
    # island/metrics.py MetricsWriter
    metrics: Any
    log: Any
    flush_on_leave: bool
    drain_timeout: float
    group_timeout: float
    # one of several processes of a multi-process island
    grouped: bool
    # island/cpugroup.py CpuGroup, or None
    cpu_group: Any = None

    def finish(self, summary: dict, signals: int) -> dict:
        """Everything after a loop that returned `summary`; `signals`: SIGTERMs and Ctrl-Cs seen."""
        if self.grouped:
            self._leave_group(summary)
        if self.cpu_group is not None:
            try:
                self.cpu_group.leave()
            # the work is done: drain and exit at the quota's speed
            except CpuGroupError as error:
                self.log.warning("cpu_quota_not_left", error=str(error))
        if self.link is not None:
            self._drain(summary)
        if self.loop.trace and signals <= 1:
            self.log.info("evaluating_trace", steps=len(self.loop.trace))
            self.loop.stop_requested = False
            summary["traced_evaluations"] = self.loop.evaluate_trace(budget_s=TRACE_BUDGET_S)
        self.metrics.close()
        return summary

    def _leave_group(self, summary: dict) -> None:
        """Every process passes the group's shutdown barrier here, before the leader drains."""
        import jax

        if self.flush_on_leave and self.link is not None:
            summary["flushed"] = self.loop.flush()
        try:
            jax.distributed.shutdown()
        # Another process died after the last step; JAX raises what its runtime says.
        except Exception as error:  # noqa: BLE001
            self.group_lost(error)

    def _drain(self, summary: dict) -> None:
        link = self.link
        if self.flush_on_leave and not self.grouped:
            summary["flushed"] = self.loop.flush()
        if not link.drain(self.drain_timeout):
            self.log.warning(
                "drain_incomplete", deltas_sent=link.deltas_sent, settled=dict(link.results)
            )
        # After the drain: every delta of the island's work.
        summary.update(
            deltas_sent=link.deltas_sent,
            summed=link.summed,
            rebased=link.uplink.rebased,
            scaled=link.uplink.scaled,
            acks=dict(link.results),
            # the inner steps those deltas carried, by result
            settled_steps=dict(link.step_results),
            snapshots=dict(link.downlink_results),
            bytes_sent=link.bytes_sent,
            links=link.links.summary(),
            merger_epochs=link.adopted_epochs,
            epoch=link.epoch,
        )
        self.link = None
        # the merger has all it will get: evaluating the trace keeps no one waiting
        link.close()

    def group_lost(self, error: BaseException) -> NoReturn:
        """Another process of this island died (see the module's text)."""
        self.log.error("group_lost", error=str(error))
        # On disk before the drain: JAX's coordination service may end this process during it.
        sys.stdout.flush()
        if self.link is not None:
            self.link.drain(min(self.drain_timeout, self.group_timeout / 2))
            self.link.close()
        self.metrics.close()
        print(f"dloco island: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(GROUP_LOST_EXIT)
