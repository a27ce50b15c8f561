"""The lease in etcd under `dloco up` (`[merger] failover = "etcd"`, -m e2e): etcd lost mid-run
holds the primary's acknowledgements, which resume once it is back, with nothing lost; the
primary's kill still hands the key, and the model, to the standby.  (The partition the lease in
etcd exists for is in tests/test_network_faults.py.)"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys

import pytest

from dloco.analysis.runinfo import merger_folds, read_events, wall
from dloco.merger.log.segments import read_records
from tests.test_network_faults import _settled_once
from tests.test_standby_cluster import STANDBY_PROFILE

LEASE_S = 3.0


@pytest.fixture(autouse=True)
def etcd_binary():
    if shutil.which("etcd") is None:
        if os.environ.get("DLOCO_REQUIRE_ETCD"):
            pytest.fail("etcd is required here (DLOCO_REQUIRE_ETCD) but not on PATH")
        pytest.skip("no etcd binary (Debian: apt install etcd-server)")


def _up(tmp_path, schedule: str, merger: str = "", max_steps: int = 120):
    """`dloco up` with a standby whose lease is in etcd (`merger`: more [merger] lines)."""
    (tmp_path / "c.toml").write_text(
        STANDBY_PROFILE.replace(
            "standby = true", f'standby = true\nfailover = "etcd"\n{merger}'
        ).replace("max_steps = 200", f"max_steps = {max_steps}")
    )
    run = tmp_path / "run"
    up = subprocess.run(
        [
            *(sys.executable, "-m", "dloco", "up", "--config", str(tmp_path / "c.toml")),
            *("--run-dir", str(run), "--chaos", schedule, "--status-port", "-1"),
        ],
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    return run, [e["wall"] for e in read_events(run / "chaos.jsonl")]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_etcd_lost_mid_run_holds_the_acks_until_it_is_back_and_loses_nothing(tmp_path):
    """etcd is killed -9 for 4 leases: the primary's lease stops being valid within one, every
    acknowledgement waits (no fold is announced while it is held), the standby takes nothing over;
    once etcd is back (its data kept) the lease is renewed, the acks resume and both islands are
    folded again; every delta an island counted as folded is in the primary's log once."""
    run, (killed, back) = _up(tmp_path, f"kill:etcd@folds=10,restart:etcd@+{4 * LEASE_S:g}")
    merger = read_events(run / "logs" / "merger.log")
    held = [wall(e) for e in merger if e.get("event") == "acks_held"]
    resumed = [wall(e) for e in merger if e.get("event") == "acks_resumed"]
    assert held and killed < held[0] < back, (held, killed, back)
    assert resumed and resumed[0] > back
    assert not [w for w in map(wall, merger_folds(run)) if held[0] < w < resumed[0]]
    assert any(e.get("event") == "etcd_unreachable" for e in merger)
    # its loop read the islands on while it held the acks (merger/network/backlog.py): none fell
    # silent to it (unread, its delta pipe filled, and libzmq could abort it on the reconnect)
    assert not [e for e in merger if e.get("event") == "island_gone"]
    standby = read_events(run / "logs" / "standby.log")
    assert not [e for e in standby if e.get("event") == "taking_over"]
    after = {c for e in merger_folds(run) if wall(e) > resumed[0] for c in e["contributors"]}
    assert after == {"a", "b"}
    _settled_once(run)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_primary_killed_hands_the_key_and_the_model_to_the_standby(tmp_path):
    """kill -9 of the primary: its lease lapses in etcd, the standby's claim succeeds (a first one
    may be refused while etcd still counts the lease), it takes over under the epoch it claimed,
    and the islands are folded by it; the old primary, restarted, finds the key held and follows."""
    run, (killed, _) = _up(tmp_path, "kill:merger@folds=10,restart:merger@a.step=+40")
    standby = read_events(run / "logs" / "standby.log")
    took = [e for e in standby if e.get("event") == "taking_over"]
    assert len(took) == 1 and wall(took[0]) > killed and "etcd_revision" in took[0]
    assert all(
        e.get("why", "").startswith("held by")
        for e in standby
        if e.get("event") == "takeover_refused"
    )
    folded = {c for e in merger_folds(run) if wall(e) > wall(took[0]) for c in e["contributors"]}
    assert folded == {"a", "b"}
    # its second life, once started (the run may end first), follows the new primary
    events = [e.get("event") for e in read_events(run / "logs" / "merger.log")]
    assert events.count("genesis") == 1 and "taking_over" not in events
    assert events.count("following") >= events.count("etcd")
    _settled_once(run, wal="standby")


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_two_shards_each_with_a_standby_survive_the_loss_of_shard_1s_primary_and_its_disk(
    tmp_path,
):
    """`[merger] shards = 2` with a standby each: shard 1's primary loses its machine and disk;
    standby.1 claims shard 1's key and takes over (shard 0's pair is untouched), the old primary
    comes back empty and, once started, follows it; shard 0 folds both islands after the loss and
    standby.1 both after its takeover, and every delta an island counted as folded is in its
    shard's final log once."""
    run, (lost, _) = _up(
        tmp_path,
        "lose-disk:merger.1@folds=10,restart:merger.1@a.step=+40",
        merger="shards = 2\n",
        max_steps=240,
    )
    assert [e["process"] for e in read_events(run / "chaos.jsonl")] == ["merger.1", "merger.1"]
    took = {
        name: [
            e for e in read_events(run / "logs" / f"{name}.log") if e.get("event") == "taking_over"
        ]
        for name in ("merger", "standby", "merger.1", "standby.1")
    }
    assert [name for name, events in took.items() if events] == ["standby.1"]
    assert wall(took["standby.1"][0]) > lost
    # Each life of merger.1 starts by following; only its first became the primary (genesis). Its
    # second may still be starting when the islands' work is done (it is then stopped, not failed).
    events = [e.get("event") for e in read_events(run / "logs" / "merger.1.log")]
    assert events.count("genesis") == 1 and events.count("following") >= events.count("etcd")
    # Shard 0 folds both islands after shard 1's loss (a trains 40 more steps, b until a's end);
    # shard 1's new primary folds both after its takeover, if only the deltas the islands resend
    # while they drain (the islands may finish their steps within the lease it waits out).
    since = {0: lost, 1: wall(took["standby.1"][0])}
    after = collections.defaultdict(set)
    for e in merger_folds(run):
        if wall(e) > since[e["fragment"] % 2]:
            after[e["fragment"] % 2].update(e["contributors"])
    assert after == {0: {"a", "b"}, 1: {"a", "b"}}, after
    # every acked delta in its shard's final log (shard 1's: standby.1's), once
    folded = collections.Counter(
        tuple(m)
        for name in ("merger", "standby.1")
        for _, r in read_records(run / name / "wal")
        if r.get("type") == "fold"
        for m in r["members"]
    )
    assert folded and max(folded.values()) == 1
    for island in ("a", "b"):
        done = [e for e in read_events(run / "logs" / f"{island}.log") if e.get("event") == "done"][
            -1
        ]
        acks, logged = done["acks"], sum(1 for m in folded if m[0] == island)
        assert acks.get("folded", 0) <= logged <= acks.get("folded", 0) + acks.get("unknown", 0)
