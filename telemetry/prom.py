"""Prometheus metrics: each process serves its own registry over HTTP on `--metrics-port` (off when
not given; `dloco up` and the compose file give one to every process).

A process's counters already live in its own objects (an island's last step event and link, the
merger's counters and core, the broker's per-bus counters).  They are read when a scrape comes,
by pure functions of those values (`island_families`, `merger_families`, `broker_families`), so the
training and folding loops do no extra work per step; only the histograms (a fold's staleness and
time, an fsync's time) are observed as the events happen.  Names follow Prometheus' conventions:
`dloco_<process>_...`, base units in the name (`_bytes`, `_seconds`, `_ratio`), `_total` counters.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# versions
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _Read(Collector):
    """Families computed by `read()` at each scrape."""

    def __init__(self, read: Callable[[], Iterable]) -> None:
        self.read = read

    def collect(self):
        return list(self.read())


def registry_of(read: Callable[[], Iterable]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Read(read))
    return registry


def serve(port: int, host: str, registry: CollectorRegistry):
    """Serve `registry` at http://HOST:PORT/metrics from a daemon thread; returns the server (`stop`
    it)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server


def stop(server) -> None:
    """Stop serving and release the port."""
    server.shutdown()
    server.server_close()


def _gauge(
    name: str,
    doc: str,
    value: float | None,
    labels: Mapping[str, Mapping[str, float]] | None = None,
) -> GaugeMetricFamily:
    """A gauge: one value, or one per label value (labels: {label: {label value: value}})."""
    if labels is None:
        return GaugeMetricFamily(name, doc, value=value)
    ((label, values),) = labels.items()
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, number in sorted(values.items()):
        family.add_metric([str(key)], number)
    return family


def _counter(
    name: str,
    doc: str,
    value: float | None = None,
    label: str | None = None,
    values: Mapping[str, float] | None = None,
):
    if label is None:
        return CounterMetricFamily(name, doc, value=value)
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, number in sorted((values or {}).items()):
        family.add_metric([str(key)], number)
    return family


# Over 60 lines: the island's metric families, a table read top to bottom.
def island_families(
    event: Mapping, outbox_deltas: int, received_versions: Mapping[int, int]
) -> list:
    """An island's metrics from its last step event (island/loop.py), its outbox's depth and the
    newest version of each fragment its downlink has received (adopted or not)."""
    trained = event.get("snapshot_version", [])
    families = [
        _gauge(
            "dloco_island_step", "inner steps done by this life of the island", event.get("step", 0)
        ),
        _counter(
            "dloco_island_tokens",
            "tokens trained by this life of the island",
            event.get("tokens", 0),
        ),
        _counter(
            "dloco_island_sent_bytes",
            "bytes this island put on the wire (deltas, heartbeats, requests)",
            event.get("bytes_sent", 0),
        ),
        _counter(
            "dloco_island_received_bytes",
            "bytes this island received (snapshots, acks)",
            event.get("bytes_received", 0),
        ),
        _gauge(
            "dloco_island_compute_utilization_ratio",
            "share of wall time spent in training steps",
            event.get("compute_util", 0.0),
        ),
        _gauge("dloco_island_outbox_deltas", "deltas waiting to be sent", outbox_deltas),
        _gauge(
            "dloco_island_snapshot_version",
            "the global version each fragment trains on",
            None,
            {"fragment": dict(enumerate(trained))},
        ),
        _gauge(
            "dloco_island_adoption_lag_versions",
            "versions of a fragment received but not yet adopted by the training loop",
            None,
            {
                "fragment": {
                    f: max(0, received_versions.get(f, v) - v) for f, v in enumerate(trained)
                }
            },
        ),
    ]
    if "loss" in event:
        families.append(
            _gauge("dloco_island_loss", "training loss of the last step", event["loss"])
        )
    if "eval_loss" in event:
        families.append(
            _gauge(
                "dloco_island_heldout_loss",
                "held-out loss at the last evaluation",
                event["eval_loss"],
            )
        )
    return families


def evaluator_families(last: Mapping, evaluations: int) -> list:
    """The evaluator's metrics from its last evaluation of the global model
    (island/evaluator.py)."""
    families = [
        _counter("dloco_evaluator_evaluations", "evaluations of the global model", evaluations),
        _gauge(
            "dloco_evaluator_version",
            "the global version each fragment had in the last evaluation",
            None,
            {"fragment": dict(enumerate(last.get("versions", [])))},
        ),
    ]
    if "eval_loss" in last:
        families.append(
            _gauge(
                "dloco_evaluator_heldout_loss",
                "the global model's held-out loss at the last evaluation",
                last["eval_loss"],
            )
        )
    return families


def split_counters(counters: Mapping[str, int], prefix: str) -> dict[str, int]:
    """{"merger/rejected/stale": 2, ...} with prefix "merger/rejected/" -> {"stale": 2}."""
    return {key[len(prefix) :]: value for key, value in counters.items() if key.startswith(prefix)}


def merger_families(
    counters: Mapping[str, int],
    rejected_by_core: Mapping[str, int],
    folds_by_fragment: Mapping[int, int],
    versions: list[int],
    ingest_bytes: int,
    wal_bytes: int,
) -> list:
    """The merger's metrics: `counters` is MergerService.counters ("merger/rejected/<reason>",
    "merger/delta/<status>", "merger/resend_requests", ...), `rejected_by_core` the core's delta
    rejections by reason (staleness, norm, ...)."""
    rejected = collections.Counter(split_counters(counters, "merger/rejected/"))
    rejected.update(rejected_by_core)
    return [
        _counter(
            "dloco_merger_folds",
            "folds computed and published",
            label="fragment",
            values=folds_by_fragment,
        ),
        _counter(
            "dloco_merger_rejections",
            "messages and deltas refused, by reason",
            label="reason",
            values=rejected,
        ),
        _counter(
            "dloco_merger_deltas",
            "deltas settled, by outcome",
            label="status",
            values=split_counters(counters, "merger/delta/"),
        ),
        _counter(
            "dloco_merger_resend_requests",
            "gaps in islands' streams asked for again",
            counters.get("merger/resend_requests", 0),
        ),
        _counter(
            "dloco_merger_resent_chunks",
            "chunks islands resent on request",
            counters.get("merger/resent_chunks", 0),
        ),
        _counter("dloco_merger_ingest_bytes", "bytes of islands' messages received", ingest_bytes),
        _counter("dloco_merger_wal_bytes", "bytes appended to the write-ahead log", wal_bytes),
        _gauge(
            "dloco_merger_version",
            "each fragment's global version",
            None,
            {"fragment": dict(enumerate(versions))},
        ),
    ]


REPLICATION_STATES = ("sync", "catching_up", "alone")


def replication_families(
    role: str,
    epoch: int | None,
    replication: Mapping | None,
    log_records: int,
    folds_compared: int | None = None,
) -> list:
    """A merger's place in a primary/standby pair: its role, its epoch as the primary, and the
    standby as the primary sees it (replication.ReplicationServer.snapshot()), or, on a standby,
    how many folds' digests matched the primary's."""
    families = [
        _gauge(
            "dloco_merger_role",
            "1 for the role this merger has now",
            None,
            {"role": {r: float(r == role) for r in ("primary", "standby")}},
        ),
        _gauge("dloco_merger_log_records", "records in this merger's write-ahead log", log_records),
    ]
    if epoch is not None:
        families.append(
            _gauge(
                "dloco_merger_epoch",
                "the epoch of this primary's messages (a takeover raises it)",
                epoch,
            )
        )
    if replication is not None:
        families.append(
            _gauge(
                "dloco_merger_replication",
                "the standby as this primary sees it: 1 for its state now",
                None,
                {"state": {s: float(s == replication["state"]) for s in REPLICATION_STATES}},
            )
        )
        families.append(
            _gauge(
                "dloco_merger_standby_lag_records",
                "log records the standby has not stored",
                replication["lag"],
            )
        )
        if "lease_valid" in replication:
            families.append(
                _gauge(
                    "dloco_merger_etcd_lease_valid",
                    "1 while this primary's etcd lease is valid (it acknowledges only then)",
                    float(replication["lease_valid"]),
                )
            )
    if folds_compared is not None:
        families.append(
            _counter(
                "dloco_merger_standby_folds_compared",
                "folds whose digest matched the primary's",
                folds_compared,
            )
        )
    return families


def merger_histograms(registry: CollectorRegistry) -> tuple[Histogram, Histogram, Histogram]:
    """(staleness, fold seconds, fsync seconds): observed as folds and fsyncs happen."""
    return (
        Histogram(
            "dloco_merger_fold_staleness_versions",
            "staleness of each folded delta",
            buckets=STALENESS_BUCKETS,
            registry=registry,
        ),
        Histogram(
            "dloco_merger_fold_seconds",
            "a fold's time from dispatch to published",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        ),
        Histogram(
            "dloco_merger_wal_fsync_seconds",
            "time of each fsync of the write-ahead log",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        ),
    )


def broker_families(stats: Mapping[str, Mapping]) -> list:
    """The broker's metrics from Broker.stats(): per "bus/topic" key, messages, bytes, dropped and
    refused, and the (un)subscriptions passed on; `auth_refused` connections refused by CURVE."""

    def by_bus(counts: Mapping[str, int]) -> dict[tuple[str, str], int]:
        return {
            tuple(key.split("/", 1)) if "/" in key else (key, ""): value
            for key, value in counts.items()
        }

    families = []
    for name, doc, key, second in (
        ("dloco_broker_forwarded_messages", "messages forwarded", "messages", "topic"),
        ("dloco_broker_forwarded_bytes", "bytes forwarded", "bytes", "topic"),
        (
            "dloco_broker_dropped_messages",
            "messages dropped at a full subscriber (XPUB_NODROP)",
            "dropped",
            "topic",
        ),
        (
            "dloco_broker_refused_messages",
            (
                "messages refused: the header's sender is not its key, an older epoch, "
                "an unreadable header, a subscription no subscriber of the protocol makes, "
                "a subscription past its peer's budget"
            ),
            "refused",
            "reason",
        ),
        (
            "dloco_broker_subscriptions",
            "(un)subscriptions applied and passed upstream",
            "subscriptions",
            "kind",
        ),
    ):
        family = CounterMetricFamily(name, doc, labels=["bus", second])
        for (bus, detail), value in sorted(by_bus(stats.get(key, {})).items()):
            family.add_metric([bus, detail], value)
        families.append(family)
    reopened = CounterMetricFamily(
        "dloco_broker_reopened_xpubs",
        "times a bus's XPUB was opened afresh, its subscriptions past a budget",
        labels=["bus"],
    )
    for bus, value in sorted(stats.get("reopened", {}).items()):
        reopened.add_metric([bus], value)
    families.append(reopened)
    families.append(
        _counter(
            "dloco_broker_refused_connections",
            "connections refused by CURVE (key, role, or a ban)",
            stats.get("auth_refused", 0),
        )
    )
    return families
