"""The island on the network: a real merger and two real islands on loopback; the loop never
waits on a trickling uplink; the emulated link holds its rate."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.island import bytelm, data
from dloco.island.config import ModelConfig, SyncConfig, TrainConfig
from dloco.island.loop import IslandLoop
from dloco.island.metrics import MetricsWriter
from dloco.island.network import NetworkLink
from dloco.island.shaper import LinkShaper
from dloco.protocol import downlink
from tests.test_downlink import F32, snapshot_frames
from tests.test_merger_process import free_port, free_ports

TINY = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch",
    "8",
    "--seed",
    "0",
]


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


# a merger process and two training islands: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "downlink",
    [
        # every fold goes down as an int4 diff (protocol/downlink.py)
        ("--snapshot-diff-codec", "int4"),
        # int8 full snapshots (the cluster profile's), diffs held to one per fragment per round
        (
            "--snapshot-diff-codec",
            "int4",
            "--snapshot-codec",
            "int8",
            "--snapshot-every-round",
            "1",
            "--max-staleness",
            "8",
        ),
    ],
    ids=["every-fold", "held-int8-join"],
)
def test_merger_and_two_islands_exchange_and_fold(tmp_path, downlink):
    init = tmp_path / "init.npz"
    subprocess.run(
        [sys.executable, "-m", "dloco", "island", "--write-init", str(init), *TINY],
        check=True,
        capture_output=True,
        timeout=120,
    )
    ports = free_ports(3)
    merger = subprocess.Popen(
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
            *downlink,
        ],
        stdout=open(tmp_path / "merger.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    islands = []
    try:
        for i in range(2):
            islands.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "dloco",
                        "island",
                        "--name",
                        f"isl-{i}",
                        "--island-index",
                        str(i),
                        "--islands",
                        "2",
                        *TINY,
                        "--max-steps",
                        "120",
                        "--eval-every",
                        "60",
                        "--fragments",
                        "2",
                        "--interval",
                        "10",
                        *(["--flush-on-leave"] if i == 0 else []),
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
            )
        summaries = [
            json.loads(p.communicate(timeout=180)[0].decode().strip().splitlines()[-1])
            for p in islands
        ]
    finally:
        for p in [*islands, merger]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    for summary in summaries:
        assert (
            summary["deltas_sent"] >= 10
            and summary["acks"].get("folded", 0) == summary["deltas_sent"]
        ), summary
        # every diff applied to exactly the value the merger served: a different byte anywhere is a
        # mismatch
        assert (
            summary["snapshots"].get("diff", 0) >= 10
            and summary["snapshots"].get("mismatch", 0) == 0
        ), summary
    folds = [json.loads(line) for line in open(tmp_path / "merger.log") if '"fold"' in line]
    assert {name for fold in folds for name in fold["contributors"]} == {"isl-0", "isl-1"}
    # stopping after step 120, fragment 0 (sent at 5, 15, ..., 115) has 5 unsent steps: with
    # --flush-on-leave (isl-0) they are sent on leaving, and folded; without (isl-1, the default)
    # they stay with the island
    assert summaries[0]["flushed"] == 1 and "flushed" not in summaries[1]
    last = {
        name: steps
        for fold in folds
        if fold["fragment"] == 0
        for name, steps in zip(fold["contributors"], fold["steps"])
    }
    # each island's last delta of fragment 0 (its first, at step 5, has 5 steps too)
    assert last == {"isl-0": 5, "isl-1": 10}
    versions = [
        json.loads(line)["snapshot_version"]
        for line in open(tmp_path / "isl-0.jsonl")
        if '"snapshot_version"' in line
    ]
    # the island adopted fresh global snapshots while training
    assert max(max(v) for v in versions) >= 2


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
    shards, evaluation = data.split(corpus, 1)
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


def test_slowdown_stretches_each_step_by_its_factor(tmp_path):
    corpus = data.load()
    shards, evaluation = data.split(corpus, 1)
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


@pytest.mark.timeout(120)
def test_a_stop_while_starting_exits_cleanly(tmp_path):
    """SIGTERM 3 s in (importing JAX, building the model, or waiting for a merger that never
    answers): exit 0, promptly.  (Within the interpreter's own first ~0.3 s no handler exists
    yet.)"""
    ports = free_ports(3)
    island = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "island",
            "--insecure",
            *TINY,
            "--join-timeout",
            "100",
            *[
                arg
                for i, flag in enumerate(
                    ("--delta-endpoint", "--snapshot-endpoint", "--control-endpoint")
                )
                for arg in (flag, f"tcp://127.0.0.1:{ports[i]}")
            ],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(3.0)
    island.terminate()
    assert island.wait(timeout=60) == 0, island.stderr.read()[-2000:]


@pytest.mark.timeout(60)
def test_a_delta_settled_without_a_fold_is_counted_per_fragment():
    """A blocking island waits for the fold of what it sent; a rejection must end that wait."""
    link = NetworkLink(
        "isl",
        "m",
        SyncConfig(fragments=2, interval=2),
        *(f"tcp://127.0.0.1:{p}" for p in free_ports(3)),
    )
    try:

        def ack(seq, *results):
            message = protocol.Ack(
                sender="merger",
                epoch=1,
                seq=seq,
                cursors=(),
                results=tuple(
                    protocol.DeltaResult(
                        "isl", link.epoch, d, f, status, 3, "" if status == "folded" else "stale"
                    )
                    for d, f, status in results
                ),
            )
            # as the receiver thread would
            link._on_frames(
                [memoryview(f) for f in protocol.encode(message)], protocol.Reassembler()
            )

        ack(1, (1, 0, "folded"), (2, 1, "rejected"))
        # delta 2 again: counted once
        ack(2, (2, 1, "rejected"), (3, 1, "rejected"), (4, 0, "rejected"))
        assert (
            link.unfolded == {1: 2, 0: 1}
            and link.results["folded"] == 1
            and link.results["rejected"] == 3
        )
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_an_island_applies_diffs_in_order_and_asks_for_what_it_cannot_apply():
    """A real NetworkLink; the test binds the snapshot bus (XPUB) and a ROUTER standing in for the
    merger's.  A diff that came before its base waits for it; a diff that does not apply is not
    adopted and the island asks for the fragment's value, again every `ask_again_s` until it holds
    one that new; the catch-up reply (fp32) completes even while a bus snapshot of the same version
    (bf16) sits half-assembled; a delayed snapshot of the merger's previous incarnation is ignored.
    """
    context = zmq.Context()
    bus, router = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)
    snapshot, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    bus.bind(snapshot)
    router.bind(control)
    link = NetworkLink(
        "isl",
        "m",
        SyncConfig(fragments=1, interval=1),
        f"tcp://127.0.0.1:{free_port()}",
        snapshot,
        control,
    )
    link.downlink.ask_again_s = 2.0
    try:
        # the start-up request: all
        assert router.poll(5000) and protocol.decode(router.recv_multipart()[1:]).fragments == ()
        subscribed = set()
        while subscribed != {b"\x01snapshot/", b"\x01ack"}:
            assert bus.poll(5000), "the island never subscribed"
            subscribed.add(bus.recv())
        # past the start-up request's cover
        time.sleep(link.downlink.ask_again_s + 0.05)

        fp32, bf16, w = (
            protocol.Codec("fp32"),
            protocol.Codec("bf16"),
            lambda value: {"w": np.full(64, value, F32)},
        )
        v3, plans3 = downlink.full(w(1.0), 3, fp32, 64)
        v4, plans4 = downlink.diff(w(2.0), v3, 4, fp32, 64)
        v5, plans5 = downlink.diff(w(3.0), v4, 5, fp32, 64)
        v6, plans6 = downlink.diff(w(4.0), v5, 6, fp32, 64)

        def send(
            plans, version, base=None, digest=None, seq=1, codec=fp32, epoch=1, chunks=slice(None)
        ):
            for frames in snapshot_frames(
                plans, version, codec, base=base, digest=digest, seq=seq, epoch=epoch
            )[chunks]:
                bus.send_multipart(frames)

        send(plans3, 3, digest=v3.digest)
        # before its base
        send(plans5, 5, base=4, digest=v5.digest, seq=10)
        assert [r.fragments for r in _requests(router, 1)] == [(0,)]
        # the base: both apply now
        send(plans4, 4, base=3, digest=v4.digest, seq=20)
        # a digest that does not match: refused
        send(plans6, 6, base=5, digest=v6.digest ^ 1, seq=30)
        _wait(lambda: link.downlink_results["mismatch"] == 1)
        # no second ask within 2 s
        assert dict(link.downlink_results) == {
            "full": 1,
            "gap": 1,
            "diff": 2,
            "mismatch": 1,
            "asked": 1,
        }
        asked = time.monotonic()
        # asked again with nothing new arriving
        assert [r.fragments for r in _requests(router, 1)] == [(0,)]
        assert time.monotonic() - asked > 1.0

        answer, answer_plans = downlink.full(w(5.0), 6, bf16, 64)
        # a bus snapshot's last chunk only
        send(answer_plans, 6, digest=answer.digest, seq=40, codec=bf16, chunks=slice(-1, None))
        exact, exact_plans = downlink.full(answer.tensors, 6, fp32, 64)
        # the reply: fp32, same version
        for frames in snapshot_frames(exact_plans, 6, fp32, digest=exact.digest, seq=40):
            router.send_multipart([b"isl", *frames])
        _wait(lambda: link.downlink_results["full"] == 2)
        # the previous merger's, delayed
        send(plans3, 7, digest=v3.digest, seq=1, epoch=0)
        _wait(lambda: link.downlink_results["old_epoch"] == 1)
        got = link.snapshots()
        assert [(f, v) for f, v, _ in got] == [(0, 3), (0, 4), (0, 5), (0, 6)]
        for (_, _, tensors), value in zip(got, (1.0, 2.0, 3.0, 5.0)):
            np.testing.assert_array_equal(tensors["w"], np.full(64, value, F32))
        time.sleep(link.downlink.ask_again_s + 0.2)
        # it holds version 6: no more asking
        assert link.downlink_results["asked"] == 2 and not router.poll(0)
    finally:
        link.close()
        bus.close(linger=0)
        router.close(linger=0)
        context.term()


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _requests(router: zmq.Socket, count: int) -> list[protocol.SnapshotRequest]:
    out = []
    while len(out) < count:
        assert router.poll(5000), "no snapshot request arrived"
        out.append(protocol.decode(router.recv_multipart()[1:]))
    return out
