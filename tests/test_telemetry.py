"""Operating views, pure parts against hand-derived values: the Prometheus families each process
serves (telemetry/prom.py), the evaluator's schedule (island/evaluator.py) and the status page's
view of a run directory (cluster/status.py); then each served over a real loopback HTTP socket."""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dloco.cluster import status
from dloco.cluster.ports import free_ports
from dloco.island import evaluator
from dloco.telemetry import prom


def samples(registry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the text format, parsed back."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_island_metrics_from_its_last_event():
    event = {
        "step": 120,
        "tokens": 15360,
        "loss": 2.5,
        "eval_loss": 2.75,
        "compute_util": 0.9,
        "bytes_sent": 1000,
        "bytes_received": 4000,
        "snapshot_version": [7, 5],
    }
    got = samples(
        prom.registry_of(
            lambda: prom.island_families(event, outbox_deltas=2, received_versions={0: 9, 1: 5})
        )
    )
    assert got[("dloco_island_step", ())] == 120
    assert got[("dloco_island_tokens_total", ())] == 15360
    assert (
        got[("dloco_island_sent_bytes_total", ())] == 1000
        and got[("dloco_island_received_bytes_total", ())] == 4000
    )
    assert got[("dloco_island_heldout_loss", ())] == 2.75 and got[("dloco_island_loss", ())] == 2.5
    assert got[("dloco_island_outbox_deltas", ())] == 2
    assert got[("dloco_island_snapshot_version", (("fragment", "0"),))] == 7
    # 9 received, 7 adopted
    assert got[("dloco_island_adoption_lag_versions", (("fragment", "0"),))] == 2
    assert got[("dloco_island_adoption_lag_versions", (("fragment", "1"),))] == 0
    before_training = samples(prom.registry_of(lambda: prom.island_families({}, 0, {})))
    assert (
        before_training[("dloco_island_step", ())] == 0
        and ("dloco_island_loss", ()) not in before_training
    )


def test_merger_metrics_add_the_services_and_the_cores_rejections():
    counters = {
        "merger/rejected/checksum": 2,
        "merger/rejected/stale": 1,
        "merger/delta/folded": 9,
        "merger/delta/rejected": 3,
        "merger/resend_requests": 4,
        "merger/resent_chunks": 6,
    }
    registry = prom.registry_of(
        lambda: prom.merger_families(
            counters, {"stale": 2, "norm": 1}, {0: 5, 1: 4}, [5, 4], 123456, 789
        )
    )
    staleness, fold_seconds, _ = prom.merger_histograms(registry)
    for value in (0, 1, 1, 5):
        staleness.observe(value)
    fold_seconds.observe(0.02)
    got = samples(registry)
    # 1 by the service + 2 by the core
    assert got[("dloco_merger_rejections_total", (("reason", "stale"),))] == 3
    assert got[("dloco_merger_rejections_total", (("reason", "checksum"),))] == 2
    assert got[("dloco_merger_rejections_total", (("reason", "norm"),))] == 1
    assert got[("dloco_merger_deltas_total", (("status", "folded"),))] == 9
    assert (
        got[("dloco_merger_folds_total", (("fragment", "1"),))] == 4
        and got[("dloco_merger_version", (("fragment", "0"),))] == 5
    )
    assert (
        got[("dloco_merger_resend_requests_total", ())] == 4
        and got[("dloco_merger_resent_chunks_total", ())] == 6
    )
    assert (
        got[("dloco_merger_ingest_bytes_total", ())] == 123456
        and got[("dloco_merger_wal_bytes_total", ())] == 789
    )
    assert (
        got[("dloco_merger_fold_staleness_versions_count", ())] == 4
        and got[("dloco_merger_fold_staleness_versions_sum", ())] == 7
    )
    # 0, 1, 1
    assert got[("dloco_merger_fold_staleness_versions_bucket", (("le", "1.0"),))] == 3
    assert got[("dloco_merger_fold_seconds_bucket", (("le", "0.025"),))] == 1


def test_broker_metrics_per_bus_and_topic():
    stats = {
        "messages": {"delta/delta": 10, "snapshot/ack": 3},
        "bytes": {"delta/delta": 5000},
        "dropped": {},
        "refused": {"delta/sender_mismatch": 2},
        "auth_refused": 1,
    }
    got = samples(prom.registry_of(lambda: prom.broker_families(stats)))
    assert (
        got[("dloco_broker_forwarded_messages_total", (("bus", "delta"), ("topic", "delta")))] == 10
    )
    assert (
        got[("dloco_broker_forwarded_messages_total", (("bus", "snapshot"), ("topic", "ack")))] == 3
    )
    assert (
        got[("dloco_broker_forwarded_bytes_total", (("bus", "delta"), ("topic", "delta")))] == 5000
    )
    assert (
        got[
            (
                "dloco_broker_refused_messages_total",
                (("bus", "delta"), ("reason", "sender_mismatch")),
            )
        ]
        == 2
    )
    assert got[("dloco_broker_refused_connections_total", ())] == 1


def test_metrics_are_served_over_http():
    port = free_ports(1)[0]
    server = prom.serve(
        port,
        "127.0.0.1",
        prom.registry_of(
            lambda: prom.evaluator_families({"versions": [3, 4], "eval_loss": 2.5}, 6)
        ),
    )
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    got = {
        (s.name, tuple(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert (
        got[("dloco_evaluator_evaluations_total", ())] == 6
        and got[("dloco_evaluator_heldout_loss", ())] == 2.5
    )
    assert got[("dloco_evaluator_version", (("fragment", "1"),))] == 4


def test_the_evaluators_schedule_keeps_its_budget():
    # 0.5 s of every 10: 5 %
    assert evaluator.next_wait(0.5, every_s=10, budget=0.1) == 10
    # 2 s of every 20: 10 %
    assert evaluator.next_wait(2.0, every_s=10, budget=0.1) == 20
    assert evaluator.whole_model({0: (3, {"a": 1})}, paths={"a", "b"}) is None
    assert evaluator.whole_model({1: (2, {"b": 2}), 0: (3, {"a": 1})}, paths={"a", "b"}) == (
        [3, 2],
        {"a": 1, "b": 2},
    )
    # however the merger cuts it
    assert evaluator.whole_model({0: (3, {"a": 1, "b": 2})}, paths={"a", "b"}) == (
        [3],
        {"a": 1, "b": 2},
    )


def test_the_evaluator_evaluates_each_new_whole_model_once():
    offers = iter(
        [
            {},
            {0: (1, {"a": 1})},
            {0: (1, {"a": 1}), 1: (1, {"b": 1})},
            {0: (1, {"a": 1}), 1: (1, {"b": 1})},
            {0: (2, {"a": 2}), 1: (1, {"b": 1})},
        ]
    )
    evaluated, written, calls = [], [], [0]

    def stopped() -> bool:
        calls[0] += 1
        return calls[0] > 5

    count = evaluator.follow(
        lambda: next(offers),
        lambda params: evaluated.append(dict(params)) or {"loss": 1.5},
        written.append,
        paths={"a", "b"},
        every_s=0.0,
        budget=1.0,
        stopped=stopped,
    )
    assert count == 2 and evaluated == [{"a": 1, "b": 1}, {"a": 2, "b": 1}]
    assert [w["versions"] for w in written] == [[1, 1], [2, 1]] and written[0]["eval_loss"] == 1.5


def test_thinning_keeps_the_last_point():
    assert status.thin(list(range(5)), limit=10) == [0, 1, 2, 3, 4]
    assert status.thin(list(range(10)), limit=4) == [0, 3, 6, 9]
    assert status.thin(list(range(11)), limit=4) == [0, 3, 6, 9, 10]


def write_lines(path, events) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


# Over 60 lines: a run directory's files written by hand, one file after another.
@pytest.fixture
def run_dir(tmp_path):
    """Two islands (west restarted once), three folds, two global evaluations and a chaos event, by
    hand."""
    write_lines(
        tmp_path / "metrics" / "east.jsonl",
        [
            {"step": 0, "tokens": 0, "eval_loss": 6.0, "time": 0.0, "wall": 990.0},
            {"step": 1, "tokens": 100, "loss": 5.0, "time": 1.0, "wall": 1000.0},
            {
                "step": 2,
                "tokens": 200,
                "loss": 4.0,
                "eval_loss": 4.5,
                "time": 2.0,
                "wall": 1010.0,
                "compute_util": 0.8,
                "snapshot_version": [2, 1],
                "bytes_sent": 10,
                "bytes_received": 20,
            },
            {
                "step": 1,
                "tokens": 100,
                "time": 1.0,
                "wall": 1005.0,
                "eval_loss": 9.0,
                "deferred": True,
            },
        ],
    )
    write_lines(
        tmp_path / "metrics" / "west.jsonl",
        [
            {"step": 0, "tokens": 0, "eval_loss": 6.0, "time": 0.0, "wall": 995.0},
            {"step": 1, "tokens": 50, "time": 1.0, "wall": 1002.0},
            # restarted
            {"step": 0, "tokens": 0, "eval_loss": 5.5, "time": 0.0, "wall": 1003.0},
            {"step": 1, "tokens": 50, "time": 1.0, "wall": 1006.0, "loss": float("nan")},
        ],
    )
    # 1001, 1005, 1008 s
    stamps = ["1970-01-01T00:16:41Z", "1970-01-01T00:16:45Z", "1970-01-01T00:16:48Z"]
    write_lines(
        tmp_path / "logs" / "merger.log",
        [
            {
                "event": "fold",
                "timestamp": t,
                "fragment": i % 2,
                "version": 1 + i // 2,
                "contributors": ["east"],
                "staleness": [0],
                "weights": [0.5],
            }
            for i, t in enumerate(stamps)
        ]
        + [{"event": "checkpoint"}],
    )
    write_lines(
        tmp_path / "global.jsonl",
        [
            {"wall": 999.0, "versions": [0, 0], "eval_loss": 6.0},
            {"wall": 1007.0, "versions": [2, 1], "eval_loss": 4.9},
        ],
    )
    write_lines(
        tmp_path / "chaos.jsonl",
        [{"at_s": 3.0, "wall": 1002.5, "action": "kill", "target": "west"}],
    )
    return tmp_path


def test_the_status_view_of_a_run_directory(run_dir):
    files = status.RunFiles(run_dir, ["east", "west"])
    files.update()
    state = status.finite(files.state(now=1012.0))
    # since the first step: east's at 1000
    assert state["elapsed_s"] == 12.0
    east, west = state["islands"]
    assert (
        east["step"] == 2
        and east["tokens_per_s"] == 100
        and east["eval_loss"] == 4.5
        and east["last_seen_s"] == 2.0
    )
    assert east["versions"] == [2, 1] and east["bytes_received"] == 20
    # its second life's
    assert west["step"] == 1 and west["eval_loss"] == 5.5
    assert state["curves"]["east"] == [
        {"t": -10.0, "tokens": 0, "loss": 6.0},
        {"t": 10.0, "tokens": 200, "loss": 4.5},
    ]
    # the whole cluster's tokens at 1007: east 100 (step 1 at 1000) + west 50 (first life) + 50
    # (second life, step 1 at 1006)
    assert state["global"][1] == {"t": 7.0, "tokens": 200, "loss": 4.9, "versions": [2, 1]}
    # newest first
    assert state["fold_count"] == 3 and [f["t"] for f in state["folds"]] == [8.0, 5.0, 1.0]
    assert state["chaos"] == [{"t": 2.5, "action": "kill", "target": "west"}]
    write_lines(
        run_dir / "global.jsonl",
        [
            {"wall": 999.0, "versions": [0, 0], "eval_loss": 6.0},
            {"wall": 1007.0, "versions": [2, 1], "eval_loss": 4.9},
            {"wall": 1011.0, "versions": [3, 2], "eval_loss": 4.2},
        ],
    )
    # only the new line is read
    files.update()
    assert [p["loss"] for p in files.state(now=1012.0)["global"]] == [6.0, 4.9, 4.2]


def test_finite_replaces_what_json_cannot_hold():
    assert status.finite({"a": [1.0, math.nan, {"b": math.inf}], "c": "x"}) == {
        "a": [1.0, None, {"b": None}],
        "c": "x",
    }


def test_the_page_and_its_state_over_http(run_dir):
    server = status.serve(run_dir, ["east", "west"])
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(base + "/", timeout=10) as response:
            page = response.read().decode()
        with urllib.request.urlopen(base + "/api/state", timeout=10) as response:
            state = json.loads(response.read())
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(base + "/elsewhere", timeout=10)
    finally:
        server.shutdown()
    # nothing fetched from elsewhere
    assert "<script>" in page and "http://" not in page.replace('"http://www.w3.org/2000/svg"', "")
    assert [i["name"] for i in state["islands"]] == ["east", "west"] and len(state["global"]) == 2
