"""Codec benchmark: quantize / dequantize / frame ~100 MB of float32 deltas with every codec.

The reference is a plain numpy copy of the same data (``memcpy_gbps``), measured in the same run
between the codecs so that noise from other tenants hits both alike.  All rates are medians.

- ``quantize_gbps`` / ``dequantize_gbps``: float32 bytes (4 per value) per second through
  `Codec.encode` / `Codec.decode`.
- ``roundtrip_max_rel_err``: the largest |x - decode(encode(x))| divided by max |x|.
- ``wire_bytes_per_param``: every byte of every frame (topic, header, payloads) of the data sent as
  1 MiB delta chunks, divided by the number of values.
- ``frame_encode_gbps`` / ``frame_decode_gbps``: wire bytes per second through `protocol.encode`
  (crc32) and `protocol.decode` (all checks, crc32 and finiteness included) of those chunks.
- ``crc32_gbps`` / ``zlib_crc32_gbps``: `protocol.checksum.crc32` (ISA-L) and zlib's over the same
  bytes, and their ratio ``crc32_vs_zlib``.
"""

from __future__ import annotations

import statistics
import sys
import zlib
from collections.abc import Callable

import numpy as np

from dloco import protocol
from dloco.benchmarks.timing import gbps, median_seconds, memcpy_seconds
from dloco.protocol import checksum

# the data is cut into tensors of 4 MiB, like the layers of a model
TENSOR_VALUES = 1 << 20


def make_deltas(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Pseudo-gradient-like data: Gaussian with a per-tensor scale spread over two decades."""
    rng = np.random.default_rng(seed)
    n_tensors = max(1, total_bytes // (4 * TENSOR_VALUES))
    return {
        f"layers/{i:03d}/kernel": (
            rng.standard_normal(TENSOR_VALUES, dtype=np.float32)
            * np.float32(10 ** rng.uniform(-4, -2))
        )
        for i in range(n_tensors)
    }


def run(
    total_mib: int = 100,
    block: int = protocol.DEFAULT_BLOCK,
    reps: int = 5,
    threads: int | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict:
    from dloco.protocol.pieces import DEFAULT_THREADS

    threads = DEFAULT_THREADS if threads is None else threads
    deltas = make_deltas(total_mib << 20)
    x_N = np.concatenate(list(deltas.values()))
    out_N = np.empty_like(x_N)
    memcpy: list[float] = []

    def measure_memcpy() -> None:
        memcpy.append(gbps(x_N.nbytes, memcpy_seconds([x_N], reps)))

    result: dict = {
        "values": int(x_N.size),
        "block": block,
        "threads": threads,
        "reps": reps,
        "codecs": {},
    }
    measure_memcpy()
    for name in protocol.CODEC_NAMES:
        log(f"bench codec: {name} ...")
        codec = protocol.Codec(name, block)
        result["codecs"][name] = _codec_figures(codec, deltas, x_N, out_N, threads, reps)
        measure_memcpy()
    result["memcpy_gbps"] = round(statistics.median(memcpy), 3)
    result.update(_crc32_figures(memoryview(x_N).cast("B"), reps))
    for stats in result["codecs"].values():
        stats["quantize_vs_memcpy"] = round(stats["quantize_gbps"] / result["memcpy_gbps"], 3)
        stats["dequantize_vs_memcpy"] = round(stats["dequantize_gbps"] / result["memcpy_gbps"], 3)
    return result


def _codec_figures(
    codec: protocol.Codec,
    deltas: dict[str, np.ndarray],
    x_N: np.ndarray,
    out_N: np.ndarray,
    threads: int,
    reps: int,
) -> dict:
    """One codec's rates, round-trip error and wire bytes over `x_N` (`deltas` concatenated);
    `out_N` receives the decoded values."""
    encoded = codec.encode(x_N, threads=threads)
    quantize = median_seconds(lambda: codec.encode(x_N, threads=threads), reps)
    dequantize = median_seconds(
        lambda: codec.decode(encoded, x_N.size, out=out_N, threads=threads), reps
    )
    error = float(np.max(np.abs(out_N - x_N)) / np.max(np.abs(x_N)))
    frames = [protocol.encode(message) for message in _delta_chunks(deltas, codec)]
    wire = sum(memoryview(f).nbytes for fs in frames for f in fs)
    messages = list(_delta_chunks(deltas, codec))
    frame_encode = median_seconds(lambda: [protocol.encode(m) for m in messages], reps)
    frame_decode = median_seconds(lambda: [protocol.decode(fs) for fs in frames], reps)
    return {
        "quantize_gbps": round(gbps(x_N.nbytes, quantize), 3),
        "dequantize_gbps": round(gbps(x_N.nbytes, dequantize), 3),
        "roundtrip_max_rel_err": error,
        "wire_bytes_per_param": round(wire / x_N.size, 5),
        "frame_encode_gbps": round(gbps(wire, frame_encode), 3),
        "frame_decode_gbps": round(gbps(wire, frame_decode), 3),
    }


def _crc32_figures(raw: memoryview, reps: int) -> dict:
    """The checksum every payload byte passes three times, against zlib's, over `raw`."""
    crc32 = round(gbps(raw.nbytes, median_seconds(lambda: checksum.crc32(raw), reps)), 3)
    zlib_crc32 = round(gbps(raw.nbytes, median_seconds(lambda: zlib.crc32(raw), reps)), 3)
    return {
        "crc32_gbps": crc32,
        "zlib_crc32_gbps": zlib_crc32,
        "crc32_vs_zlib": round(crc32 / zlib_crc32, 2),
    }


def _delta_chunks(deltas: dict[str, np.ndarray], codec: protocol.Codec):
    plans = protocol.split_fragment(deltas, codec, protocol.DEFAULT_MAX_CHUNK_BYTES)
    fingerprint = protocol.model_fingerprint(deltas)
    for index, plan in enumerate(plans):
        yield protocol.DeltaChunk(
            sender="bench",
            epoch=1,
            seq=index + 1,
            delta_id=1,
            fragment=0,
            base_version=0,
            chunk_index=index,
            chunk_count=len(plans),
            steps=50,
            tokens=50 * 2048,
            model=fingerprint,
            codec=codec,
            slices=plan.slices,
            payloads=plan.payloads,
        )


def summary(result: dict) -> str:
    lines = [
        (
            f"codec benchmark: {result['values']:,} float32 values, block {result['block']},"
            f" {result['threads']} thread(s), median of {result['reps']}; memcpy"
            f" {result['memcpy_gbps']:.2f} GB/s"
        ),
        (
            f"{'codec':6} {'quant GB/s':>10} {'x memcpy':>8} {'dequant GB/s':>12} {'x memcpy':>8} "
            f"{'max rel err':>11} {'wire B/param':>12} {'frame enc':>9} {'frame dec':>9}"
        ),
    ]
    for name, s in result["codecs"].items():
        lines.append(
            f"{name:6} {s['quantize_gbps']:10.2f} {s['quantize_vs_memcpy']:8.2f}"
            f" {s['dequantize_gbps']:12.2f} {s['dequantize_vs_memcpy']:8.2f}"
            f" {s['roundtrip_max_rel_err']:11.2e} {s['wire_bytes_per_param']:12.4f}"
            f" {s['frame_encode_gbps']:9.2f} {s['frame_decode_gbps']:9.2f}"
        )
    lines.append(
        f"crc32 ({checksum.crc32.__module__}) {result['crc32_gbps']:.2f} GB/s, zlib's"
        f" {result['zlib_crc32_gbps']:.2f} GB/s: {result['crc32_vs_zlib']:.1f}x"
    )
    return "\n".join(lines)
