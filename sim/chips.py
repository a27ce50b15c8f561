"""Chips: the vendors' published bf16 peak FLOP/s (dense), for step times from FLOPs.

Sources (docs/planning.md gives the pages):
- TPU v6e (Trillium): 918 TFLOP/s bf16 per chip; TPU v5p: 459; TPU v5e: 197 (Google Cloud TPU
  documentation, each version's page).
- NVIDIA H100 SXM: 989 TFLOP/s bf16 dense (the data sheet's 1,979 is with 2:4 sparsity); A100 SXM:
  312 (NVIDIA data sheets).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    # peak, dense, per chip
    bf16_flops: float


CHIPS = {
    chip.name: chip
    for chip in (
        Chip("tpu-v6e", 918e12),
        Chip("tpu-v5p", 459e12),
        Chip("tpu-v5e", 197e12),
        Chip("h100", 989e12),
        Chip("a100", 312e12),
    )
}
