"""Faults of the network, not of processes: `dloco up` with `[run] network = "netns"` puts every
host in a network namespace of its own behind a router (cluster/netns.py), and chaos partitions
links (no reset: TCP stays established, only ZMTP heartbeats notice), drops one direction, or drops
a share of the packets.  Partitions last multiples of the heartbeat timeout; everything asserted is
a count or an order of events (folds, acks, steps, log records), whatever CPU share each process
gets.

Root and network namespaces are needed (CI has both: .ci/run sets DLOCO_REQUIRE_NETNS, so that a
machine without them fails there instead of skipping)."""

# Over 400 lines: every network fault's run in namespaces (a run each, minutes apart), with the
# helpers that read what the run left behind; split, each file would repeat them.

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from dloco.analysis.runinfo import merger_folds, read_events, read_metrics, wall
from dloco.bus.sockets import HEARTBEAT_TIMEOUT_MS
from dloco.cluster import netns
from dloco.merger.log.segments import read_records
from tests.cluster_helpers import small_profile

TIMEOUT_S = HEARTBEAT_TIMEOUT_MS / 1000
# small_profile's
FRAGMENTS = 2
REGIONS = """
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
"""


@pytest.fixture(autouse=True)
def namespaces():
    reason = netns.unavailable()
    if reason is not None:
        if os.environ.get("DLOCO_REQUIRE_NETNS"):
            pytest.fail(f"network namespaces are required here (DLOCO_REQUIRE_NETNS) but: {reason}")
        print(f"skipped: {reason}")
        pytest.skip(reason)


def _up(tmp_path, schedule: str, max_steps: int = 100, timeout: int = 900, merger: str = ""):
    """`dloco up` in namespaces under `schedule` (`merger`: lines added to [merger])."""
    profile = small_profile(timeout - 100, 50, REGIONS, max_steps=max_steps).replace(
        "[run]\n", '[run]\nnetwork = "netns"\n'
    )
    profile = profile.replace("share_window = 8\n", f"share_window = 8\n{merger}")
    (tmp_path / "c.toml").write_text(profile)
    run = tmp_path / "run"
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(tmp_path / "c.toml"),
            "--run-dir",
            str(run),
            "--chaos",
            schedule,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as up:
        try:
            stdout, stderr = up.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, (stdout[-3000:], stderr[-3000:])
    executed = read_events(run / "chaos.jsonl")
    assert [e["when"] for e in executed] == schedule.split(","), executed
    # `dloco up` removed its namespaces (named after its process id) as it stopped
    assert not [name for name in _namespaces() if name.startswith(f"dloco-{up.pid}-")]
    return run, [e["wall"] for e in executed]


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("dloco-")}


def _steps_between(run, island, start, end):
    return sum(
        1
        for e in read_metrics(run / "metrics" / f"{island}.jsonl")
        if e.get("step", 0) > 0 and start <= e["wall"] < end
    )


def _folded_islands(run, start, end):
    return set().union(
        *(set(e["contributors"]) for e in merger_folds(run) if start <= wall(e) < end)
    )


def _sent_by(run, island, when) -> int:
    """How many deltas `island` had sent by `when`, at most: its count on the first metrics line
    written at or after it (delta ids count up from 1, one per delta sent)."""
    lines = read_metrics(run / "metrics" / f"{island}.jsonl")
    return next(
        (e.get("deltas_sent", 0) for e in lines if e["wall"] >= when), lines[-1]["deltas_sent"]
    )


def _folded_members(run, start, end) -> set[tuple[str, int, int]]:
    """The deltas (island, epoch, id) of the folds the merger logged between `start` and `end`
    (their members from its write-ahead log, by fragment and version)."""
    members = {
        (r["fragment"], r["version"]): r["members"]
        for _, r in read_records(run / "merger" / "wal")
        if r.get("type") == "fold"
    }
    return {
        tuple(m)
        for e in merger_folds(run)
        if start <= wall(e) < end
        for m in members[e["fragment"], e["version"]]
    }


def _only_sent_before(run, cut, healed, islands) -> None:
    """A cut lets nothing through: what the merger folded until the heal was sent before the cut
    (received then, folded whenever the merger got to it)."""
    sent = {island: _sent_by(run, island, cut) for island in islands}
    late = [m for m in _folded_members(run, cut, healed) if m[0] in sent and m[2] > sent[m[0]]]
    assert not late, (late, sent)


def _settled_once(run, wal="merger"):
    """Every admitted delta folded at most once (the write-ahead log's fold records); every delta
    each island counted as folded is in the log, and every one it sent was settled (folded or
    rejected) but for those whose ack had not come when it stopped (`unknown`: the drain at the
    end waits 30 s).  Returns the islands' summaries."""
    folded = collections.Counter(
        tuple(m)
        for _, record in read_records(run / wal / "wal")
        if record.get("type") == "fold"
        for m in record["members"]
    )
    assert folded and max(folded.values()) == 1, folded.most_common(3)
    done = {}
    for island in ("a", "b"):
        done[island] = [
            e for e in read_events(run / "logs" / f"{island}.log") if e.get("event") == "done"
        ][-1]
        acks, logged = done[island]["acks"], sum(1 for member in folded if member[0] == island)
        assert (
            acks.get("folded", 0) + acks.get("rejected", 0) + acks.get("unknown", 0)
            == done[island]["deltas_sent"]
            > 0
        ), done[island]
        assert acks.get("folded", 0) <= logged <= acks.get("folded", 0) + acks.get("unknown", 0), (
            island,
            acks,
            logged,
        )
    return done


def _rejections_logged(run, island) -> int:
    """The merger's count of `island`'s rejected deltas: its throttled lines, and the lines each
    left out."""
    lines = [
        e
        for e in read_events(run / "logs" / "merger.log")
        if e.get("event") == "delta_rejected" and e.get("island") == island
    ]
    return sum((0 if e.get("flushed") else 1) + e.get("left_out", 0) for e in lines)


# Over 60 lines: two cuts, then what each must leave behind, checked in the order they happened.
@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_an_island_partitioned_for_2x_then_20x_the_heartbeat_timeout_trains_on_and_resyncs(
    tmp_path,
):
    """a is cut off (both ways, silently) for 2x, then 20x the heartbeat timeout, and trains on
    meanwhile.  b keeps training and being folded; a's work queued during the cut is folded or
    rejected as stale on healing, each counted in the merger's log (only what it sent before a cut
    was noticed: the rest waited in its outbox, summed, and went out rebased on the newest values,
    scaled to its recent deltas' norm); a resyncs and is folded again
    (each cut after the first, and the run's end, wait for two folds of a's deltas after a heal:
    the schedule's completion is the check); nothing is folded twice.  The cuts leave a's
    connections half-open (no reset): only the heartbeats can tell, and a's link watcher logs each
    of its three sockets going down during every cut and coming back after it (a link not dropped in
    time would have resumed silently once healed)."""
    short, long = 2 * TIMEOUT_S, 20 * TIMEOUT_S
    schedule = (
        f"partition:a@step=40,heal:a@+{short:g},"
        f"partition:a@a.folds=+2,heal:a@+{long:g},heal:a@a.folds=+2"
    )
    run, (cut1, _, cut2, healed2, _) = _up(tmp_path, schedule)
    assert (
        _steps_between(run, "a", cut2, healed2) >= 20
        and _steps_between(run, "b", cut2, healed2) >= 20
    )
    assert "b" in _folded_islands(run, cut2 + TIMEOUT_S, healed2)
    _only_sent_before(run, cut2, healed2, ["a"])
    merger = read_events(run / "logs" / "merger.log")
    assert [
        e["event"]
        for e in merger
        if e.get("island") == "a" and e.get("event") in ("island_gone", "island_back")
    ][-2:] == ["island_gone", "island_back"]
    done = _settled_once(run)
    # every rejection the merger logged reached a as one, or, on a busy machine, was given up as
    # "unknown" after settle_timeout_s of asking (a's queue of a thousand stale deltas is rejected
    # at once on healing)
    acks, logged = done["a"]["acks"], _rejections_logged(run, "a")
    assert acks.get("rejected", 0) <= logged <= acks.get("rejected", 0) + acks.get("unknown", 0), (
        acks,
        logged,
    )
    # what a trained during the cuts was held in its outbox, rebased and folded, not queued on an
    # old base and rejected: of its steps (each counted once per fragment) at least 3/4 reached the
    # global model (91 % measured; 3 % before the outbox held work across a cut).  What is lost was
    # sent in the heartbeat timeout before each cut was noticed.
    steps = {
        tuple(r[k] for k in ("island", "epoch", "delta_id")): r["steps"]
        for _, r in read_records(run / "merger" / "wal")
        if r.get("type") == "delta"
    }
    folded = {
        tuple(m)
        for _, r in read_records(run / "merger" / "wal")
        if r.get("type") == "fold"
        for m in r["members"]
    }
    kept = sum(n for key, n in steps.items() if key[0] == "a" and key in folded)
    assert kept >= 0.75 * FRAGMENTS * done["a"]["steps"], (kept, done["a"])
    assert done["a"]["rebased"] >= 1 and done["a"]["summed"] >= 1, done["a"]
    island = read_events(run / "logs" / "a.log")
    for cut, next_cut in ((cut1, cut2), (cut2, float("inf"))):
        changes = [
            (e["event"], e["socket"])
            for e in island
            if e.get("event") in ("link_down", "link_up") and cut < wall(e) < next_cut
        ]
        for socket in ("delta-bus", "snapshot-bus", "merger"):
            mine = [event for event, name in changes if name == socket]
            assert "link_down" in mine and "link_up" in mine[mine.index("link_down") :], (
                socket,
                changes,
            )
    assert all(
        done["a"]["links"][socket]["down"] >= 2
        for socket in ("delta-bus", "snapshot-bus", "merger")
    ), done["a"]["links"]


@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_one_way_partitions_and_packet_loss_lose_nothing(tmp_path):
    """a for 3x the heartbeat timeout sends nothing (it still hears snapshots), then hears nothing
    (its deltas still arrive, acks do not), then loses 2 %, then 10 % of its packets each way.  Each
    phase after a cut waits for folds of a's deltas (two after a heal; 30 and 10 under loss, enough
    packets for the router to drop some): the schedule's completion shows a folded again after each
    cut and during the loss (TCP resends).  The router counts what it dropped; every delta a sent is
    settled once, nothing folded twice."""
    cut = 3 * TIMEOUT_S
    schedule = (
        f"partition-out:a@step=40,heal:a@+{cut:g},partition-in:a@a.folds=+2,heal:a@+{cut:g},"
        f"loss-2:a@a.folds=+2,loss-10:a@a.folds=+30,heal:a@a.folds=+10,heal:a@+{3 * TIMEOUT_S:g}"
    )
    run, (out_cut, out_healed, in_cut, in_healed, *_) = _up(tmp_path, schedule)
    dropped = [e.get("dropped_packets") for e in read_events(run / "chaos.jsonl")]
    assert all(n > 0 for n in dropped[1:2] + dropped[3:4] + dropped[5:7]), dropped
    assert (
        _steps_between(run, "a", out_cut, out_healed) >= 10
        and _steps_between(run, "a", in_cut, in_healed) >= 10
    )
    _settled_once(run)


@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_the_merger_partitioned_from_the_broker_loses_no_acked_delta(tmp_path):
    """The merger is cut off for 4x the heartbeat timeout: the islands train on, nothing they send
    meanwhile is folded before the heal (what the merger had received before the cut may be), and
    after healing every acked delta is in the log exactly once."""
    schedule = f"partition:merger@folds=6,heal:merger@+{4 * TIMEOUT_S:g},heal:merger@a.step=+60"
    run, (cut, healed, _) = _up(tmp_path, schedule)
    assert (
        _steps_between(run, "a", cut, healed) >= 20 and _steps_between(run, "b", cut, healed) >= 20
    )
    _only_sent_before(run, cut, healed, ["a", "b"])
    assert {"a", "b"} <= _folded_islands(run, healed, float("inf"))
    _settled_once(run)
    report = json.dumps(read_events(run / "chaos.jsonl"))
    assert "partition" in report


# Over 60 lines: one split-brain run in its order: the cluster under its schedule, then the
# takeover, the fencing and the new primary's log, each checked against the cut.
@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_a_primary_and_standby_partitioned_from_each_other_but_not_from_the_broker(tmp_path):
    """The split-brain case, with the pair's own lease (`failover = "lease"`; the lease in etcd is
    the next test's): the primary and its standby lose each other for 6x the heartbeat timeout (ten
    leases), both still reaching the broker and the islands.  The standby takes over
    under a newer epoch once its lease runs out; the old primary, alone after two leases, folds what
    it still can (deltas whose bases are the new primary's versions it rejects) and is fenced on
    healing: it steps down, sets its unreplicated records aside and follows.  Every delta the
    islands counted as folded is in the new primary's log, exactly once (PROTOCOL.md §12 says what
    holds without a quorum)."""
    profile = small_profile(900, 50, REGIONS, max_steps=100).replace(
        "[run]\n", '[run]\nnetwork = "netns"\n'
    )
    (tmp_path / "c.toml").write_text(
        profile.replace("share_window = 8", 'share_window = 8\nstandby = true\nfailover = "lease"')
    )
    schedule = (
        f"partition-from-standby:merger@folds=10,"
        f"heal:merger@+{6 * TIMEOUT_S:g},heal:merger@+{4 * TIMEOUT_S:g}"
    )
    run = tmp_path / "run"
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
            "--chaos",
            schedule,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    cut, healed, _ = (e["wall"] for e in read_events(run / "chaos.jsonl"))
    standby, merger = (read_events(run / "logs" / f"{name}.log") for name in ("standby", "merger"))
    took = [wall(e) for e in standby if e.get("event") == "taking_over"]
    # one takeover, during the cut
    assert len(took) == 1 and cut < took[0] < healed
    fenced = [
        (e["event"], wall(e))
        for e in merger
        if e.get("event") in ("fenced", "stepped_down", "log_set_aside")
    ]
    assert [name for name, _ in fenced] == ["fenced", "stepped_down", "log_set_aside"] and all(
        w > healed for _, w in fenced
    )
    # Two mergers have no quorum: the old primary folds again only once it has declared itself alone
    # (two leases of silence; acks waited for the standby's disk until then), and those records are
    # set aside.
    alone = [
        wall(e)
        for e in merger
        if e.get("event") == "replication" and e.get("state") == "alone" and wall(e) > cut
    ]
    late = [wall(e) for e in merger if e.get("event") == "fold" and wall(e) > took[0]]
    assert alone and all(w >= alone[0] for w in late)
    # the new primary's log: nothing the islands counted as folded is missing from it
    _settled_once(run, wal="standby")
    assert {"a", "b"} <= _folded_islands(run, healed, float("inf"))


@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_a_standby_cut_off_from_everything_cannot_take_over_with_the_lease_in_etcd(tmp_path):
    """The partition PROTOCOL.md §12 used to lose acknowledged deltas in: the standby cut off from
    the primary *and* the broker (etcd runs beside the broker) for ~7 leases, while the primary
    reaches everyone.  With the pair's own lease the standby took over unseen, the primary went on
    alone and acknowledged folds only it held, and on healing it was fenced and set them aside
    (the islands had been told they were folded).  With the lease key in etcd the standby cannot
    claim it (etcd is out of its reach, and the primary renews it): no takeover, no fencing,
    nothing set aside; the primary folds on alone, the standby follows again once healed, and
    every delta an island counted as folded is in the primary's log once."""
    schedule = f"partition:standby@folds=10,heal:standby@+{4 * TIMEOUT_S:g},heal:standby@a.folds=+4"
    run, (cut, healed, _) = _up(tmp_path, schedule, merger='standby = true\nfailover = "etcd"\n')
    standby, merger = (read_events(run / "logs" / f"{name}.log") for name in ("standby", "merger"))
    assert not [e for e in standby if e.get("event") == "taking_over"]
    refused = [wall(e) for e in standby if e.get("event") == "takeover_refused"]
    assert refused and cut < refused[0] < healed
    assert not [e for e in merger if e.get("event") in ("fenced", "stepped_down", "log_set_aside")]
    assert not (run / "merger" / "wal" / "discarded").exists()
    # the primary went on alone meanwhile, and took its standby back after the heal
    assert any(cut < wall(e) < healed for e in merger_folds(run))
    assert any(e.get("event") == "standby_following" and wall(e) > healed for e in merger), (
        "the standby did not follow again"
    )
    _settled_once(run)
    assert {"a", "b"} <= _folded_islands(run, healed, float("inf"))


@pytest.mark.e2e
@pytest.mark.timeout(1000)
def test_a_primary_and_standby_cut_off_from_each_other_hand_nothing_over_with_the_lease_in_etcd(
    tmp_path,
):
    """The split-brain case with the lease in etcd (the default): both still reach the broker and
    etcd, so the standby's claims are refused while the primary renews the key; no takeover, no
    fencing, nothing set aside, the standby follows again once healed, and every delta an island
    counted as folded is in the primary's log once."""
    schedule = (
        f"partition-from-standby:merger@folds=10,heal:merger@+{6 * TIMEOUT_S:g},"
        "heal:merger@a.folds=+4"
    )
    run, (cut, healed, _) = _up(tmp_path, schedule, merger="standby = true\n")
    standby, merger = (read_events(run / "logs" / f"{name}.log") for name in ("standby", "merger"))
    assert not [e for e in standby if e.get("event") == "taking_over"]
    refused = [e for e in standby if e.get("event") == "takeover_refused"]
    assert refused and all(e["why"].startswith("held by") for e in refused)
    assert not [e for e in merger if e.get("event") in ("fenced", "stepped_down", "log_set_aside")]
    assert any(cut < wall(e) < healed for e in merger_folds(run))
    assert any(e.get("event") == "standby_following" and wall(e) > healed for e in merger)
    _settled_once(run)
