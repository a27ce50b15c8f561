"""Error feedback: carry what quantization lost into the next delta (Karimireddy et al. 2019,
EF-SGD; the mechanism that keeps int2 from collapsing in SparseLoCo).

With residual e_t (zero at the start): send Q(d_t + e_t) and keep e_{t+1} = (d_t + e_t) - Q(d_t +
e_t). Summed over rounds, what was sent equals what was meant minus the last residual:
``sum_t Q_t = sum_t d_t - e_T``, so no part of a delta is lost for good, only delayed.
Pure functions: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dloco.protocol.quantization import Codec


def quantize_with_feedback(
    delta_N: np.ndarray, residual_N: np.ndarray | None, codec: Codec
) -> tuple[np.ndarray, np.ndarray]:
    """Encode delta + residual; return (encoded bytes, new residual).  `residual_N` None means
    zero."""
    target_N = np.asarray(delta_N, dtype=np.float32).reshape(-1)
    if residual_N is not None:
        target_N = target_N + residual_N.reshape(-1)
    encoded_U = codec.encode(target_N)
    residual_N = target_N - codec.decode(encoded_U, target_N.size)
    return encoded_U, residual_N.reshape(np.shape(delta_N))


def compensate(
    fragment: Mapping[str, np.ndarray], residuals: Mapping[str, np.ndarray], codec: Codec
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-tensor error feedback over a fragment.

    Returns (what the receiver will decode, new residuals).  Hand the first to
    `chunking.split_fragment`: re-encoding a decoded value reproduces the same codes, and its block
    scales to within one float32 ulp, so the residual stays exact to float32 rounding.
    """
    sent, kept = {}, {}
    for path, delta in fragment.items():
        target = np.asarray(delta, dtype=np.float32) + residuals.get(path, np.float32(0))
        decoded = codec.decode(codec.encode(target.reshape(-1)), target.size).reshape(target.shape)
        sent[path], kept[path] = decoded, target - decoded
    return sent, kept
