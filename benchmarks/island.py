"""Island throughput: steps/s with publishing on (int4, H=50, P=4, unshaped loopback link into a
subscriber) against standalone steps/s, side by side in one run, alternating so both see the
same machine load.  The default model and batch of `dloco island`."""

from __future__ import annotations

import statistics
import sys
import threading
from collections.abc import Callable

import zmq

from dloco.island import bytelm, data
from dloco.island.config import ModelConfig, SyncConfig, TrainConfig
from dloco.island.loop import IslandLoop
from dloco.island.metrics import MetricsWriter
from dloco.island.network import NetworkLink
from dloco.island.shaper import LinkShaper


def _sink(context: zmq.Context, stop: threading.Event) -> tuple[int, threading.Thread]:
    """A SUB that swallows every delta, standing in for the broker."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")

    def drain() -> None:
        while not stop.is_set():
            if sub.poll(50):
                sub.recv_multipart()
        sub.close(linger=0)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return port, thread


def run(
    steps: int = 300,
    rounds: int = 3,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict:
    corpus = data.load()
    shards, evaluation, _ = data.split(corpus, 1)
    model, train = ModelConfig(), TrainConfig(max_steps=steps * rounds, eval_every=10**9)
    sync = SyncConfig(fragments=4, interval=50, codec="int4")
    context, stop = zmq.Context(), threading.Event()
    port, sink = _sink(context, stop)
    rates: dict[str, list[float]] = {"standalone": [], "publishing": []}
    deltas = 0
    try:
        for round_ in range(rounds):
            for mode in ("standalone", "publishing"):
                log(f"bench island: round {round_ + 1}/{rounds}, {mode}, {steps} steps ...")
                link = _publishing_link(sync, port) if mode == "publishing" else None
                loop = IslandLoop(
                    bytelm.trainer(model, train),
                    data.Batches(shards[0], train.batch, model.context, round_, 0),
                    data.eval_batches(evaluation, train.batch, model.context, 1),
                    train,
                    sync,
                    MetricsWriter(None),
                    link=link,
                    count=bytelm.count_tokens,
                )
                # compile and warm up
                loop.run(20)
                rates[mode].append(loop.run(steps)["steps_per_s"])
                if link is not None:
                    deltas += link.deltas_sent
                    link.close()
    finally:
        stop.set()
        sink.join(timeout=5)
        context.destroy(linger=0)
    standalone, publishing = (
        statistics.median(rates["standalone"]),
        statistics.median(rates["publishing"]),
    )
    return {
        "steps": steps,
        "rounds": rounds,
        "codec": "int4",
        "interval": 50,
        "fragments": 4,
        "deltas_sent": deltas,
        "standalone_steps_per_s": round(standalone, 3),
        "publishing_steps_per_s": round(publishing, 3),
        "ratio": round(publishing / standalone, 3),
        "all_rates": {k: [round(r, 3) for r in v] for k, v in rates.items()},
    }


def _publishing_link(sync: SyncConfig, port: int) -> NetworkLink:
    """The island's link with publishing on: deltas to the sink on `port` over an unshaped uplink;
    its snapshot and control endpoints lead nowhere (port 9)."""
    return NetworkLink(
        "bench",
        "bench",
        sync,
        f"tcp://127.0.0.1:{port}",
        "tcp://127.0.0.1:9",
        "tcp://127.0.0.1:9",
        uplink=LinkShaper(None),
    )


def summary(result: dict) -> str:
    return (
        f"island: publishing {result['publishing_steps_per_s']:.2f} steps/s vs standalone"
        f" {result['standalone_steps_per_s']:.2f} (ratio {result['ratio']:.3f}, medians of"
        f" {result['rounds']}; {result['deltas_sent']} int4 deltas sent)"
    )
