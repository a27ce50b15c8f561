"""What a decoder accepts: the bounds on every size in a message, and the character rules for
identifiers and tensor paths (PROTOCOL.md §3, §4).  Senders honour the same bounds, so that
nothing they emit is refused (`chunking.split_fragment` sizes its chunks by them)."""

from __future__ import annotations

import dataclasses
import re

from dloco.protocol.errors import EncodeError

# sender, region, role, model, target, island, codec, dtype
IDENT = re.compile(r"[A-Za-z0-9._:@-]+")
# tensor paths
PATH = re.compile(r"[A-Za-z0-9._:@/\[\]-]+")
# a result's reason: printable ASCII
REASON = re.compile(r"[ -~]+")
MAX_TOPIC_BYTES = 64
# What a subscriber may subscribe to on a bus (the broker passes nothing else to the publishers,
# PROTOCOL.md §2): everything, or a prefix of the protocol's topics at a fragment or stream number
# below 10,000.  What publishers are asked to filter on is then bounded (about 33,000 topics of at
# most 16 bytes) whatever subscribers send.
SUBSCRIPTION = re.compile(
    rb"|ack|hello|resend|snapshot_request|(?:delta|heartbeat)/(?:[0-9]{1,4}/)?|snapshot/[0-9]{0,4}"
)
# the longest topic SUBSCRIPTION admits: "snapshot_request"
MAX_SUBSCRIPTION_BYTES = 16


def subscribable(topic: bytes) -> bool:
    """Whether a subscription to `topic` is one the protocol's subscribers make."""
    return SUBSCRIPTION.fullmatch(topic) is not None


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces before trusting any size in a header."""

    max_header_bytes: int = 64 * 1024
    # per message, all payload frames together
    max_payload_bytes: int = 64 * 1024 * 1024
    # per chunk
    max_slices: int = 1024
    # chunk_count of one delta or snapshot
    max_chunks: int = 1 << 20
    # values in one tensor
    max_tensor_values: int = 1 << 34
    max_ndim: int = 8
    # sender, region, model, role, codec names
    max_ident_len: int = 64
    max_path_len: int = 256
    # ranges, cursors, results, fragments, codecs
    max_list_len: int = 1024
    max_reason_len: int = 256

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EncodeError(f"Limits.{field.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
