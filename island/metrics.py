"""Metrics as JSON lines, written from their own thread so the training loop never waits on disk."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        self.written = 0
        # each key's last value (Prometheus reads it: telemetry/prom.py)
        self.latest: dict = {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._drain, name="metrics", daemon=True)
            self._thread.start()

    def write(self, event: dict) -> None:
        self.written += 1
        # (a trace's evaluation after training is of an earlier step)
        if not event.get("deferred"):
            self.latest = {**self.latest, **event}
        if self._thread is not None:
            self._queue.put(event)

    def _drain(self) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            while (event := self._queue.get()) is not None:
                handle.write(json.dumps(event) + "\n")
                if self._queue.empty():
                    handle.flush()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None
