"""Shared test helpers: small fragments and valid messages of every kind."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from dloco import protocol


def make_fragment(seed: int = 0, scale: float = 1e-2) -> dict[str, np.ndarray]:
    """A fragment with awkward sizes: odd lengths, a scalar, a tensor spanning many blocks."""
    rng = np.random.default_rng(seed)
    shapes = {
        "embed/table": (97, 33),
        "blocks/0/mlp/kernel": (64, 130),
        "blocks/0/norm/scale": (33,),
        "head/bias": (1,),
    }
    return {
        path: (rng.standard_normal(shape) * scale).astype(np.float32)
        for path, shape in shapes.items()
    }


def delta_messages(
    fragment, codec, max_chunk_bytes=4096, sender="island-a", epoch=7, delta_id=1, base_version=3
):
    plans = protocol.split_fragment(fragment, codec, max_chunk_bytes)
    model = protocol.model_fingerprint(fragment)
    return [
        protocol.DeltaChunk(
            sender=sender,
            epoch=epoch,
            seq=i + 1,
            delta_id=delta_id,
            fragment=2,
            base_version=base_version,
            chunk_index=i,
            chunk_count=len(plans),
            steps=50,
            tokens=50 * 2048,
            model=model,
            codec=codec,
            slices=plan.slices,
            payloads=plan.payloads,
        )
        for i, plan in enumerate(plans)
    ]


# Over 60 lines: a table of literal messages, one of each kind (and the sparse payloads), read top
# to bottom.
def one_of_each_kind() -> list[protocol.Message]:
    """A valid message of every kind (chunks with real payloads)."""
    fragment = make_fragment()
    delta = delta_messages(fragment, protocol.Codec("int4"), max_chunk_bytes=1 << 20)[0]
    plan = protocol.split_fragment(fragment, protocol.Codec("bf16"))[0]
    snapshot = protocol.SnapshotChunk(
        sender="merger",
        epoch=1,
        seq=9,
        fragment=2,
        version=4,
        chunk_index=0,
        chunk_count=1,
        model=delta.model,
        codec=protocol.Codec("bf16"),
        slices=plan.slices,
        payloads=plan.payloads,
    )
    # a diff snapshot
    diff = dataclasses.replace(
        snapshot, version=5, base_version=4, digest=0xDEADBEEF, codec=protocol.Codec("bf16")
    )
    sparse_codec = protocol.Codec("topk4", 512)
    sparse_plan = protocol.split_fragment(fragment, sparse_codec)[0]
    return [
        delta,
        snapshot,
        diff,
        protocol.Heartbeat(sender="island-a", epoch=7, seq=12),
        protocol.Hello(
            sender="island-a",
            epoch=7,
            seq=0,
            role="island",
            region="us-east",
            model=delta.model,
            codecs=("int4", "bf16"),
        ),
        protocol.ResendRequest(
            sender="merger",
            epoch=1,
            seq=9,
            target="island-a",
            target_epoch=7,
            ranges=((3, 5), (9, 9)),
        ),
        protocol.Ack(
            sender="merger",
            epoch=1,
            seq=10,
            cursors=(protocol.Cursor(island="island-a", epoch=7, seq=12),),
            results=(
                protocol.DeltaResult(
                    island="island-a",
                    epoch=7,
                    delta_id=1,
                    fragment=2,
                    status="folded",
                    version=5,
                    reason="",
                ),
                protocol.DeltaResult(
                    island="island-b",
                    epoch=3,
                    delta_id=4,
                    fragment=2,
                    status="rejected",
                    version=5,
                    reason="stale: 9 > 8",
                ),
            ),
        ),
        protocol.SnapshotRequest(sender="island-a", epoch=7, seq=12, fragments=(0, 2)),
        # sparse payloads: indices to validate
        delta_messages(fragment, protocol.Codec("topk2"), max_chunk_bytes=1 << 20)[0],
        dataclasses.replace(
            diff, codec=sparse_codec, slices=sparse_plan.slices, payloads=sparse_plan.payloads
        ),
    ]


def header_of(message) -> tuple[list, dict]:
    """A message's frames (as bytes) and its header unpacked, to make faulty variants from."""
    frames = [bytes(f) for f in protocol.encode(message)]
    return frames, msgpack.unpackb(frames[1])


def with_header(frames, header) -> list:
    return [frames[0], msgpack.packb(header), *frames[2:]]


def reason_of(frames, limits=protocol.DEFAULT_LIMITS) -> str:
    """The reason `decode` gives for refusing `frames` (it must refuse them)."""
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(frames, limits)
    return info.value.reason


@pytest.fixture
def fragment() -> dict[str, np.ndarray]:
    return make_fragment()


@pytest.fixture
def init_npz(tmp_path):
    """The initial parameters of tests/merger_helpers.py's model, as a merger's --init-npz."""
    from tests.merger_helpers import initial_params

    path = tmp_path / "init.npz"
    np.savez(path, **initial_params())
    return path


@pytest.fixture
def processes():
    """Every merger a test starts; whatever happens, none outlives the test."""
    started = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def islands():
    """Every test-side island (tests/merger_process_helpers.py Island) a test makes, closed after
    it."""
    made = []
    yield made
    for island in made:
        island.close()


def pytest_configure(config) -> None:
    """One JAX compilation cache for the whole pytest run, in this process and every process a test
    starts (islands, mergers, `dloco up`): the same tiny models are compiled once, not once per
    process. A fresh folder per pytest run, so a run never depends on what an earlier one left.  Set
    before the test modules are collected, so that this process's JAX reads it too."""
    import os
    import tempfile

    config._jax_cache = tempfile.mkdtemp(prefix="dloco-test-jax-cache-")
    os.environ.update(
        {
            "JAX_COMPILATION_CACHE_DIR": config._jax_cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
    )


def pytest_unconfigure(config) -> None:
    import shutil

    if getattr(config, "_jax_cache", None):
        shutil.rmtree(config._jax_cache, ignore_errors=True)
