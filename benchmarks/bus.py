"""Bus benchmark: 1 MiB messages PUB → SUB directly, through the broker, and through the broker
with CURVE on every hop, measured in the same run, interleaved `repeats` times; medians.  Sender,
broker and receiver are separate processes (the sender is this module run as a script)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import zmq

from dloco.benchmarks.timing import gbps, receive_timed
from dloco.cluster.ports import free_ports

MESSAGE_BYTES = 1 << 20


def _measure(
    endpoint_out: str, endpoint_in: str, count: int, keys: Path | None, bind_sub: bool
) -> float:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        from dloco.bus.keys import Identity, make_client

        make_client(sub, Identity.load(keys, "merger", server="broker"))
    (sub.bind if bind_sub else sub.connect)(endpoint_out)
    sender = [
        sys.executable,
        "-P",
        "-m",
        "dloco.benchmarks.bus",
        "--send",
        endpoint_in,
        "--count",
        str(count),
    ]
    if keys is not None:
        sender += ["--keys", str(keys)]
    process = subprocess.Popen(sender)
    try:
        _, seconds = receive_timed(sub, count, timeout_s=120.0)
    finally:
        process.wait(timeout=60)
        context.destroy(linger=0)
    return gbps((count - 1) * MESSAGE_BYTES, seconds)


def _broker(secure_keys: Path | None) -> tuple[subprocess.Popen, list[int]]:
    ports = free_ports(4)
    args = [
        sys.executable,
        "-P",
        "-m",
        "dloco",
        "broker",
        "--stats-every",
        "3600",
        "--delta-in",
        f"tcp://127.0.0.1:{ports[0]}",
        "--delta-out",
        f"tcp://127.0.0.1:{ports[1]}",
        "--snapshot-in",
        f"tcp://127.0.0.1:{ports[2]}",
        "--snapshot-out",
        f"tcp://127.0.0.1:{ports[3]}",
    ]
    args += (
        ["--keys", str(secure_keys), "--allow", str(secure_keys / "allow")]
        if secure_keys
        else ["--insecure"]
    )
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:
        if "broker_started" in line:
            break
    return process, ports


def run(
    count: int = 400,
    repeats: int = 3,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict:
    """Each path measured `repeats` times, interleaved (raw, broker, CURVE, raw, ...); medians."""
    samples: dict[str, list[float]] = {
        "raw_pubsub_gbps": [],
        "broker_gbps": [],
        "broker_curve_gbps": [],
    }
    with tempfile.TemporaryDirectory(prefix="dloco-bench-bus-") as tmp:
        keys = Path(tmp)
        from dloco.bus.keys import create_keys, write_allow_list

        create_keys(keys, ["broker", "island-0", "merger"])
        write_allow_list(keys, keys / "allow", {"island": ["island-0"], "merger": ["merger"]})
        for round_ in range(repeats):
            log(
                f"bench bus: round {round_ + 1}/{repeats}: raw PUB->SUB, broker, broker+CURVE,"
                f" {count} x 1 MiB each ..."
            )
            (port,) = free_ports(1)
            samples["raw_pubsub_gbps"].append(
                _measure(
                    f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", count, None, bind_sub=True
                )
            )
            for label, secure in (("broker_gbps", None), ("broker_curve_gbps", keys)):
                broker, ports = _broker(secure)
                try:
                    samples[label].append(
                        _measure(
                            f"tcp://127.0.0.1:{ports[1]}",
                            f"tcp://127.0.0.1:{ports[0]}",
                            count,
                            secure,
                            bind_sub=False,
                        )
                    )
                finally:
                    broker.terminate()
                    broker.wait(timeout=30)
    medians = {label: statistics.median(values) for label, values in samples.items()}
    raw = medians["raw_pubsub_gbps"]
    return {
        "message_bytes": MESSAGE_BYTES,
        "messages": count,
        "repeats": repeats,
        **{k: round(v, 3) for k, v in medians.items()},
        "broker_vs_raw": round(medians["broker_gbps"] / raw, 3),
        "curve_vs_raw": round(medians["broker_curve_gbps"] / raw, 3),
        "samples": {k: [round(v, 3) for v in values] for k, values in samples.items()},
    }


def summary(result: dict) -> str:
    return (
        f"bus, 1 MiB messages: raw {result['raw_pubsub_gbps']:.2f} GB/s, broker"
        f" {result['broker_gbps']:.2f} ({result['broker_vs_raw']:.2f} x raw), broker+CURVE"
        f" {result['broker_curve_gbps']:.2f} ({result['curve_vs_raw']:.2f} x raw)"
    )


def _send(endpoint: str, count: int, keys: str | None) -> None:
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, -1)
    if keys:
        from dloco.bus.keys import Identity, make_client

        make_client(pub, Identity.load(keys, "island-0", server="broker"))
    pub.connect(endpoint)
    # subscriptions propagate (slow joiner)
    time.sleep(1.0)
    payload = b"\x00" * MESSAGE_BYTES
    # what the secure broker checks: its key's name
    header = msgpack.packb({"v": 2, "kind": "delta", "sender": "island-0", "epoch": 1})
    for _ in range(count):
        pub.send_multipart([b"delta/0", header, payload], copy=False)
    pub.close()
    context.term()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--send", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--keys")
    arguments = parser.parse_args()
    _send(arguments.send, arguments.count, arguments.keys)
