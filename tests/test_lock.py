"""requirements.lock pins every package pyproject.toml asks for (the install, the test and dev
extras), with hashes: CI and the README's test command install from it, so that a replay's
bit-identity is tied to the jax and numba that ran (merger/engines/dense_loops.py
KERNELS_VERSION)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._\-]*)==([^\s;\\]+)", re.M)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lock_pins_every_requirement_of_the_project_with_hashes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [
        *project["dependencies"],
        *project["optional-dependencies"]["test"],
        *project["optional-dependencies"]["dev"],
    ]
    names = {
        canonical(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])
        for requirement in wanted
        if not requirement.startswith("dloco")
    }
    lock = (ROOT / "requirements.lock").read_text()
    pinned = {canonical(name) for name, _ in PINNED.findall(lock)}
    assert names <= pinned, sorted(names - pinned)
    # every pin carries its hashes
    entries = [e for e in re.split(r"\n(?=\S)", lock) if PINNED.match(e)]
    assert entries and all("--hash=sha256:" in e for e in entries)
    # the replay's kernels: one jax, one numba for this Python
    assert re.search(r"^numba==[\d.]+ ", lock, re.M) and re.search(r"^jax==[\d.]+ ", lock, re.M)
