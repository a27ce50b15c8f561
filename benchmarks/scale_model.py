"""The synthetic models of `dloco bench scale`: sizes as the command line writes them, GPT-like
tensor shapes that add up to a size, their values, and the process's peak resident memory.

The shapes follow GPT-2's block (attention, MLP, two layer norms) with the byte-level vocabulary
of this project's own model, so that a model of N parameters is cut into as many tensors, of the
same kinds, as a real one: a few large matrices per block and many small vectors.  Depth grows
with the cube root of the size (GPT-2: 12 blocks of width 768 at 124 M, width = 64 x depth);
width is 64 x depth; the MLP's hidden width takes what is left, so the total lands within one
hidden unit per block (a few hundredths of a percent) below the size asked for.
"""

from __future__ import annotations

import re
import resource
import sys

import numpy as np

from dloco.protocol.errors import ConfigError

# bytes, as island/config.py's ModelConfig
VOCAB = 256
# positions
CONTEXT = 1024
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMG]?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}


def parse_sizes(text: str) -> list[tuple[str, int]]:
    """'10M,50M,1.5G,2000' -> [(label, parameters), ...] in the order given (decimal units)."""
    sizes = []
    for label in (part.strip() for part in text.split(",")):
        match = _SIZE.fullmatch(label)
        if match is None:
            raise ConfigError(
                f"model size {label!r} is not a number with an optional K, M or G (e.g. 125M)"
            )
        params = round(float(match.group(1)) * _UNITS[match.group(2).upper()])
        if params < 1:
            raise ConfigError(f"model size {label!r} must be at least 1 parameter")
        sizes.append((label, params))
    if not sizes:
        raise ConfigError("no model size given")
    if len({params for _, params in sizes}) < len(sizes):
        raise ConfigError(
            f"model sizes must differ (a fit over sizes needs distinct ones), got {text!r}"
        )
    return sizes


def depth_for(params: int) -> int:
    """Blocks of a GPT-like model of `params` parameters: width 64 x depth and 12 width^2 per
    block make params ~ 12 * 64^2 * depth^3 = 49152 depth^3."""
    return max(2, round((params / 49152) ** (1 / 3)))


def block_shapes(index: int, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """One Transformer block: 4 width^2 + 2 width*hidden + 9 width + hidden parameters."""
    prefix = f"blocks/{index:02d}"
    return {
        f"{prefix}/ln1/scale": (width,),
        f"{prefix}/ln1/bias": (width,),
        f"{prefix}/attn/qkv/kernel": (width, 3 * width),
        f"{prefix}/attn/qkv/bias": (3 * width,),
        f"{prefix}/attn/out/kernel": (width, width),
        f"{prefix}/attn/out/bias": (width,),
        f"{prefix}/ln2/scale": (width,),
        f"{prefix}/ln2/bias": (width,),
        f"{prefix}/mlp/in/kernel": (width, hidden),
        f"{prefix}/mlp/in/bias": (hidden,),
        f"{prefix}/mlp/out/kernel": (hidden, width),
        f"{prefix}/mlp/out/bias": (width,),
    }


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """GPT-like tensor shapes with at most `params` parameters and less than one hidden unit per
    block short of it (see the module docstring).  Raises ConfigError below the smallest such model.
    """
    depth = depth_for(params)
    width = 64 * depth
    # all but the MLP's hidden units
    fixed = depth * (4 * width * width + 9 * width) + (VOCAB + CONTEXT + 2) * width
    hidden = (params - fixed) // (depth * (2 * width + 1))
    if hidden < 1:
        smallest = fixed + depth * (2 * width + 1)
        raise ConfigError(
            f"a model of {params:,} parameters is too small for {depth} blocks of width {width} (at"
            f" least {smallest:,})"
        )
    shapes = {"embed/tokens": (VOCAB, width), "embed/positions": (CONTEXT, width)}
    for index in range(depth):
        shapes.update(block_shapes(index, width, hidden))
    shapes.update({"final_ln/scale": (width,), "final_ln/bias": (width,)})
    return shapes


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values())


def init_params(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Float32 values of scale 0.02 (GPT-2's init).  Random, not zeros: zero pages are not resident
    until written, and the memory figures must see every parameter."""
    rng = np.random.default_rng(seed)
    params = {}
    for path, shape in shapes.items():
        value = rng.standard_normal(shape, dtype=np.float32)
        value *= np.float32(0.02)
        params[path] = value
    return params


def _status_kib(field: str) -> int | None:
    """A memory field of /proc/self/status in KiB (Linux); None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def available_bytes() -> int | None:
    """Memory the kernel could give without swapping (MemAvailable, Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _ru_maxrss_kib() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # bytes on macOS, KiB on Linux
    return peak // 1024 if sys.platform == "darwin" else peak


def restart_peak_rss() -> int:
    """This process's resident set now (KiB), from which `peak_rss_kib` measures anew.

    A spawned process is a fork of its parent until it execs, and getrusage's ru_maxrss keeps the
    larger of the old and the new program's peaks: a child of a conductor holding gigabytes would
    start at those.  Linux's VmHWM is the peak of the process's own memory map, and writing 5 to
    /proc/self/clear_refs restarts it from the current resident set.  Elsewhere ru_maxrss stands in
    (and the baseline then is that peak, not the current size)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return _ru_maxrss_kib()
    return _status_kib("VmRSS") or _ru_maxrss_kib()


def peak_rss_kib() -> int:
    """This process's peak resident set (KiB) since `restart_peak_rss` (see there)."""
    return _status_kib("VmHWM") or _ru_maxrss_kib()


class PeakRises:
    """How much each phase raised the peak resident set (KiB), summed over its occurrences, in the
    order they first ran: the rises add up to the peak above the baseline, and the last phase that
    rose is the one that set the peak."""

    def __init__(self) -> None:
        self.baseline = self.last = restart_peak_rss()
        self.kib: dict[str, int] = {}

    def after(self, phase: str) -> None:
        # the kernel's per-thread counters lag by a few pages: never a fall
        peak = max(self.last, peak_rss_kib())
        self.kib[phase] = self.kib.get(phase, 0) + peak - self.last
        self.last = peak

    def figures(self) -> dict:
        return {"baseline": self.baseline, "peak": self.last, "rises": dict(self.kib)}


def bytes_per_param(peak_kib: int, baseline_kib: int, params: int) -> float:
    """Peak resident memory above the baseline, per parameter."""
    return (peak_kib - baseline_kib) * 1024 / params
