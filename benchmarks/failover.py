"""Failover time: from a primary merger's kill -9 to the first delta the standby folds as the new
primary.

Each run starts a fresh primary and standby (`dloco merger`, sync replication, lease `lease_s`)
behind one broker, all on loopback, and a `StreamIsland` that speaks the islands' stream protocol
through the broker.  Once a few deltas are folded and the standby has them, the primary is
killed and the island goes on sending; the time to its first delta settled under the new epoch is
measured (the island's view), and the standby's own `taking_over` line says when it took over.
Median of `runs` runs; the reference is the lease, which the takeover must wait out.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from dloco import protocol
from dloco.bus.security import Security
from dloco.cluster.ports import free_ports
from dloco.island.mergers import MergerLinks

WAIT_S = 120.0


class StreamIsland:
    """An island reduced to its stream: contiguous seqs, heartbeats, resends on request (everything
    sent is kept), a delta repeated until settled.  `chunks(delta_id, base_versions)` makes a
    delta's chunks; every ack seen is kept as (merger epoch, results).  `stream`: the merger shard
    its deltas are for (protocol/shards.py), named on its heartbeats."""

    def __init__(
        self,
        delta_in: str,
        snapshot_out: str,
        control: list[str],
        chunks: Callable,
        name: str = "a",
        stream: int = 0,
    ) -> None:
        self.context, self.name, self.chunks = zmq.Context(), name, chunks
        self.stream = stream
        self.pub = self._socket(zmq.PUB, delta_in)
        self.sub = self._socket(zmq.SUB, snapshot_out)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"ack")
        # as an island's: the mergers' control sockets, requests on the one that is up
        self.links = MergerLinks(
            self.context, [",".join(control)], Security(None, name), "merger", name
        )
        self.epoch, self.seq, self.sent = time.time_ns(), 0, {}
        self.versions: dict[int, int] = {}
        self.acks: list[tuple[int, tuple]] = []
        # delta id -> (epoch of the ack, result)
        self.settled: dict[int, tuple[int, protocol.DeltaResult]] = {}

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        return socket

    def send_until_settled(self, delta_id: int, wait_s: float = WAIT_S) -> protocol.DeltaResult:
        frames = []
        for chunk in self.chunks(delta_id, self.versions):
            self.seq += 1
            self.sent[self.seq] = protocol.encode(
                dataclasses.replace(chunk, sender=self.name, seq=self.seq, epoch=self.epoch)
            )
            frames.append(self.sent[self.seq])
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for f in frames:
                self.pub.send_multipart(f)
            self.pub.send_multipart(
                protocol.encode(
                    protocol.Heartbeat(
                        sender=self.name, epoch=self.epoch, seq=self.seq, stream=self.stream
                    )
                )
            )
            until = time.monotonic() + 0.3
            while (left := until - time.monotonic()) > 0:
                for dealer in self.links.dealers:
                    while dealer.poll(0):
                        self._resend(protocol.decode(dealer.recv_multipart()))
                if not self.sub.poll(int(min(left, 0.05) * 1000) + 1):
                    continue
                ack = protocol.decode(self.sub.recv_multipart())
                self.acks.append((ack.epoch, ack.results))
                for result in ack.results:
                    if (
                        result.island == self.name
                        and result.epoch == self.epoch
                        and result.delta_id not in self.settled
                    ):
                        self.settled[result.delta_id] = (ack.epoch, result)
                if delta_id in self.settled:
                    result = self.settled[delta_id][1]
                    if result.status == "folded":
                        self.versions[result.fragment] = result.version
                    return result
        raise TimeoutError(f"delta {delta_id} was not settled within {wait_s} s")

    def _resend(self, request) -> None:
        for first, last in getattr(request, "ranges", ()):
            for seq in range(first, last + 1):
                if seq in self.sent:
                    self.links.send(self.sent[seq], 0)

    def close(self) -> None:
        self.links.close()
        self.context.destroy(linger=0)


def dloco(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "dloco", *args],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


def events(log: Path, name: str) -> list[dict]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if f'"event": "{name}"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def wait_for(log: Path, name: str, process: subprocess.Popen, **fields) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = [e for e in events(log, name) if all(e.get(k) == v for k, v in fields.items())]
        if found:
            return found[0]
        if process.poll() is not None:
            raise RuntimeError(f"{log.name}: exited {process.returncode} before {name}")
        time.sleep(0.02)
    raise TimeoutError(f"{log.name}: no {name} within {WAIT_S} s")


# two fragments of 16 K parameters
SHAPES = {"w0": (256, 64), "w1": (256, 64)}


def _chunks(delta_id: int, versions: dict[int, int]) -> list[protocol.DeltaChunk]:
    fragment = delta_id % 2
    rng = np.random.default_rng(delta_id)
    tensors = {
        f"w{fragment}": (rng.standard_normal(SHAPES[f"w{fragment}"]) * 1e-2).astype(np.float32)
    }
    plans = protocol.split_fragment(tensors, protocol.Codec("int4"), 4096)
    model = protocol.model_fingerprint({p: np.zeros(s, np.float32) for p, s in SHAPES.items()})
    return [
        protocol.DeltaChunk(
            sender="a",
            epoch=0,
            seq=0,
            delta_id=delta_id,
            fragment=fragment,
            base_version=versions.get(fragment, 0),
            chunk_index=i,
            chunk_count=len(plans),
            steps=10,
            tokens=1000,
            model=model,
            codec=protocol.Codec("int4"),
            slices=p.slices,
            payloads=p.payloads,
        )
        for i, p in enumerate(plans)
    ]


def _one(tmp: Path, broker: list[str], lease_s: float, number: int, extra=()) -> dict:
    """One failover: a fresh primary and standby (`extra`: more flags for both), a few deltas
    folded, the primary killed; the seconds to the first delta settled under the new epoch, and to
    the standby's takeover."""
    control = free_ports(2)
    (a, a_log), (b, b_log) = _mergers(tmp, broker, lease_s, number, control, extra)
    island = StreamIsland(broker[0], broker[3], [f"tcp://127.0.0.1:{p}" for p in control], _chunks)
    try:
        for delta_id in range(1, 5):
            island.send_until_settled(delta_id)
        wait_for(a_log, "replication", a, state="sync")
        a.send_signal(signal.SIGKILL)
        killed, killed_wall = time.monotonic(), time.time()
        a.wait(timeout=10)
        old = island.settled[4][0]
        delta_id = 5
        # what the island sent meanwhile may be settled by the dying primary: the first under the
        # new epoch counts
        while True:
            island.send_until_settled(delta_id)
            if island.settled[delta_id][0] != old:
                break
            delta_id += 1
        first_fold_s = time.monotonic() - killed
        took = wait_for(b_log, "taking_over", b)
        return {
            "first_fold_s": round(first_fold_s, 3),
            "takeover_s": round(_wall(took) - killed_wall, 3),
            "silent_s": took["silent_s"],
        }
    finally:
        island.close()
        for process in (a, b):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()


def _mergers(
    tmp: Path, broker: list[str], lease_s: float, number: int, control: list[int], extra=()
) -> tuple[tuple[subprocess.Popen, Path], tuple[subprocess.Popen, Path]]:
    """A fresh primary `dloco merger` (a) and its standby (b), sync replication, on the broker's
    buses: each process with its log."""
    replication = free_ports(2)
    init = tmp / "init.npz"
    np.savez(init, **{p: np.zeros(s, np.float32) for p, s in SHAPES.items()})
    common = [
        "merger",
        "--fragments",
        "2",
        "--delta-endpoint",
        broker[1],
        "--snapshot-endpoint",
        broker[2],
        "--insecure",
        "--lease",
        str(lease_s),
        "--replication",
        "sync",
        "--fsync",
        "always",
        *extra,
    ]
    a_log, b_log = tmp / f"a{number}.log", tmp / f"b{number}.log"
    a = dloco(
        *common,
        "--run-dir",
        str(tmp / f"a{number}"),
        "--control-endpoint",
        f"@tcp://127.0.0.1:{control[0]}",
        "--init-npz",
        str(init),
        "--replication-endpoint",
        f"@tcp://127.0.0.1:{replication[0]}",
        "--peer",
        f"tcp://127.0.0.1:{replication[1]}",
        log=a_log,
    )
    b = dloco(
        *common,
        "--run-dir",
        str(tmp / f"b{number}"),
        "--control-endpoint",
        f"@tcp://127.0.0.1:{control[1]}",
        "--replication-endpoint",
        f"@tcp://127.0.0.1:{replication[1]}",
        "--standby-of",
        f"tcp://127.0.0.1:{replication[0]}",
        log=b_log,
    )
    return (a, a_log), (b, b_log)


def _wall(event: dict) -> float:
    import datetime

    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def run(
    runs: int = 5,
    lease_s: float = 3.0,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    etcd: bool = False,
) -> dict:
    """`runs` failovers; with `etcd`, each beside one with the lease in etcd (a local etcd member,
    merger/replication/consensus.py), in turn, and their medians' ratio."""
    samples, with_etcd = [], []
    with tempfile.TemporaryDirectory(prefix="dloco-bench-failover-") as tmp:
        ports = free_ports(4)
        broker = [f"tcp://127.0.0.1:{p}" for p in ports]
        broker_process = dloco(
            "broker",
            "--insecure",
            "--delta-in",
            broker[0],
            "--delta-out",
            broker[1],
            "--snapshot-in",
            broker[2],
            "--snapshot-out",
            broker[3],
            log=Path(tmp) / "broker.log",
        )
        store, url = _etcd(Path(tmp)) if etcd else (None, None)
        try:
            for number in range(runs):
                samples.append(_one(Path(tmp), broker, lease_s, number))
                log(f"bench failover: run {number + 1} of {runs}: {samples[-1]}")
                if etcd:
                    flags = ("--etcd", url, "--etcd-prefix", f"/bench/{number}")
                    with_etcd.append(_one(Path(tmp), broker, lease_s, runs + number, flags))
                    log(f"bench failover: run {number + 1} of {runs}, etcd: {with_etcd[-1]}")
        finally:
            broker_process.send_signal(signal.SIGTERM)
            broker_process.wait(timeout=30)
            if store is not None:
                store.send_signal(signal.SIGTERM)
                store.wait(timeout=30)
    first = statistics.median(s["first_fold_s"] for s in samples)
    result = {
        "runs": runs,
        "lease_s": lease_s,
        "first_fold_after_loss_s": round(first, 3),
        "takeover_after_loss_s": round(statistics.median(s["takeover_s"] for s in samples), 3),
        "first_fold_vs_lease": round(first / lease_s, 3),
        "samples": samples,
    }
    if etcd:
        first_etcd = statistics.median(s["first_fold_s"] for s in with_etcd)
        result["etcd"] = {
            "first_fold_after_loss_s": round(first_etcd, 3),
            "takeover_after_loss_s": round(
                statistics.median(s["takeover_s"] for s in with_etcd), 3
            ),
            "vs_lease": round(first_etcd / first, 3),
            "samples": with_etcd,
        }
    return result


def _etcd(tmp: Path) -> tuple[subprocess.Popen, str]:
    """One etcd member on free loopback ports (`dloco etcd`), once it accepts connections."""
    client, peer = free_ports(2)
    process = dloco(
        "etcd",
        *("--data-dir", str(tmp / "etcd"), "--client-port", str(client)),
        *("--peer-port", str(peer)),
        log=tmp / "etcd.log",
    )
    url = f"http://127.0.0.1:{client}"
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as answer:
                if b'"true"' in answer.read():
                    return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: see {tmp / 'etcd.log'}") from None
        time.sleep(0.1)


def summary(result: dict) -> str:
    line = (
        f"failover: first fold {result['first_fold_after_loss_s']:.2f} s after the primary's kill"
        f" -9 (median of {result['runs']}; the standby took over after"
        f" {result['takeover_after_loss_s']:.2f} s); lease {result['lease_s']} s; ratio to the"
        f" lease {result['first_fold_vs_lease']:.2f}"
    )
    if "etcd" in result:
        e = result["etcd"]
        line += (
            f"; with the lease in etcd: {e['first_fold_after_loss_s']:.2f} s (took over after"
            f" {e['takeover_after_loss_s']:.2f} s), {e['vs_lease']:.2f}x the pair's own lease"
        )
    return line
