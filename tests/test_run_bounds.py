"""Runs bounded by work: the verdict on a finished run (pure, hand-made counts), the progress a
launcher reads from a run directory as it grows, and where a slow island was."""

from __future__ import annotations

import json

import pytest

from dloco.analysis import verdict
from dloco.analysis.progress import RunProgress, island_stage
from dloco.cluster import config
from dloco.protocol.errors import ConfigError


def test_a_run_that_did_not_train_says_why():
    assert verdict.untrained({"a": 48, "b": 300}, folds=1, interval=48) == []
    assert verdict.untrained({"a": 1, "b": 47}, folds=0, interval=48) == [
        "island a made 1 training step, fewer than one interval (H = 48)",
        "island b made 47 training steps, fewer than one interval (H = 48)",
        "the merger never folded a delta: the global model did not change",
    ]


def test_a_run_past_its_time_limit_names_each_slow_island_and_its_stage():
    assert verdict.unfinished({}, 600) == []
    (line,) = verdict.unfinished(
        {"c": "stepping (120 of 200 steps made)", "d": "joining (waiting for the merger's model)"},
        600,
    )
    assert (
        line == "the time limit (600 s) passed before every island had made its steps: "
        "c stepping (120 of 200 steps made); d joining (waiting for the merger's model)"
    )
    assert verdict.unreached([], {"a": 3}, 0) == []
    assert verdict.unreached(["kill:merger@folds=9"], {"a": 30}, 4) == [
        "chaos events never reached: kill:merger@folds=9 (steps made: a 30; folds: 4)"
    ]
    assert verdict.unreached(["heal:a@a.folds=+2"], {"a": 30, "b": 9}, 4, {"a": 1, "b": 3}) == [
        "chaos events never reached: heal:a@a.folds=+2 (steps made: a 30, b 9; folds: 4 (a 1, b 3))"
    ]


def test_a_bounded_run_ends_when_every_island_up_has_its_steps_and_two_intervals_after_the_chaos():
    islands = ["a", "b", "c"]
    # no chaos: max_steps each
    assert verdict.targets(islands, set(), 200, 20, None) == {"a": 200, "b": 200, "c": 200}
    # after the schedule's last event each island needs two intervals more than it had then, or
    # max_steps if that is more
    assert verdict.targets(islands, set(), 200, 20, {"a": 900, "b": 150, "c": 170}) == {
        "a": 940,
        "b": 200,
        "c": 210,
    }
    # killed for good: no target
    assert verdict.targets(islands, {"c"}, 200, 20, {"a": 0, "b": 0, "c": 0}) == {
        "a": 200,
        "b": 200,
    }
    wanted = verdict.targets(islands, set(), 200, 20, {"a": 900, "b": 150, "c": 170})
    assert verdict.short({"a": 939, "b": 200, "c": 300}, wanted) == {"a": 940}
    assert verdict.short({"a": 940, "b": 200, "c": 210}, wanted) == {}


def _append(path, *events, partial: str = ""):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write("".join(json.dumps(e) + "\n" for e in events) + partial)


def test_progress_counts_every_life_and_reads_only_what_was_appended(tmp_path):
    metrics, log = tmp_path / "metrics" / "a.jsonl", tmp_path / "logs" / "merger.log"
    progress = RunProgress(tmp_path, ["a", "b"])
    # nothing written yet
    progress.update()
    assert (progress.steps, progress.folds) == ({"a": 0, "b": 0}, 0)
    _append(metrics, {"step": 0, "eval_loss": 5.0}, {"step": 1}, {"step": 2}, partial='{"step": 3')
    _append(
        log,
        {"event": "fold", "contributors": ["a", "b", "a"]},
        {"event": "admitted", "contributors": ["a"]},
        {"event": "fold", "contributors": ["b", "z"]},
    )
    progress.update()
    assert (progress.steps["a"], progress.last_step["a"], progress.folds) == (2, 2, 2)
    # folds that took one of the island's deltas (a fold of two of a's counts once)
    assert progress.folded == {"a": 1, "b": 2}
    # the line being written is complete now: counted once
    _append(metrics, partial="}\n")
    progress.update()
    progress.update()
    assert (progress.steps["a"], progress.last_step["a"]) == (3, 3)
    # a restart: the new life starts at step 0 again, the count goes on; evaluations after training
    # are not steps
    _append(
        metrics,
        {"step": 0, "eval_loss": 4.0},
        {"step": 1},
        {"step": 1, "deferred": True, "eval_loss": 3.0},
    )
    _append(log, {"event": "fold"})
    progress.update()
    assert (progress.steps["a"], progress.last_step["a"], progress.folds) == (4, 1, 3)


def test_an_island_stage_comes_from_its_log(tmp_path):
    log = tmp_path / "a.log"
    assert island_stage(log, 0, 0, 100).startswith("starting")
    _append(log, {"event": "corpus"})
    assert island_stage(log, 0, 0, 100).startswith("starting")
    _append(log, {"event": "model"})
    assert island_stage(log, 0, 0, 100) == "joining (waiting for the merger's model)"
    _append(log, {"event": "joined"})
    assert island_stage(log, 0, 0, 100) == "compiling (its first step)"
    assert island_stage(log, 7, 7, 100) == "stepping (7 of 100 steps made)"
    # restarted: a new life, the steps of the last one still count
    _append(log, {"event": "corpus"})
    assert island_stage(log, 7, 7, 100).startswith("starting")
    _append(log, {"event": "model"}, {"event": "joined"})
    assert (
        island_stage(log, 0, 7, 100) == "compiling (its first step)"
        and island_stage(log, 2, 9, 100) == "stepping (9 of 100 steps made)"
    )


def test_max_steps_must_cover_an_interval(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        "[run]\nmax_steps = 60\n[sync]\nfragments = 2\ninterval = 10\n[[regions]]\nname = 'a'\n"
    )
    bounded = config.load(path)
    assert bounded.max_steps == 60 and config.load().max_steps == 0
    assert bounded.with_steps(None) is bounded and bounded.with_steps(10).max_steps == 10
    with pytest.raises(
        ConfigError,
        match=(
            r"run.max_steps \(9\) must be at least the longest interval \(H = 10 in mode"
            r" decoupled\)"
        ),
    ):
        bounded.with_steps(9)
    # sync-avg exchanges every step
    assert bounded.with_mode("sync-avg").with_steps(1).max_steps == 1
    for bad in ("-1", "2.5", "'10'"):
        path.write_text(f"[run]\nmax_steps = {bad}\n[[regions]]\nname = 'a'\n")
        # a negative int is out of range; a float or a string is the wrong type
        with pytest.raises(ConfigError, match="run.max_steps must be an int"):
            config.load(path)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_suite_whose_run_did_not_get_its_steps_done_exits_non_zero_and_says_why(tmp_path):
    """A run bounded by work that hits its time limit (1 s: the islands are still starting) fails;
    the suite stops there, names the island and where it was, and writes no table."""
    import subprocess
    import sys

    out = tmp_path / "out"
    suite = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "experiment",
            "merging",
            "--quick",
            "--runs",
            "rda-2-islands",
            "--seconds",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert suite.returncode == 2, (suite.stdout[-2000:], suite.stderr[-2000:])
    assert (
        "merging: run rda-2-islands failed (exit 1: the time limit (1 s) passed before every island"
        " had made its steps: us-east " in suite.stderr
    )
    assert "Nothing is tabulated" in suite.stderr and not (out / "merging.md").exists()
    report = (out / "merging" / "rda-2-islands" / "report.md").read_text()
    # both islands are named, with their stage
    assert "## FAILED" in report and "us-west" in report.split("## Islands")[0]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_killed_launcher_takes_its_processes_with_it(tmp_path):
    """SIGKILL to `dloco up` (a test's timeout, an OOM kill) runs no handler: the broker, the merger
    and the islands it started stop by themselves instead of training for ever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.cluster_helpers import small_profile

    (tmp_path / "c.toml").write_text(
        small_profile(
            600, 20, '[[regions]]\nname = "a"\n[[regions]]\nname = "b"\n', max_steps=10**6
        )
    )
    run = tmp_path / "run"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(tmp_path / "c.toml"),
            "--run-dir",
            str(run),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started = run / "metrics" / "b.jsonl"
    deadline = time.monotonic() + 240
    while (
        not (started.exists() and started.stat().st_size > 0)
        and up.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert started.exists(), "the islands never started"
    children = [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-f", str(run)], capture_output=True, text=True
        ).stdout.split()
    ]
    # broker, merger, a, b (and the launcher's own command line)
    assert len(children) >= 4, children
    up.send_signal(signal.SIGKILL)
    up.wait(timeout=30)
    # islands stop after their step and drain (up to 30 s) without a merger
    deadline = time.monotonic() + 120
    while (
        alive := [pid for pid in children if os.path.exists(f"/proc/{pid}") and pid != up.pid]
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, alive


def test_a_started_process_checks_its_launcher_and_keeps_the_mark_from_its_own_children():
    """DLOCO_LAUNCHER_PID names the `dloco up` a process must die with: it starts only while that is
    its parent, and its own children (prepare runs `dloco island --write-init`) do not inherit it.
    """
    import os
    import subprocess
    import sys

    probe = (
        "import os; from dloco.cli import stop_with_launcher; "
        "print(stop_with_launcher(), 'DLOCO_LAUNCHER_PID' in os.environ)"
    )
    for launcher, expected in ((str(os.getpid()), "True False"), ("1", "False False")):
        run = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DLOCO_LAUNCHER_PID": launcher},
        )
        assert run.stdout.split() == expected.split(), (launcher, run.stdout, run.stderr)
    bare = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "DLOCO_LAUNCHER_PID"},
    )
    assert bare.stdout.split() == ["True", "False"], bare.stderr


def test_progress_sums_the_tokens_of_every_island_and_every_life(tmp_path):
    progress = RunProgress(tmp_path, ["a", "b"])
    _append(
        tmp_path / "metrics" / "a.jsonl",
        {"step": 0, "tokens": 0},
        {"step": 1, "tokens": 256},
        {"step": 2, "tokens": 512},
    )
    _append(tmp_path / "metrics" / "b.jsonl", {"step": 0, "tokens": 0}, {"step": 1, "tokens": 256})
    progress.update()
    assert progress.tokens == 768
    # a restarts: its first life's 512 stay counted, the new life's counter starts at 0
    _append(tmp_path / "metrics" / "a.jsonl", {"step": 0, "tokens": 0}, {"step": 1, "tokens": 256})
    progress.update()
    assert progress.tokens == 512 + 256 + 256


def test_a_budgeted_run_past_its_time_limit_says_how_much_it_spent():
    assert verdict.budget_unspent(1000, 1000, 60) == []
    (reason,) = verdict.budget_unspent(250, 1000, 60)
    assert "250 of the budget's 1,000 tokens" in reason and "(25%)" in reason and "60 s" in reason


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_run_with_a_token_budget_ends_when_the_cluster_spent_it(tmp_path):
    """`dloco up --tokens N`: two islands, one at half speed, decay over the cluster's tokens and
    the run ends once they have trained N together (duration only a limit)."""
    import subprocess
    import sys

    from tests.cluster_helpers import small_profile

    regions = '[[regions]]\nname = "a"\n[[regions]]\nname = "b"\nslowdown = 2.0\n'
    (tmp_path / "c.toml").write_text(small_profile(360, 20, regions))
    # about 130 steps of the fast island, 70 of the slow
    run, budget = tmp_path / "run", 200 * 8 * 32
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(tmp_path / "c.toml"),
            "--run-dir",
            str(run),
            "--tokens",
            str(budget),
            "--status-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    progress = RunProgress(run, ["a", "b"])
    progress.update()
    assert progress.tokens >= budget
    lines = {
        name: [json.loads(line) for line in open(run / "metrics" / f"{name}.jsonl")]
        for name in ("a", "b")
    }
    for name, events in lines.items():
        stepped = [e for e in events if e.get("step", 0) > 0]
        assert stepped and all("budget_progress" in e for e in stepped), name
    # the schedules followed the cluster, not each island's own work: at some step an island was
    # ahead of its own share by a tenth of the budget (the other's work, as the merger told it)
    ahead = max(
        e["budget_progress"] - e["tokens"] / budget
        for events in lines.values()
        for e in events
        if e.get("step", 0) > 0
    )
    assert ahead > 0.1
