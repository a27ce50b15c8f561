"""Shared by the task plug-in tests: the repository's digits example, a TaskContext for it, and
`dloco` run as a command from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dloco.island.task import TaskContext

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "digits.py"


def context(island_index=0, islands=1, batch=32, **options) -> TaskContext:
    return TaskContext(
        island_index=island_index,
        islands=islands,
        seed=0,
        batch=batch,
        max_steps=10,
        options=options,
    )


def dloco(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
