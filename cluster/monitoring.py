"""The compose file's `monitoring` profile: Prometheus scraping every dloco service, and Grafana
with a provisioned data source and dashboard.  Pure: ports in, compose services and configs out.

Everything is inline (compose `configs` with `content`), so the one rendered file is the whole
setup: `docker compose --profile monitoring up`.  The dashboard's queries use the metric names
of telemetry/prom.py; a test checks that each one is a name those families produce.
"""

from __future__ import annotations

import json

import yaml

PROMETHEUS_IMAGE = "prom/prometheus:v2.53.0"
GRAFANA_IMAGE = "grafana/grafana:11.1.0"
DATASOURCE_UID = "dloco-prometheus"
SCRAPE_INTERVAL = "5s"


def prometheus_config(targets: dict[str, str]) -> str:
    """One scrape job per service: {service: "host:port"}."""
    jobs = [
        {"job_name": name, "static_configs": [{"targets": [target], "labels": {"service": name}}]}
        for name, target in targets.items()
    ]
    return yaml.safe_dump(
        {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": jobs}, sort_keys=False
    )


def _panel(index: int, title: str, exprs: list[tuple[str, str]], unit: str = "short") -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": DATASOURCE_UID},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": DATASOURCE_UID},
            }
            for i, (expr, legend) in enumerate(exprs)
        ],
    }


PANELS = [
    (
        "Held-out loss: islands and the global model",
        [
            ("dloco_island_heldout_loss", "{{service}}"),
            ("dloco_evaluator_heldout_loss", "global model"),
        ],
        "short",
    ),
    ("Tokens per second", [("rate(dloco_island_tokens_total[1m])", "{{service}}")], "short"),
    (
        "Compute utilisation",
        [("dloco_island_compute_utilization_ratio", "{{service}}")],
        "percentunit",
    ),
    ("Island step", [("dloco_island_step", "{{service}}")], "short"),
    (
        "Bytes per second on the wire",
        [
            ("rate(dloco_island_sent_bytes_total[1m])", "{{service}} up"),
            ("rate(dloco_island_received_bytes_total[1m])", "{{service}} down"),
        ],
        "Bps",
    ),
    (
        "Snapshot versions: merger and islands",
        [
            ("dloco_merger_version", "merger fragment {{fragment}}"),
            ("dloco_island_snapshot_version", "{{service}} fragment {{fragment}}"),
        ],
        "short",
    ),
    (
        "Folds per second",
        [("sum by (fragment) (rate(dloco_merger_folds_total[1m]))", "fragment {{fragment}}")],
        "short",
    ),
    (
        "Rejections per second by reason",
        [("sum by (reason) (rate(dloco_merger_rejections_total[1m]))", "{{reason}}")],
        "short",
    ),
    (
        "Staleness of folded deltas (p50, p95)",
        [
            (
                "histogram_quantile(0.5, rate(dloco_merger_fold_staleness_versions_bucket[1m]))",
                "p50",
            ),
            (
                "histogram_quantile(0.95, rate(dloco_merger_fold_staleness_versions_bucket[1m]))",
                "p95",
            ),
        ],
        "short",
    ),
    (
        "Fold time (p50, p95)",
        [
            ("histogram_quantile(0.5, rate(dloco_merger_fold_seconds_bucket[1m]))", "p50"),
            ("histogram_quantile(0.95, rate(dloco_merger_fold_seconds_bucket[1m]))", "p95"),
        ],
        "s",
    ),
    (
        "Write-ahead log: bytes per second and fsync p95",
        [
            ("rate(dloco_merger_wal_bytes_total[1m])", "bytes/s"),
            (
                "histogram_quantile(0.95, rate(dloco_merger_wal_fsync_seconds_bucket[1m]))",
                "fsync p95 (s)",
            ),
        ],
        "short",
    ),
    (
        "Broker: bytes forwarded per second",
        [
            (
                "sum by (bus, topic) (rate(dloco_broker_forwarded_bytes_total[1m]))",
                "{{bus}}/{{topic}}",
            )
        ],
        "Bps",
    ),
    (
        "Broker: drops, refusals, resends",
        [
            ("sum(rate(dloco_broker_dropped_messages_total[1m]))", "dropped"),
            ("sum(rate(dloco_broker_refused_messages_total[1m]))", "refused"),
            ("rate(dloco_merger_resend_requests_total[1m])", "resend requests"),
        ],
        "short",
    ),
    (
        "Island outbox and adoption lag",
        [
            ("dloco_island_outbox_deltas", "{{service}} outbox"),
            ("max by (service) (dloco_island_adoption_lag_versions)", "{{service}} adoption lag"),
        ],
        "short",
    ),
]


def dashboard() -> dict:
    return {
        "uid": "dloco",
        "title": "dloco",
        "schemaVersion": 39,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "panels": [_panel(i, title, exprs, unit) for i, (title, exprs, unit) in enumerate(PANELS)],
    }


def dashboard_json() -> str:
    """The dashboard as JSON, one panel per line."""
    board = dashboard()
    panels = ",\n".join("  " + json.dumps(panel) for panel in board.pop("panels"))
    return json.dumps(board)[:-1] + ',\n "panels": [\n' + panels + "\n ]}\n"


def render(targets: dict[str, str], prometheus_port: str, grafana_port: str) -> tuple[dict, dict]:
    """(services, configs) of the monitoring profile for the compose file."""
    datasource = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "Prometheus",
                "type": "prometheus",
                "uid": DATASOURCE_UID,
                "access": "proxy",
                "url": "http://prometheus:9090",
                "isDefault": True,
            }
        ],
    }
    provider = {
        "apiVersion": 1,
        "providers": [
            {"name": "dloco", "type": "file", "options": {"path": "/var/lib/grafana/dashboards"}}
        ],
    }
    configs = {
        "prometheus": {"content": prometheus_config(targets)},
        "grafana-datasource": {"content": yaml.safe_dump(datasource, sort_keys=False)},
        "grafana-dashboards": {"content": yaml.safe_dump(provider, sort_keys=False)},
        "grafana-dashboard": {"content": dashboard_json()},
    }
    services = {
        "prometheus": {
            "image": PROMETHEUS_IMAGE,
            "profiles": ["monitoring"],
            "ports": [f"{prometheus_port}:9090"],
            "configs": [{"source": "prometheus", "target": "/etc/prometheus/prometheus.yml"}],
        },
        "grafana": {
            "image": GRAFANA_IMAGE,
            "profiles": ["monitoring"],
            "ports": [f"{grafana_port}:3000"],
            "depends_on": ["prometheus"],
            "environment": {
                "GF_AUTH_ANONYMOUS_ENABLED": "true",
                "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
            },
            "configs": [
                {
                    "source": "grafana-datasource",
                    "target": "/etc/grafana/provisioning/datasources/dloco.yml",
                },
                {
                    "source": "grafana-dashboards",
                    "target": "/etc/grafana/provisioning/dashboards/dloco.yml",
                },
                {"source": "grafana-dashboard", "target": "/var/lib/grafana/dashboards/dloco.json"},
            ],
        },
    }
    return services, configs
