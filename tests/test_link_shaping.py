"""Emulated links and speeds: the shaper's schedule by hand, the loop never waiting on a trickling
uplink; and, read off the wall clock (-m e2e), the uplink never over its rate, the downlink holding
snapshots until they would have arrived, and a slowdown factor stretching each step."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.cluster.ports import free_ports
from dloco.island import bytelm, data
from dloco.island.config import ModelConfig, SyncConfig, TrainConfig
from dloco.island.loop import IslandLoop
from dloco.island.metrics import MetricsWriter
from dloco.island.network import NetworkLink
from dloco.island.shaper import LinkShaper
from tests.merger_process_helpers import free_port


def test_shaper_schedules_by_hand():
    link = LinkShaper(rate_bytes_s=1000.0, latency_s=0.5)
    # 0.5 s on the wire, then 0.5 s latency
    assert link.schedule(500, now=10.0) == (10.5, 11.0)
    # queued behind the first
    assert link.schedule(1000, now=10.2) == (11.5, 12.0)
    # idle link starts at once
    assert link.schedule(100, now=20.0) == (20.1, 20.6)
    assert LinkShaper.from_mbps(8, rtt_ms=100) == LinkShaper(1e6, 0.05)
    assert LinkShaper(None).schedule(10**9, now=1.0) == (1.0, 1.0)
    with pytest.raises(ValueError):
        LinkShaper(rate_bytes_s=0)


def step_times(loop: IslandLoop, metrics: Path, steps: int) -> list[float]:
    loop.run(steps)
    loop.metrics.close()
    times = [json.loads(line)["time"] for line in open(metrics)]
    return [b - a for a, b in zip(times[1:], times[2:])]


# a networked island for 20 s: -m e2e keeps the default run within its budget
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_the_loop_never_waits_for_a_trickling_uplink(tmp_path):
    """Same loop, same delta work; only the uplink differs: unlimited vs 0.001 Mbit/s, where one
    delta takes minutes to go out.  The trickling island still makes all its steps and hands every
    delta over (summed in the outbox) while none has gone out: a loop that waited for its uplink
    would not finish inside the timeout.  How fast it steps is a benchmark's question
    (`dloco bench island`), not this test's: on a busy machine step times vary more than any margin.
    """
    corpus = data.load()
    shards, evaluation, _ = data.split(corpus, 1)
    model, train = (
        ModelConfig(width=64, depth=2, heads=2, context=64),
        TrainConfig(batch=8, eval_every=10_000, max_steps=120),
    )
    sync = SyncConfig(fragments=2, interval=4, codec="int4")
    links: dict[str, list[NetworkLink]] = {"free": [], "trickle": []}
    for mode, mbps in (("free", None), ("trickle", 0.001)):
        trainer = bytelm.trainer(model, train)
        link = NetworkLink(
            "isl",
            "m",
            sync,
            *(f"tcp://127.0.0.1:{p}" for p in free_ports(3)),
            uplink=LinkShaper.from_mbps(mbps),
        )
        links[mode].append(link)
        metrics = tmp_path / f"{mode}.jsonl"
        loop = IslandLoop(
            trainer,
            data.Batches(shards[0], 8, 64, 0, 0),
            data.eval_batches(evaluation, 8, 64, 1),
            train,
            sync,
            MetricsWriter(metrics),
            link=link,
            count=bytelm.count_tokens,
        )
        try:
            # every step made
            assert len(step_times(loop, metrics, 120)) == 119
        finally:
            link.close()
    # the trickle publisher is stuck in its first delta, yet every later delta is kept (summed),
    # none dropped
    assert all(link.deltas_sent > 0 for link in links["free"])
    assert all(link.deltas_sent == 0 and link.summed >= 50 for link in links["trickle"])


# a rate read off the wall clock: -m e2e (the default suite never reads a clock's ratio)
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_uplink_never_exceeds_its_configured_rate():
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # 2 MB/s
    rate_mbps = 16.0
    link = NetworkLink(
        "isl",
        "m",
        SyncConfig(fragments=1, interval=1, codec="fp32"),
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{free_port()}",
        f"tcp://127.0.0.1:{free_port()}",
        uplink=LinkShaper.from_mbps(rate_mbps),
    )
    try:
        # subscription reaches the publisher
        time.sleep(0.5)
        # 4 MiB in 4 chunks of 1 MiB: about 2 s of wire time
        delta = {"w": np.zeros(1 << 20, np.float32)}
        link.publish(0, 0, delta, 1, 1)
        arrivals, sizes = [], []
        while len(arrivals) < 4:
            assert sub.poll(10_000), "the shaped uplink delivered nothing for 10 s"
            frames = sub.recv_multipart()
            arrivals.append(time.monotonic())
            sizes.append(sum(len(f) for f in frames))
        # bytes after the first, over the time they took
        measured = sum(sizes[1:]) / (arrivals[-1] - arrivals[0])
        # Never faster than the configured rate (the shaper's promise); slower only by what a busy
        # machine adds.
        assert 0.25 * rate_mbps * 1e6 / 8 < measured < 1.10 * rate_mbps * 1e6 / 8, measured
    finally:
        link.close()
        context.destroy(linger=0)


# a rate read off the wall clock: -m e2e (the default suite never reads a clock's ratio)
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_downlink_holds_snapshots_until_they_would_have_arrived():
    link = NetworkLink(
        "isl",
        "m",
        SyncConfig(fragments=1, interval=1),
        f"tcp://127.0.0.1:{free_port()}",
        f"tcp://127.0.0.1:{free_port()}",
        # 1 MB/s, 100 ms one way
        f"tcp://127.0.0.1:{free_port()}",
        downlink=LinkShaper.from_mbps(8, rtt_ms=200),
    )
    try:
        # 1 MB of fp32 snapshot
        x = np.ones(250_000, np.float32)
        plan = protocol.split_fragment({"w": x}, protocol.Codec("fp32"), 1 << 20)[0]
        frames = protocol.encode(
            protocol.SnapshotChunk(
                sender="merger",
                epoch=1,
                seq=1,
                fragment=0,
                version=3,
                chunk_index=0,
                chunk_count=1,
                model="m",
                codec=protocol.Codec("fp32"),
                slices=plan.slices,
                payloads=plan.payloads,
            )
        )
        handed = time.monotonic()
        # as the receiver thread would
        link._on_frames([memoryview(f) for f in frames], protocol.Reassembler())
        # on the emulated wire for ~1.1 s
        assert link.snapshots() == []
        while not (ready := link.snapshots()):
            time.sleep(0.01)
        waited = time.monotonic() - handed
        nbytes = sum(memoryview(f).nbytes for f in frames)
        # never handed over before it would have arrived; later only by what a busy machine adds
        assert 0.9 * (nbytes / 1e6 + 0.1) <= waited < nbytes / 1e6 + 0.1 + 10.0 and ready[0][
            :2
        ] == (0, 3)
    finally:
        link.close()


# a rate read off the wall clock: -m e2e (the default suite never reads a clock's ratio)
@pytest.mark.e2e
def test_slowdown_stretches_each_step_by_its_factor(tmp_path):
    corpus = data.load()
    shards, evaluation, _ = data.split(corpus, 1)
    model, train = (
        ModelConfig(width=64, depth=2, heads=2, context=64),
        TrainConfig(batch=8, eval_every=10_000),
    )
    times: dict[float, list[float]] = {1.0: [], 2.0: []}
    # alternate, so both factors see the same machine load
    for round_ in range(2):
        for slowdown in (1.0, 2.0):
            metrics = tmp_path / f"{slowdown}-{round_}.jsonl"
            loop = IslandLoop(
                bytelm.trainer(model, train),
                data.Batches(shards[0], 8, 64, 0, 0),
                data.eval_batches(evaluation, 8, 64, 1),
                train,
                SyncConfig(),
                MetricsWriter(metrics),
                slowdown=slowdown,
                count=bytelm.count_tokens,
            )
            times[slowdown] += step_times(loop, metrics, 50)[10:]
    # the sleep doubles the compute part; batch assembly and bookkeeping are not stretched, and the
    # machine is shared, so the bound is loose but excludes "no slowdown" and "runaway"
    assert 1.5 < statistics.median(times[2.0]) / statistics.median(times[1.0]) < 3.2
