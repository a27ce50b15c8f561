"""CRC-32/ISO-HDLC, the checksum of PROTOCOL.md §3.4 (zlib's `crc32`; same values, same chaining).

ISA-L's SIMD implementation (the `isal` package) when it is installed: several times zlib's speed
(BENCHMARKS.md), which matters because every payload byte is checksummed by its sender, by the
merger's decoder and by the merger's log.  zlib's otherwise.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal wheels
    from zlib import crc32

__all__ = ["crc32"]
