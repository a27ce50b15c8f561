"""PROTOCOL.md and protocol/ agree: the version, the limits, the reasons, the worked example, and
the chunking and reassembly constants the document states."""

from __future__ import annotations

import pathlib
import re

import numpy as np

from dloco import protocol
from dloco.protocol.chunking import HEADER_RESERVE_BYTES, slice_header_bound
from dloco.protocol.reassembly import CHUNK_OVERHEAD_BYTES, SLICE_OVERHEAD_BYTES

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = (ROOT / "PROTOCOL.md").read_text()


def section(number: str) -> str:
    """The text of section `number` ("3.1", "4", ...) up to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(number)}\.? .*?(?=^#)", SPEC + "\n#", re.S | re.M)
    assert match, number
    return match.group(0)


def test_every_place_names_the_same_version():
    version = protocol.PROTOCOL_VERSION
    assert SPEC.startswith(f"# The dloco wire protocol, version {version}\n")
    assert f"| `v` | uint | protocol version, `{version}` |" in section("3.1")
    assert f"`v` is not the integer {version}" in section("4")
    assert re.findall(r"^\| (\d+) \|", section("9"), re.M)[-1] == str(version)


def test_the_limits_are_the_documented_ones():
    limits = protocol.DEFAULT_LIMITS
    assert (limits.max_header_bytes, limits.max_payload_bytes) == (65_536, 64 << 20)
    assert "at most 65,536 bytes" in section("2") and "(default 64 MiB)" in section("4")
    assert (
        limits.max_slices == limits.max_list_len == 1024
        and "holds at most 1,024\nentries" in section("3")
    )
    assert (limits.max_chunks, limits.max_tensor_values, limits.max_ndim) == (1 << 20, 1 << 34, 8)
    assert (limits.max_ident_len, limits.max_path_len, limits.max_reason_len) == (64, 256, 256)


def test_every_reason_the_code_raises_is_documented_and_no_other():
    source = "".join(path.read_text() for path in (ROOT / "protocol").glob("*.py"))
    raised = set(re.findall(r'ProtocolError\(\s*"([a-z_]+)"', source)) | {
        "inconsistent",
        "reassembly_budget",
    }
    decode_table = set(re.findall(r"^\| `([a-z_]+)`(?: / `([a-z_]+)`)? \|", section("4"), re.M))
    documented = {reason for row in decode_table for reason in row if reason}
    assert raised - {"inconsistent", "reassembly_budget"} == documented
    assert all(f"`{reason}`" in section("7") for reason in ("inconsistent", "reassembly_budget"))


def test_the_worked_example_is_what_the_codec_writes():
    record = re.search(r"The record is `([0-9a-f ]+)`", section("5")).group(1)
    x = np.array([7, -7, 3.5, 1, 0, -2, 6.5, 0.5], dtype=np.float32)
    assert protocol.Codec("int4", 8).encode(x).tobytes() == bytes.fromhex(record)


def test_the_chunking_and_reassembly_constants_are_the_documented_ones():
    text = section("7")
    assert "`88 + len(path) + 9 × ndim`" in text and slice_header_bound("ab", 3) == 88 + 2 + 27
    assert (
        f"{65_536 - HEADER_RESERVE_BYTES:,} header bytes" in text
        and f"{HEADER_RESERVE_BYTES:,} bytes kept" in text
    )
    assert (
        f"plus {CHUNK_OVERHEAD_BYTES:,} bytes, plus {SLICE_OVERHEAD_BYTES:,} bytes\nper slice"
        in text
    )
    reassembler = protocol.Reassembler()
    assert (
        reassembler.ttl_s,
        reassembler.max_bytes,
        reassembler.max_partials,
        reassembler.remember,
    ) == (60.0, 256 << 20, 1024, 4096)
    assert (
        "(reference:\n60 s)" in text
        and "256 MiB" in text
        and "At most 1,024 incomplete" in text
        and "last 4,096 delivered" in text
    )
