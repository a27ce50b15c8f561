"""Typed, frozen configuration of an island; every value validated with the offender named."""

from __future__ import annotations

import dataclasses

from dloco.protocol import CODEC_NAMES, DEFAULT_MAX_CHUNK_BYTES

# re-exported: the error these configs raise
from dloco.protocol.errors import ConfigError as ConfigError
from dloco.protocol.errors import require as _require
from dloco.protocol.shards import DEFAULT_FRAGMENTS
from dloco.protocol.sparse import MIN_SPARSE_BLOCK, SPARSE_BITS

ADOPTIONS = ("rebase", "replace")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only byte-level Transformer."""

    # bytes
    vocab: int = 256
    # model dimension
    width: int = 128
    # Transformer blocks
    depth: int = 4
    heads: int = 4
    # tokens (bytes) per sequence
    context: int = 128
    mlp_ratio: int = 4
    # the output head reuses the token embedding (GPT-2 does)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "depth", "heads", "context", "mlp_ratio"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"model.{name} must be a positive int, got {value!r}",
            )
        _require(
            self.width % self.heads == 0,
            f"model.width {self.width} must be a multiple of model.heads {self.heads}",
        )
        _require(
            type(self.tie_embeddings) is bool,
            f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}",
        )


# The built-in LM's sizes (`--model-size`, `[model] size`).  tiny is the default; 124m and 350m are
# GPT-2 small and medium in shape (a BPE vocabulary of 50,257 ids, tied embeddings, 1,024
# positions).
MODEL_SIZES: dict[str, dict] = {
    # 0.87 M parameters with bytes
    "tiny": dict(width=128, depth=4, heads=4, context=128),
    # 4.9 M
    "small": dict(width=256, depth=6, heads=8, context=256),
    # 25.7 M
    "base": dict(width=512, depth=8, heads=8, context=512),
    # 124.4 M
    "124m": dict(vocab=50257, width=768, depth=12, heads=12, context=1024, tie_embeddings=True),
    # 354.7 M
    "350m": dict(vocab=50257, width=1024, depth=24, heads=16, context=1024, tie_embeddings=True),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Inner optimizer (AdamW) and run length."""

    # sequences per step (global, split over local devices)
    batch: int = 16
    # peak learning rate
    lr: float = 3e-3
    # steps of linear warmup
    warmup: int = 50
    # "cosine" (to 10 % of peak at max_steps) | "constant"
    schedule: str = "cosine"
    max_steps: int = 600
    weight_decay: float = 0.01
    # global gradient-norm clip
    clip: float = 1.0
    # steps between evaluations
    eval_every: int = 50
    # also at steps 1, 2, 4, 8, ... below eval_every (when the loss falls fastest)
    eval_early: bool = False
    # copy the parameters after each of the first N steps; evaluate them once training is over
    eval_trace: int = 0
    seed: int = 0
    # the cluster's token budget (0: none): the rate decays over the cluster's tokens, not this
    # island's steps (island/schedule.py)
    budget_tokens: int = 0

    def __post_init__(self) -> None:
        _require(
            isinstance(self.batch, int) and self.batch >= 1,
            f"train.batch must be a positive int, got {self.batch!r}",
        )
        _require(0 < self.lr < 1, f"train.lr must be in (0, 1), got {self.lr}")
        _require(
            self.schedule in ("cosine", "constant"),
            f"train.schedule must be 'cosine' or 'constant', got {self.schedule!r}",
        )
        _require(
            isinstance(self.max_steps, int) and self.max_steps >= 1,
            f"train.max_steps must be a positive int, got {self.max_steps!r}",
        )
        _require(
            isinstance(self.warmup, int) and 0 <= self.warmup,
            f"train.warmup must be an int >= 0, got {self.warmup!r}",
        )
        _require(self.clip > 0, f"train.clip must be > 0, got {self.clip}")
        _require(
            isinstance(self.eval_every, int) and self.eval_every >= 1,
            f"train.eval_every must be a positive int, got {self.eval_every!r}",
        )
        _require(
            isinstance(self.eval_trace, int) and self.eval_trace >= 0,
            f"train.eval_trace must be an int >= 0, got {self.eval_trace!r}",
        )
        _require(
            type(self.budget_tokens) is int and self.budget_tokens >= 0,
            f"train.budget_tokens must be an int >= 0, got {self.budget_tokens!r}",
        )


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How the island exchanges fragments with the merger."""

    # P
    fragments: int = DEFAULT_FRAGMENTS
    # H: each fragment is due every H inner steps
    interval: int = 50
    codec: str = "int4"
    block: int = 256
    # a snapshot arriving between sends: "rebase" keeps the island's unsent work on top, "replace"
    # drops it
    adoption: str = "rebase"
    # adoption "replace": theta <- alpha*theta + (1-alpha)*Theta (0: overwrite)
    alpha: float = 0.0
    error_feedback: bool = False
    # payload bytes per delta chunk
    chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    # chunks kept until the merger's cursor covers them
    retransmit_messages: int = 4096
    # ... and their bytes; when full, the publisher waits (backpressure)
    retransmit_bytes: int = 256 << 20
    # chunks queued per subscriber before PUB drops (recovered by resend)
    send_hwm: int = 1000
    # synchronous baselines: after sending a delta, wait for the fold that includes it
    blocking: bool = False
    # stop asking for the result of a delta after this (the merger does not know it)
    settle_timeout_s: float = 60.0
    # Leaving, send every fragment's unsent work.  Off by default: each arrives as a fold of its
    # own, and such a burst of small Nesterov folds can leave the merger's model worse, much worse
    # at H = 96 (docs/experiments-archive.md, "Flushing on leave").
    flush_on_leave: bool = False

    def __post_init__(self) -> None:
        _require(
            type(self.fragments) is int and self.fragments >= 1,
            f"sync.fragments must be a positive int, got {self.fragments!r}",
        )
        _require(
            type(self.interval) is int and self.interval >= self.fragments,
            f"sync.interval (H={self.interval}) must be an int >= sync.fragments"
            f" (P={self.fragments})",
        )
        _require(
            self.codec in CODEC_NAMES,
            f"sync.codec must be one of {CODEC_NAMES}, got {self.codec!r}",
        )
        _require(
            self.error_feedback or self.codec not in SPARSE_BITS,
            f"sync.codec = {self.codec!r} keeps 1/32 of each block: it needs sync.error_feedback ="
            " true, which carries the rest into later deltas",
        )
        _require(
            self.codec not in SPARSE_BITS or self.block >= MIN_SPARSE_BLOCK,
            f"sync.codec = {self.codec!r} needs sync.block >= {MIN_SPARSE_BLOCK}, got {self.block}",
        )
        _require(
            self.adoption in ADOPTIONS,
            f"sync.adoption must be one of {ADOPTIONS}, got {self.adoption!r}",
        )
        _require(
            type(self.flush_on_leave) is bool,
            f"sync.flush_on_leave must be true or false, got {self.flush_on_leave!r}",
        )
        _require(0 <= self.alpha < 1, f"sync.alpha must be in [0, 1), got {self.alpha}")
        _require(
            self.alpha == 0 or self.adoption == "replace",
            f"sync.alpha ({self.alpha}) blends only with sync.adoption 'replace'",
        )
        _require(
            type(self.settle_timeout_s) in (int, float)
            and 0 < self.settle_timeout_s < float("inf"),
            f"sync.settle_timeout_s must be a number of seconds > 0, got {self.settle_timeout_s!r}",
        )
