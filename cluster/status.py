"""The live status page: `dloco up` serves it while the cluster runs, `dloco status RUN_DIR` for any
run directory, at http://127.0.0.1:PORT/.

The page (cluster/static/status.html: HTML, CSS and script in one file, nothing fetched from
elsewhere) polls `/api/state`, a JSON view of the run directory: the islands' metrics, the
merger's fold log lines, the evaluator's global-model evaluations (global.jsonl) and the chaos
events.  `RunFiles` reads each file incrementally (only the bytes added since the last poll), so a
long run costs the same per refresh as a short one.
"""

from __future__ import annotations

import bisect
import http.server
import json
import threading
import time
from importlib import resources
from pathlib import Path

from dloco.analysis.runinfo import JsonTail, merger_logs, wall

RECENT_FOLDS = 12
# a curve longer than this is thinned to it (every k-th point, the last kept)
CURVE_POINTS = 400


def thin(points: list, limit: int = CURVE_POINTS) -> list:
    """At most about `limit` points: every k-th, and always the last."""
    if len(points) <= limit:
        return points
    step = -(-len(points) // limit)
    return points[::step] + ([points[-1]] if (len(points) - 1) % step else [])


class RunFiles:
    """What the page shows, kept up to date from the run directory's files."""

    def __init__(self, run_dir: Path, regions: list[str]) -> None:
        self.run_dir, self.regions = Path(run_dir), list(regions)
        self.islands = {
            name: JsonTail(self.run_dir / "metrics" / f"{name}.jsonl") for name in regions
        }
        # with a standby, either may fold; with shards, each does
        self.mergers: dict[str, JsonTail] = {}
        self.global_file = JsonTail(self.run_dir / "global.jsonl")
        self.chaos_file = JsonTail(self.run_dir / "chaos.jsonl")
        # each island's lives (a restart starts one at its step-0 evaluation): (walls, tokens) of
        # every step
        self.lives: dict[str, list[tuple[list[float], list[int]]]] = {name: [] for name in regions}
        # the cluster's first step (wall)
        self.began = float("inf")
        self.last: dict[str, dict] = {name: {} for name in regions}
        self.evals: dict[str, list[dict]] = {name: [] for name in regions}
        self.folds: list[dict] = []
        self.fold_count = 0
        self.global_evals: list[dict] = []
        self.chaos: list[dict] = []
        self.lock = threading.Lock()

    def update(self) -> None:
        with self.lock:
            for name, source in self.islands.items():
                for event in source.new():
                    if event.get("deferred") or "step" not in event:
                        continue
                    if event["step"] == 0 or not self.lives[name]:
                        self.lives[name].append(([], []))
                    walls, tokens = self.lives[name][-1]
                    walls.append(event.get("wall", 0.0))
                    tokens.append(event.get("tokens", 0))
                    if event["step"] > 0:
                        self.began = min(self.began, walls[-1])
                    self.last[name] = event
                    if "eval_loss" in event:
                        self.evals[name].append(
                            {
                                "wall": event.get("wall", 0.0),
                                "tokens": event.get("tokens", 0),
                                "loss": event["eval_loss"],
                            }
                        )
            for name in merger_logs(self.run_dir):
                self.mergers.setdefault(name, JsonTail(self.run_dir / "logs" / name))
            for event in sorted(
                (e for log in self.mergers.values() for e in log.new()),
                key=lambda e: e.get("timestamp", ""),
            ):
                if event.get("event") == "fold":
                    self.fold_count += 1
                    self.folds = (self.folds + [event])[-RECENT_FOLDS:]
            self.global_evals += [
                e for e in self.global_file.new() if "eval_loss" in e and "wall" in e
            ]
            self.chaos += self.chaos_file.new()

    def cluster_tokens_at(self, at: float) -> int:
        """Tokens the whole cluster had trained by wall time `at`
        (analysis.globalmodel.cluster_tokens_at, by bisection in each life: a poll costs the same
        however long the run)."""
        total = 0
        for runs in self.lives.values():
            for walls, tokens in runs:
                if i := bisect.bisect_right(walls, at):
                    total += tokens[i - 1]
        return total

    def state(self, now: float | None = None) -> dict:
        """The page's data; times in seconds since the cluster's first step (wall clock)."""
        now = time.time() if now is None else now
        with self.lock:
            began = self.began if self.began < float("inf") else now
            curves = {
                name: thin(
                    [
                        {"t": e["wall"] - began, "tokens": e["tokens"], "loss": e["loss"]}
                        for e in evals
                    ]
                )
                for name, evals in self.evals.items()
            }
            global_curve = [
                {
                    "t": e["wall"] - began,
                    "tokens": self.cluster_tokens_at(e["wall"]),
                    "loss": e["eval_loss"],
                    "versions": e.get("versions"),
                }
                for e in thin(self.global_evals)
            ]
            folds = [
                {
                    "t": wall(e) - began,
                    "fragment": e.get("fragment"),
                    "version": e.get("version"),
                    "contributors": e.get("contributors", []),
                    "staleness": e.get("staleness", []),
                    "weights": e.get("weights", []),
                }
                for e in reversed(self.folds)
            ]
            chaos = [
                {
                    "t": e.get("wall", began) - began,
                    "action": e.get("action"),
                    "target": e.get("target"),
                }
                for e in self.chaos
            ]
            return {
                "run_dir": str(self.run_dir),
                "elapsed_s": now - began,
                "metrics": self.metric_endpoints(),
                "islands": [self.island(name, now) for name in self.regions],
                "folds": folds,
                "fold_count": self.fold_count,
                "curves": curves,
                "global": global_curve,
                "chaos": chaos,
            }

    def island(self, name: str, now: float) -> dict:
        """An island's row of the page: its last metrics and evaluation (under the lock)."""
        last = self.last[name]
        seconds = last.get("time") or 0.0
        return {
            "name": name,
            "step": last.get("step"),
            "tokens": last.get("tokens"),
            "tokens_per_s": last.get("tokens", 0) / seconds if seconds > 0 else None,
            "compute_util": last.get("compute_util"),
            "eval_loss": self.evals[name][-1]["loss"] if self.evals[name] else None,
            "last_seen_s": now - last["wall"] if "wall" in last else None,
            "versions": last.get("snapshot_version", []),
            "bytes_sent": last.get("bytes_sent"),
            "bytes_received": last.get("bytes_received"),
        }

    def metric_endpoints(self) -> dict:
        """Where each process serves its Prometheus metrics (the run directory's endpoints.json;
        none without it)."""
        try:
            return json.loads((self.run_dir / "endpoints.json").read_text()).get("metrics", {})
        except (OSError, ValueError):
            return {}


def finite(value):
    """`value` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def page() -> bytes:
    return resources.files("dloco.cluster").joinpath("static/status.html").read_bytes()


class _Handler(http.server.BaseHTTPRequestHandler):
    # set on the class made per server
    files: RunFiles

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        path = self.path.split("?", 1)[0]
        if path == "/":
            body, kind = page(), "text/html; charset=utf-8"
        elif path == "/api/state":
            self.files.update()
            body, kind = (
                json.dumps(finite(self.files.state()), allow_nan=False, default=str).encode(),
                "application/json",
            )
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    # requests are not the run's log
    def log_message(self, *args) -> None:
        pass


def serve(
    run_dir: Path, regions: list[str], port: int = 0, host: str = "127.0.0.1"
) -> http.server.ThreadingHTTPServer:
    """Serve the page from a daemon thread; `server.server_address` tells the port (0: any free
    one)."""
    handler = type("StatusHandler", (_Handler,), {"files": RunFiles(run_dir, regions)})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="status-page", daemon=True).start()
    return server
