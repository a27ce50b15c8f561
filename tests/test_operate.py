"""Operating a running cluster, end to end: every process's Prometheus metrics scraped and parsed
with prometheus_client's own parser, the evaluator's global-model curve, and the status page
rendered by headless Chromium (Debian's `chromium`), with a screenshot kept in the run directory.

Bounded by work: the checks wait (up to a generous limit) for steps, folds and evaluations to have
happened, never for a number of seconds.  Chromium is opt-in where it is absent; with
DLOCO_REQUIRE_BROWSER set (.ci/run, which installs it) its absence is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dloco.analysis.runinfo import read_events
from dloco.cluster import status
from dloco.cluster.launcher import EXIT_INTERRUPTED
from tests.cluster_helpers import small_profile

pytestmark = pytest.mark.e2e
REGIONS = '[[regions]]\nname = "east"\n[[regions]]\nname = "west"\nslowdown = 2.0\n'
# how long the cluster may take to reach each point, on a busy machine
LIMIT_S = 400


def wait_for(what: str, check, limit_s: float = LIMIT_S):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.5)
    raise AssertionError(f"not reached within {limit_s} s: {what}")


def scrape(url: str) -> dict[str, list]:
    """Metric family name -> samples, parsed by prometheus_client from the text format."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def scraped(url: str) -> dict[str, list]:
    """`scrape`, or {} while the process is not serving yet (it starts after the file naming its
    port)."""
    try:
        return scrape(url)
    except OSError:
        return {}


def total(families: dict, name: str) -> float:
    return sum(
        sample.value
        for sample in families.get(name, [])
        if not sample.name.endswith(("_created", "_bucket"))
    )


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(browser: str, url: str, *extra: str) -> str:
    """The DOM after the page's scripts ran for 5 s of virtual time (its 2 s refresh fires
    twice)."""
    result = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=5000",
            *extra,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("operate")
    (base / "cluster.toml").write_text(small_profile(900, 20, REGIONS, max_steps=100_000))
    run_dir = base / "run"
    log = open(base / "up.log", "w")
    # Logs rotated every 16 KiB (telemetry/logs.py), so the page and the report read across
    # rotations.
    env = {**os.environ, "DLOCO_LOG_MAX_BYTES": str(16 << 10), "DLOCO_LOG_KEEP": "1000"}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(base / "cluster.toml"),
            "--run-dir",
            str(run_dir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        page = wait_for(
            "the status page's address",
            lambda: re.search(r"status page at (\S+)", (base / "up.log").read_text()),
        )
        yield run_dir, page.group(1), up
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        log.close()


def test_every_process_serves_parseable_metrics(cluster):
    run_dir, _, _ = cluster
    endpoints = wait_for(
        "endpoints.json",
        lambda: (
            (run_dir / "endpoints.json").exists()
            and json.loads((run_dir / "endpoints.json").read_text())
        ),
    )
    assert set(endpoints["metrics"]) == {"broker", "merger", "evaluator", "east", "west"}
    urls = endpoints["metrics"]
    wait_for(
        "both islands at step 30",
        lambda: all(
            total(scraped(urls[name]), "dloco_island_step") >= 30 for name in ("east", "west")
        ),
    )
    wait_for(
        "folds of both fragments",
        lambda: len(scraped(urls["merger"]).get("dloco_merger_folds", [])) >= 2,
    )
    wait_for(
        "an evaluation of a folded global model",
        lambda: any(
            s.value > 0 for s in scraped(urls["evaluator"]).get("dloco_evaluator_version", [])
        ),
    )
    island, merger, broker = scrape(urls["east"]), scrape(urls["merger"]), scrape(urls["broker"])
    assert total(island, "dloco_island_tokens") > 0 and total(island, "dloco_island_sent_bytes") > 0
    assert {s.labels["fragment"] for s in island["dloco_island_snapshot_version"]} == {"0", "1"}
    assert 0 < total(island, "dloco_island_compute_utilization_ratio") <= 1
    assert "dloco_island_heldout_loss" in island
    assert (
        total(merger, "dloco_merger_folds") >= 2
        and total(merger, "dloco_merger_wal_bytes") > 0
        and total(merger, "dloco_merger_ingest_bytes") > 0
    )
    count = [s for s in merger["dloco_merger_fold_staleness_versions"] if s.name.endswith("_count")]
    assert count and count[0].value >= 2
    forwarded = {
        (s.labels["bus"], s.labels["topic"]): s.value
        for s in broker["dloco_broker_forwarded_messages"]
    }
    assert (
        forwarded.get(("delta", "delta"), 0) > 0 and forwarded.get(("snapshot", "snapshot"), 0) > 0
    )
    assert total(broker, "dloco_broker_refused_connections") == 0


def test_status_page_in_headless_chromium(cluster):
    run_dir, url, _ = cluster
    browser = chromium()
    if browser is None:
        if os.environ.get("DLOCO_REQUIRE_BROWSER"):
            pytest.fail(
                "DLOCO_REQUIRE_BROWSER is set (.ci/run installs chromium): the status page must be"
                " checked in a real browser"
            )
        pytest.skip("no chromium on this machine (apt install chromium)")
    state = wait_for(
        "a global-model evaluation after a fold and island evaluations",
        lambda: (
            (s := get_json(url + "api/state"))["global"]
            and any(p["versions"] and max(p["versions"]) > 0 for p in s["global"])
            and all(s["curves"][name] for name in ("east", "west"))
            and s
        ),
    )
    first = render(browser, url, "--dump-dom")
    for name in ("east", "west"):
        assert re.search(rf'<tr data-region="{name}">', first), name
    for name in ("east", "west", "global model"):
        match = re.search(rf'<polyline[^>]*data-name="{name}"[^>]*data-points="(\d+)"', first)
        assert match and int(match.group(1)) >= 1, f"no {name} curve in the chart"
    refreshes = int(re.search(r'<span id="refreshes">(\d+)</span>', first).group(1))
    assert refreshes >= 2, "the page did not refresh itself"
    step = int(
        re.search(r'<tr data-region="east"><td>east</td><td class="step">(\d+)</td>', first).group(
            1
        )
    )
    wait_for(
        "the east island 20 steps further",
        lambda: get_json(url + "api/state")["islands"][0]["step"] >= step + 20,
    )
    second = render(browser, url, "--dump-dom")
    assert (
        int(
            re.search(
                r'<tr data-region="east"><td>east</td><td class="step">(\d+)</td>', second
            ).group(1)
        )
        >= step + 20
    )
    screenshot = run_dir / "status.png"
    render(browser, url, f"--screenshot={screenshot}", "--window-size=1200,1400")
    assert (
        screenshot.stat().st_size > 10_000 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    )
    assert state["fold_count"] >= 1 and state["folds"]


def test_report_plots_the_global_model(cluster):
    run_dir, _, up = cluster
    # read as the page reads, while the logs rotate
    live = status.RunFiles(run_dir, ["east", "west"])
    merger_log = run_dir / "logs" / "merger.log"
    began = merger_log.stat().st_ino

    def ready() -> bool:
        live.update()
        evaluations = (
            len((run_dir / "global.jsonl").read_bytes().splitlines())
            if (run_dir / "global.jsonl").exists()
            else 0
        )
        try:
            rotated = merger_log.stat().st_ino != began
        # between a rotation's rename and its new file
        except FileNotFoundError:
            rotated = False
        return evaluations >= 2 and rotated

    wait_for("two evaluations of the global model, and a rotation of the merger's log", ready)
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=300) == EXIT_INTERRUPTED
    report = (run_dir / "report.md").read_text()
    assert (
        "plots/global_loss_vs_cluster_tokens.png" in report
        and (run_dir / "plots" / "global_loss_vs_cluster_tokens.png").stat().st_size > 0
    )
    assert re.search(r"The global model during the run: \d+ evaluations", report)
    # The merger's log was rotated, and no fold line was lost to it: each fragment's versions run
    # 1, 2, ... across the segments, and the page's reader, which followed the rotations, counts
    # them all.
    assert (run_dir / "logs" / "merger.log.1").exists()
    folds = [e for e in read_events(run_dir / "logs" / "merger.log") if e.get("event") == "fold"]
    for fragment in (0, 1):
        versions = [e["version"] for e in folds if e["fragment"] == fragment]
        assert versions == list(range(1, len(versions) + 1)), (fragment, versions)
    live.update()
    assert live.fold_count == len(folds) > 0
