"""The live view of `dloco up`: one compact table, refreshed every second in a terminal (a line
every ten seconds when the output is a file)."""

from __future__ import annotations

import sys
import time

from dloco.analysis.runinfo import JsonTail, last_events, merger_logs
from dloco.cluster.config import ClusterConfig


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


class LiveView:
    def __init__(self, config: ClusterConfig, run_dir, out=sys.stdout) -> None:
        self.config, self.run_dir, self.out = config, run_dir, out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.eval_loss: dict[str, float] = {}
        self.last_plain = 0.0
        # with a standby: each merger's role
        self.roles: dict[str, JsonTail] = {}
        self.role: dict[str, str] = {}

    def refresh(self, elapsed: float) -> None:
        if not self.tty and time.monotonic() - self.last_plain < 10:
            return
        self.last_plain = time.monotonic()
        lines = [
            self.header(elapsed),
            (
                f"{'region':16} {'step':>6} {'tok/s':>8} {'util':>5} {'eval':>6}"
                f" {'snapshot versions':>18} {'sent':>8} {'recv':>8}"
            ),
            *(self.region_line(region.name) for region in self.config.regions),
            *self.merger_lines(),
        ]
        text = "\n".join(lines)
        if self.tty:
            self.out.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            self.out.write(text + "\n\n")
        self.out.flush()

    def region_line(self, region: str) -> str:
        """The table's row of an island: its last metrics, and its last evaluation."""
        # not: after training
        events = [
            e
            for e in last_events(self.run_dir / "metrics" / f"{region}.jsonl")
            if not e.get("deferred")
        ]
        if not events:
            return f"{region:16} {'(joining)':>6}"
        last = events[-1]
        for event in events:
            if "eval_loss" in event:
                self.eval_loss[region] = event["eval_loss"]
        rate = last.get("tokens", 0) / max(last.get("time", 0) or 1e-9, 1e-9)
        versions = ",".join(str(v) for v in last.get("snapshot_version", []))
        return (
            f"{region:16} {last.get('step', 0):>6} {rate:>8.0f}"
            f" {last.get('compute_util', 0):>5.2f}"
            f" {self.eval_loss.get(region, float('nan')):>6.3f} {versions:>18}"
            f" {_bytes(last.get('bytes_sent', 0)):>8}"
            f" {_bytes(last.get('bytes_received', 0)):>8}"
        )

    def merger_lines(self) -> list[str]:
        """The mergers' last fold and, with a standby, each merger's role."""
        lines = []
        logs = merger_logs(self.run_dir)
        folds = sorted(
            (
                e
                for name in logs
                for e in last_events(self.run_dir / "logs" / name)
                if e.get("event") == "fold"
            ),
            key=lambda e: e.get("timestamp", ""),
        )
        if folds:
            lines.append(
                f"merger: last fold fragment {folds[-1]['fragment']} -> version"
                f" {folds[-1]['version']} from {', '.join(folds[-1]['contributors'])} (staleness"
                f" {folds[-1]['staleness']})"
            )
        for name in logs:
            self.roles.setdefault(name, JsonTail(self.run_dir / "logs" / name))
        for name, log in self.roles.items():
            for event in log.new():
                # a merger with a peer says its role
                if (role := role_line(event, self.role.get(name))) is not None:
                    self.role[name] = role
        if self.role:
            lines.append(
                "mergers: "
                + "; ".join(
                    f"{name.removesuffix('.log')} {what}"
                    for name, what in sorted(self.role.items())
                )
            )
        return lines

    def header(self, elapsed: float) -> str:
        total = self.config.duration_s
        # bounded by work: the bar is the islands' steps, the seconds a limit
        if self.config.max_steps:
            steps = [self._last_step(region.name) for region in self.config.regions]
            done = min(1.0, min(steps, default=0) / self.config.max_steps)
            bound = (
                f"{min(steps, default=0)}/{self.config.max_steps} steps (slowest island),"
                f" {elapsed:5.0f} s of at most {total:.0f}"
            )
        else:
            done = min(1.0, elapsed / total)
            bound = f"{elapsed:5.0f}/{total:.0f} s"
        bar = "#" * int(done * 30) + "-" * (30 - int(done * 30))
        return f"dloco up ({self.config.mode}): {len(self.config.regions)} regions  [{bar}] {bound}"

    def _last_step(self, region: str) -> int:
        events = [
            e
            for e in last_events(self.run_dir / "metrics" / f"{region}.jsonl", tail_bytes=4096)
            if "step" in e and not e.get("deferred")
        ]
        return events[-1]["step"] if events else 0


def role_line(event: dict, was: str | None) -> str | None:
    """What a merger's log event says of its role, for the live view's `mergers:` line."""
    kind = event.get("event")
    if kind == "replication":
        return f"primary, standby {event.get('state')}" + (
            " (acks no longer wait for it)" if event.get("state") == "alone" else ""
        )
    return {
        "following": "standby",
        "no_primary": "primary",
        "taking_over": f"primary (took over, epoch {event.get('epoch')})",
        "stepped_down": "stepped down (fenced)",
        "standby_stopped": f"stopped: {event.get('error', '')[:80]}",
    }.get(kind, was)
