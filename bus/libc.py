"""glibc's memory calls, where the C library has them: the merger tunes its allocator
(merger/memory.py), the broker hands freed subscriptions back (bus/subscriptions.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def function(name: str):
    """The C library's function `name` (e.g. "mallopt", "malloc_trim"), or None where there is no
    such function (macOS, musl) or no C library to be found."""
    library = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(library), name, None) if library else None
