"""ZeroMQ's socket monitors, read on a thread of their own.

`SocketMonitor` is the thread: `watch(socket, label)` (from the thread that owns the socket) adds a
socket's monitor, and each event reaches `on_event(label, event)`.  Two uses:
- `LinkWatcher`: a connecting socket's connections coming up (the ZMTP handshake done) and going
  down, counted.  Down covers a reset peer and a half-open link: a partition drops packets without a
  reset, TCP still calls the connection established, and only the ZMTP heartbeats
  (bus/sockets.py) notice; ZeroMQ then disconnects and reconnects by itself.
- bus/zap.py's HandshakeWatcher: handshakes refused before authentication.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message


class SocketMonitor:
    """Reads the monitors of the sockets `watch` was given, on a daemon thread, until `stop`."""

    def __init__(self, events: int, name: str) -> None:
        self.events = events
        self.monitors: list[tuple[zmq.Socket, str]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def watch(self, socket: zmq.Socket, label: str = "") -> None:
        """Monitor `socket`; call from the thread that owns it."""
        monitor = socket.get_monitor_socket(self.events)
        with self.lock:
            self.monitors.append((monitor, label))

    def on_event(self, label: str, event: dict) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                monitors = dict(self.monitors)
            poller = zmq.Poller()
            for monitor in monitors:
                poller.register(monitor, zmq.POLLIN)
            try:
                ready = poller.poll(100) if monitors else []
            # the context is going away
            except zmq.ZMQError:
                return
            for monitor, _ in ready:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    continue
                # closed under us: stopping
                except zmq.ZMQError:
                    return
                # a monitor message this pyzmq cannot parse
                except ValueError as error:
                    event = {"unparsed": str(error)}
                self.on_event(monitors[monitor], event)
            if not monitors:
                self.stopping.wait(0.1)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        with self.lock:
            for monitor, _ in self.monitors:
                monitor.close(linger=0)


class LinkWatcher(SocketMonitor):
    """Per label, the connections that came up and went down.  `report(event, label, endpoint)`
    hears each change: `link_up` or `link_down`.  Also counted: TCP connections made (`reached`:
    the peer's port answered) and handshakes the peer refused (`refused`: CURVE keys it does not
    admit), which tell a host that cannot reach the hub from one the hub turns away."""

    REFUSALS = (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | REFUSALS

    def __init__(
        self, report: Callable[[str, str, str], None] = lambda event, label, endpoint: None
    ) -> None:
        self.report = report
        self.up: collections.Counter[str] = collections.Counter()
        self.down: collections.Counter[str] = collections.Counter()
        self.reached: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        super().__init__(self.EVENTS, "link-watcher")

    def on_event(self, label: str, event: dict) -> None:
        kind = event.get("event")
        endpoint = bytes(event.get("endpoint", b"")).decode("ascii", "replace")
        if kind == zmq.EVENT_CONNECTED or (kind is not None and kind & self.REFUSALS):
            with self.lock:
                (self.reached if kind == zmq.EVENT_CONNECTED else self.refused)[label] += 1
            return
        if kind not in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
            return
        # also called by an island's pairs of merger links (island/mergers.py), on its thread
        with self.lock:
            (self.up if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED else self.down)[label] += 1
            self.report(
                "link_up" if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED else "link_down", label, endpoint
            )

    def summary(self) -> dict[str, dict[str, int]]:
        """{label: {"up": n, "down": n}} for every label seen."""
        with self.lock:
            return {
                label: {"up": self.up[label], "down": self.down[label]}
                for label in sorted(self.up.keys() | self.down.keys())
            }
