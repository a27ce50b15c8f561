"""A merger as a real process on loopback and a test-side island that speaks the stream protocol
to it: start and stop the merger, send deltas until they are settled, answer resend requests.  And
a merger binding its own sockets (no broker) for real island processes to connect to."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from dloco import protocol
from dloco.cluster.ports import free_ports
from tests.merger_helpers import delta_chunks, initial_params

ACK_TIMEOUT_S = 30.0


def free_port() -> int:
    return free_ports(1)[0]


class Island:
    """Test-side island speaking the stream protocol: contiguous seqs, heartbeats, resends on
    request (from an unbounded record of what it sent), and repeats a delta until it is settled.
    `name`: its sender name; `beside`: another test island whose delta bus and merger it shares."""

    def __init__(self, tmp: Path, name: str = "a", beside: Island | None = None) -> None:
        self.name, self.context = name, zmq.Context()
        if beside is None:
            self.pub = self.context.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.delta_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.snapshot_port, self.control_port = free_ports(2)
        else:
            self.pub, self.delta_port = beside.pub, beside.delta_port
            self.snapshot_port, self.control_port = beside.snapshot_port, beside.control_port
        self.versions = [0, 0]
        self.epoch, self.seq, self.sent, self.by_delta = 1, 0, {}, {}
        # times send_until_settled has sent its delta
        self.rounds = 0
        self.sub = self.dealer = None

    def connect(self) -> None:
        for socket in (self.sub, self.dealer):
            if socket is not None:
                socket.close(linger=0)
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"ack")
        self.sub.connect(f"tcp://127.0.0.1:{self.snapshot_port}")
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, self.name.encode())
        self.dealer.connect(f"tcp://127.0.0.1:{self.control_port}")

    def frames_of(self, chunks) -> list[list]:
        frames = []
        for chunk in chunks:
            self.seq += 1
            self.sent[self.seq] = protocol.encode(
                dataclasses.replace(chunk, seq=self.seq, epoch=self.epoch)
            )
            frames.append(self.sent[self.seq])
        return frames

    def send_until_settled(
        self, delta_id: int, frames, deadline_s: float = ACK_TIMEOUT_S
    ) -> protocol.DeltaResult:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for f in frames:
                self.pub.send_multipart(f)
            self.pub.send_multipart(
                protocol.encode(
                    protocol.Heartbeat(sender=self.name, epoch=self.epoch, seq=self.seq)
                )
            )
            self.rounds += 1
            until = time.monotonic() + 0.3
            while (left := until - time.monotonic()) > 0:
                events = dict(zmq.Poller.poll(self._poller(), int(left * 1000) + 1))
                if self.dealer in events:
                    request = protocol.decode(self.dealer.recv_multipart())
                    for first, last in request.ranges:
                        for seq in range(first, last + 1):
                            self.dealer.send_multipart(self.sent[seq])
                if self.sub in events:
                    ack = protocol.decode(self.sub.recv_multipart())
                    for result in ack.results:
                        if result.island == self.name and result.delta_id == delta_id:
                            if result.status == "folded":
                                self.versions[result.fragment] = result.version
                            return result
        raise TimeoutError(f"delta {delta_id} was not settled within {deadline_s} s")

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        return poller

    def chunks(self, delta_id: int):
        fragment = delta_id % 2
        self.by_delta[delta_id] = self.frames_of(
            delta_chunks(
                PARTS[fragment],
                self.name,
                delta_id,
                fragment,
                self.versions[fragment],
                seed=delta_id,
            )
        )
        return self.by_delta[delta_id]

    def sent_frames_of(self, delta_id: int):
        return self.by_delta[delta_id]

    def close(self) -> None:
        self.context.destroy(linger=0)


PARAMS = initial_params()


PARTS = protocol.partition({p: a.shape for p, a in PARAMS.items()}, 2)


def start_merger(run_dir: Path, island: Island, init: Path | None, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "dloco",
        "merger",
        "--run-dir",
        str(run_dir),
        "--fragments",
        "2",
        "--delta-endpoint",
        f"tcp://127.0.0.1:{island.delta_port}",
        "--snapshot-endpoint",
        f"@tcp://127.0.0.1:{island.snapshot_port}",
        "--control-endpoint",
        f"@tcp://127.0.0.1:{island.control_port}",
        "--checkpoint-every",
        "3",
        "--fsync",
        "always",
        "--max-staleness",
        "3",
        "--insecure",
        *extra,
    ]
    if init is not None:
        args += ["--init-npz", str(init)]
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    island.connect()
    return process


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def start_bound_merger(
    tmp_path: Path, init: Path, ports: list[int], *extra: str
) -> subprocess.Popen:
    """A merger of two fragments from `init` that binds its delta, snapshot and control sockets on
    `ports` (no broker), `extra` flags last; its log in tmp_path/merger.log."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "merger",
            "--run-dir",
            str(tmp_path / "m"),
            "--init-npz",
            str(init),
            "--fragments",
            "2",
            "--delta-endpoint",
            f"@tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"@tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"@tcp://127.0.0.1:{ports[2]}",
            "--insecure",
            *extra,
        ],
        stdout=open(tmp_path / "merger.log", "wb"),
        stderr=subprocess.STDOUT,
    )


# the built-in LM at its smallest, for islands started as processes
TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32"]
TINY += ["--batch", "8", "--seed", "0"]


def start_connected_island(
    tmp_path: Path, i: int, ports: list[int], *extra: str
) -> subprocess.Popen:
    """Training island `isl-{i}` of two (P = 2, the TINY model) against the merger bound at
    `ports`, `extra` flags added; its metrics in tmp_path/isl-{i}.jsonl, stderr in isl-{i}.err."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "island",
            *["--name", f"isl-{i}", "--island-index", str(i), "--islands", "2", *TINY],
            "--fragments",
            "2",
            *extra,
            "--delta-endpoint",
            f"tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"tcp://127.0.0.1:{ports[2]}",
            "--metrics-out",
            str(tmp_path / f"isl-{i}.jsonl"),
            "--insecure",
        ],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / f"isl-{i}.err", "wb"),
    )
