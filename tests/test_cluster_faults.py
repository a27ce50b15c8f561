"""Fault isolation under `dloco up --chaos` (small model, three islands): one island killed -9 and
restarted, then the merger, then the broker, each at a point of the run's progress (steps, folds).
The survivors keep stepping, the merger keeps folding, the restarted island rejoins from the global
model and is folded again, the restarted merger recovers from its log without losing an admitted
delta (replay matches), and the bus heals by itself.  Everything asserted is a count or an order
of events, so it holds whatever share of the CPU each process gets.  This is also the three-island
end-to-end run: the global model's held-out loss must fall."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dloco.analysis.runinfo import chaos_effects, merger_folds, read_events, read_metrics, wall
from tests.cluster_helpers import small_profile

STEPS = 200
# Islands on older hardware (they sleep their slowdown), each fragment every 10 steps: the tiny
# model alone steps ~40 times a second here, and three islands of it flood a merger that shares 2
# cores.
PROFILE = small_profile(
    400,
    25,
    """
[[regions]]
name = "a"
slowdown = 2.0
uplink_mbps = 8
rtt_ms = 20

[[regions]]
name = "b"
slowdown = 2.0
uplink_mbps = 8
rtt_ms = 40

[[regions]]
name = "c"
slowdown = 4.0
uplink_mbps = 4
rtt_ms = 60
""",
    max_steps=STEPS,
).replace("interval = 10", "interval = 20")
# Each event once the one before has fired and the run has gone on by: c's 30th step; 100 more steps
# of a (c is away meanwhile); 30 steps of the restarted c; 60 more of a (no merger meanwhile); 6
# folds of the restarted merger; 60 more steps of a (no broker meanwhile).
SCHEDULE = (
    "kill:c@step=30,restart:c@a.step=+100,kill:merger@c.step=+30,restart:merger@a.step=+60,"
    "kill:broker@folds=+6,restart:broker@a.step=+60"
)
# the other fast island's steps while a makes 60-100: a stalled island makes none
SURVIVOR_STEPS = 10


def _events(log, name):
    return [e for e in read_events(log) if e.get("event") == name]


def _steps_between(run, island, start, end):
    return sum(
        1
        for e in read_metrics(run / "metrics" / f"{island}.jsonl")
        if e.get("step", 0) > 0 and start <= e["wall"] < end
    )


# Over 60 lines: one cluster run checked in its schedule's order: an island, the merger, then the
# broker killed and restarted, then the run as a whole.
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_island_merger_and_broker_crashes_are_survived(tmp_path):
    (tmp_path / "faults.toml").write_text(PROFILE)
    run = tmp_path / "run"
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(tmp_path / "faults.toml"),
            "--run-dir",
            str(run),
            "--chaos",
            SCHEDULE,
        ],
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    assert "exited early" not in up.stdout
    # the live view showed every island
    assert all(f"\n{name} " in up.stdout for name in ("a", "b", "c"))
    executed = read_events(run / "chaos.jsonl")
    assert [e["when"] for e in executed] == SCHEDULE.split(",")
    kill_c, restart_c, kill_merger, restart_merger, kill_broker, restart_broker = (
        e["wall"] for e in executed
    )
    rows = chaos_effects(run, ["a", "b", "c"])
    summary = json.dumps(rows, indent=1)
    folds = [(wall(e), set(e["contributors"])) for e in merger_folds(run)]

    def contributors(start, end):
        return set().union(*(c for w, c in folds if start <= w < end))

    # An island dies: the others keep stepping and keep being folded (a's steps moved the schedule
    # on).
    assert _steps_between(run, "b", kill_c, restart_c) >= SURVIVOR_STEPS, summary
    assert {"a", "b"} <= contributors(kill_c, kill_merger), summary
    # ... it comes back: joins from the current global model (not the initial one) and its deltas
    # are folded again.
    joined = _events(run / "logs" / "c.log", "joined")
    assert len(joined) == 2 and min(joined[1]["versions"]) > 0, joined
    assert "c" in contributors(restart_c, float("inf")), summary

    # The merger dies: islands train on through the outage; the restarted merger recovers from its
    # log and folds everyone.
    assert _steps_between(run, "b", kill_merger, restart_merger) >= SURVIVOR_STEPS, summary
    assert _steps_between(run, "c", kill_merger, restart_merger) >= 1, summary
    assert (
        not contributors(kill_merger, restart_merger)
        and len(_events(run / "logs" / "merger.log", "recovered")) == 1
    )
    assert {"a", "b", "c"} <= contributors(restart_merger, float("inf")), summary
    # No admitted delta is lost: every delta each island's last process sent was settled (re-sent
    # where needed) ...
    for island in ("a", "b", "c"):
        done = _events(run / "logs" / f"{island}.log", "done")[-1]
        assert (
            done["acks"].get("folded", 0) + done["acks"].get("rejected", 0)
            == done["deltas_sent"]
            > 0
        ), done
    # ... and replaying the log rebuilds exactly the state the restarted merger ended with.
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "replay",
            str(run / "merger"),
            "--verify",
            "--every",
            "1000000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replay.returncode == 0, replay.stderr
    final = _events(run / "logs" / "merger.log", "checkpoint")[-1]["digest"]
    assert replay.stdout.strip().splitlines()[-1].endswith(f"ok sha256={final}")

    # The broker dies and comes back: no operator action, every island is folded again.
    assert _steps_between(run, "b", kill_broker, restart_broker) >= SURVIVOR_STEPS, summary
    assert {"a", "b", "c"} <= contributors(restart_broker, float("inf")), summary

    # Through all of it the global model learned, every island made its steps, and the report says
    # what happened.
    assert all(
        sum(1 for e in read_metrics(run / "metrics" / f"{name}.jsonl") if e.get("step", 0) > 0)
        >= STEPS
        for name in ("a", "b", "c")
    )
    report = (run / "report.md").read_text()
    assert (
        "## Chaos" in report
        and "kill merger" in report
        and "restart broker" in report
        and "FAILED" not in report
    )
    # the global model's row
    row = next(line for line in report.splitlines() if line.startswith("| ") and "| {" in line)
    initial, final = (float(cell) for cell in row.split("|")[3:5])
    assert final < initial - 1.0, row
    for plot in (
        "eval_loss_vs_time.png",
        "eval_loss_vs_tokens.png",
        "bytes_on_wire.png",
        "compute_util.png",
    ):
        assert (run / "plots" / plot).stat().st_size > 5000
