"""Trust no island, in what it sends: a merger as a real process on loopback fed poisoned deltas,
floods of refused heartbeats and hellos, and partial or out-of-order chunks beyond its receive
budget.  Each test names the attack it replays."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time

import numpy as np
import pytest

from dloco import protocol
from dloco.analysis.runinfo import read_events
from tests.merger_helpers import delta_chunks, initial_params
from tests.merger_process_helpers import PARTS, Island, start_merger, stop


# a merger process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_poisoned_deltas_are_rejected_and_the_next_honest_one_folds(tmp_path):
    """Attacks on a real merger (plaintext, direct): after eight honest deltas, one of 1e6 x their
    norm (before: folded, the fragment's norm went 5.0 -> 343,086) and one of 3e38 values (before:
    "folded" with a norm of Infinity).  Both are rejected with their reason; an honest one folds.
    Then the island's own heartbeat with epoch 2**64-1 is refused, and its stream goes on."""
    island = Island(tmp_path)
    init = tmp_path / "init.npz"
    np.savez(init, **initial_params())
    merger = start_merger(tmp_path / "run", island, init)
    try:
        # eight of each fragment: enough history to judge by
        for delta_id in range(1, 17):
            assert island.send_until_settled(delta_id, island.chunks(delta_id)).status == "folded"

        def scaled(delta_id: int, scale: float):
            chunks = delta_chunks(
                PARTS[0], "a", delta_id, 0, island.versions[0], seed=delta_id, codec="fp32"
            )
            chunks = [
                dataclasses.replace(
                    c,
                    payloads=tuple(
                        (np.frombuffer(p, np.float32).astype(np.float64) * scale)
                        .clip(-3e38, 3e38)
                        .astype(np.float32)
                        .tobytes()
                        for p in c.payloads
                    ),
                )
                for c in chunks
            ]
            island.by_delta[delta_id] = island.frames_of(chunks)
            return island.by_delta[delta_id]

        big = island.send_until_settled(100, scaled(100, 1e6))
        assert (big.status, big.reason.split(":")[0]) == ("rejected", "outlier_norm"), big
        # values up to 3e38: finite float32s, whose squares are not
        huge = island.send_until_settled(102, scaled(102, 1e42))
        assert (huge.status, huge.reason.split(":")[0]) == ("rejected", "non_finite"), huge
        assert island.send_until_settled(104, island.chunks(104)).status == "folded"
        # its own epoch far ahead (before: the stream reset, every later message of epoch 1 stale)
        for _ in range(3):
            island.pub.send_multipart(
                protocol.encode(protocol.Heartbeat(sender="a", epoch=2**64 - 1, seq=0))
            )
        assert island.send_until_settled(106, island.chunks(106)).status == "folded"
        stop(merger)
        assert '"epoch_ahead"' in (tmp_path / "run.log").read_text()
    finally:
        if merger.poll() is None:
            merger.kill()
        island.close()


# a merger process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_key_on_a_fresh_merger_is_judged_against_another_islands_part(tmp_path):
    """A real merger (plaintext, direct) that has heard from two islands: b's first delta of
    fragment 0, at 1e6x an honest norm (before: folded alone, bounded only by half the fragment's
    norm), waits for a's (round.cold_wait_s, set past the test's own timeout), and the fold that
    takes both counts b's delta at most twice a's: its log line names b clipped, and the merged
    delta is a few times a's."""
    a = Island(tmp_path)
    b = Island(tmp_path, "b", beside=a)
    init = tmp_path / "init.npz"
    np.savez(init, **initial_params())
    merger = start_merger(tmp_path / "run", a, init, "--cold-wait", "600")
    b.connect()
    try:
        # fragment 1 from each: both are heard from
        for island in (a, b):
            assert island.send_until_settled(1, island.chunks(1)).status == "folded"
        hostile = [
            dataclasses.replace(
                c,
                payloads=tuple(
                    (np.frombuffer(p, np.float32) * np.float32(1e6)).tobytes() for p in c.payloads
                ),
            )
            for c in delta_chunks(PARTS[0], "b", 2, 0, 0, seed=2, codec="fp32")
        ]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            b.rounds = 0
            pending = pool.submit(b.send_until_settled, 2, b.frames_of(hostile))
            # b's delta sent five times: still not folded, it waits for another island's
            while b.rounds < 5 and not pending.done():
                time.sleep(0.05)
            assert not pending.done()
            honest = a.send_until_settled(2, a.chunks(2))
            poisoned = pending.result(timeout=60)
        assert (honest.status, poisoned.status) == ("folded", "folded")
        assert honest.version == poisoned.version == 1
        stop(merger)
        folds = [
            event
            for event in read_events(tmp_path / "run.log")
            if event.get("event") == "fold" and event["fragment"] == 0
        ]
        assert sorted(folds[0]["contributors"]) == ["a", "b"]
        assert folds[0]["clipped"] == ["b"]
        # b's delta counted at most twice a's norm as admission records it (for int4, a bound
        # from the block scales, about 3x the norm of a Gaussian delta), and each weighs 1/2: the
        # merged delta is a few times a's, where b's uncut would make it 2e5 times
        assert folds[0]["merged_norm"] < 5 * min(folds[0]["delta_norms"])
    finally:
        if merger.poll() is None:
            merger.kill()
        b.close()
        a.close()


# a merger process under a flood: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_flood_of_refused_heartbeats_and_hellos_writes_a_few_log_lines(tmp_path):
    """One key sends 5,000 heartbeats with an epoch far ahead and 5,000 hellos (before: one log line
    each, 23.6 MB of merger log for 50,000 of each).  Every one is counted; the log gets at most a
    line a second per peer and reason, each saying how many it left out (the last ones when it
    stops); an honest delta still folds."""
    island = Island(tmp_path)
    init = tmp_path / "init.npz"
    np.savez(init, **initial_params())
    merger = start_merger(tmp_path / "run", island, init)
    try:
        assert island.send_until_settled(1, island.chunks(1)).status == "folded"
        hello = protocol.Hello(
            sender="a", epoch=1, seq=0, role="island", region="r", model="m", codecs=("int4",)
        )
        for _ in range(5000):
            island.pub.send_multipart(
                protocol.encode(protocol.Heartbeat(sender="a", epoch=2**63, seq=0))
            )
            island.dealer.send_multipart(protocol.encode(hello))
        assert island.send_until_settled(2, island.chunks(2)).status == "folded"
        stop(merger)
        events = [
            json.loads(line)
            for line in (tmp_path / "run.log").read_text().splitlines()
            if line.startswith("{")
        ]
        refused = [e for e in events if e.get("reason") == "epoch_ahead"]
        hellos = [e for e in events if e.get("event") == "hello"]
        counters = next(e for e in events if e.get("event") == "stopped")["counters"]
        assert counters["merger/rejected/epoch_ahead"] == 5000
        assert 1 <= len(refused) <= 60 and 1 <= len(hellos) <= 60, (len(refused), len(hellos))
        # each line: itself and those it left out
        assert sum(e.get("left_out", 0) + (not e.get("flushed")) for e in refused) == 5000
    finally:
        if merger.poll() is None:
            merger.kill()
        island.close()


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    line = next(line for line in open(f"/proc/{pid}/status") if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def flood_chunk(seq: int, delta_id: int, plans, model: str) -> list:
    """The first chunk of `plans` as delta `delta_id` of an island "evil", sent at `seq`."""
    return protocol.encode(
        protocol.DeltaChunk(
            sender="evil",
            epoch=1,
            seq=seq,
            delta_id=delta_id,
            fragment=0,
            base_version=0,
            chunk_index=0,
            chunk_count=len(plans),
            steps=1,
            tokens=1,
            model=model,
            codec=protocol.Codec("fp32"),
            slices=plans[0].slices,
            payloads=plans[0].payloads,
        )
    )


# a merger process under attack: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_partial_and_out_of_order_floods_stay_within_the_receive_budget(tmp_path, init_npz):
    """Attacks: 200 deltas of 1 MiB of which only the first chunk ever comes (before: RSS +410 MB),
    then 200 chunks of 1 MiB after a seq that never comes (before: held outside any budget, +410
    MB). With --receive-mib 96 the merger's peak RSS grows by at most the budget plus ZeroMQ's queue
    and a margin; evictions are logged; an honest delta still folds."""
    island = Island(tmp_path)
    merger = start_merger(tmp_path / "run", island, init_npz, "--receive-mib", "96")
    try:
        assert island.send_until_settled(1, island.chunks(1)).status == "folded"
        before = rss_mib(merger.pid)
        # 1 MiB
        half = np.zeros(1 << 18, np.float32)
        plans = protocol.split_fragment(
            {"x": np.concatenate([half, half])}, protocol.Codec("fp32"), 1 << 20
        )
        model = protocol.model_fingerprint(initial_params())

        # seq 201 never comes
        seqs = [*range(1, 201), *range(202, 402)]
        for seq in seqs:
            island.pub.send_multipart(flood_chunk(seq, seq, plans, model))
            island.pub.send_multipart(
                protocol.encode(protocol.Heartbeat(sender="evil", epoch=1, seq=seq))
            )
            time.sleep(0.002)
        # processed after the flood: all of it was seen
        assert island.send_until_settled(2, island.chunks(2)).status == "folded"
        peak = rss_mib(merger.pid, "VmHWM")
        print(f"merger RSS before the flood {before:.0f} MiB, peak {peak:.0f} MiB")
        stop(merger)
    finally:
        if merger.poll() is None:
            merger.kill()
        island.close()
    # MiB: --receive-mib, ZeroMQ's queue (held budget / 1 MiB chunks), allocator and copies
    budget, queue, margin = 96, 32, 64
    assert peak - before <= budget + queue + margin, (before, peak)
    events = [
        json.loads(line)
        for line in (tmp_path / "run.log").read_text().splitlines()
        if line.startswith("{")
    ]
    evicted = next(e for e in events if e.get("event") == "stopped")["evicted"]
    assert evicted["partial_memory"] + evicted["held_overflow"] > 0 and any(
        e.get("event") == "receive_evicted" for e in events
    ), evicted
