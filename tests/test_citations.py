"""Every file a module's text names (`merger/fold/merge.py`, `PROTOCOL.md`, ...) exists, from the
checkout's root or beside the module: a renamed file leaves no dead pointer behind.  Placeholders
(`RUN_DIR/report.md`, `OUT/quality.md`, `NAME.md`) and the paths tests build are not citations."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
CITED = re.compile(
    r"(?<![\w/.\-])((?:[A-Za-z_][\w\-]*/)+[\w\-]+\.(?:py|md|toml|yml|yaml|html)|[A-Z][A-Z_]+\.md)"
    r"(?![\w/])"
)


def placeholder(cited: str) -> bool:
    """RUN_DIR/..., OUT/..., NAME.md: a name a reader fills in."""
    first = cited.split("/")[0].removesuffix(".md")
    return first.isupper() and first not in {"README", "PROTOCOL", "BENCHMARKS", "EXPERIMENTS"}


def citations() -> list[tuple[Path, str]]:
    sources = [ROOT / "pyproject.toml", ROOT / "scripts" / "compose-smoke"]
    sources += sorted(p for folder in set(FOLDERS.values()) for p in (ROOT / folder).rglob("*.py"))
    return [
        (source, match.group(1))
        for source in sources
        if "__pycache__" not in source.parts
        for match in CITED.finditer(source.read_text())
        if not placeholder(match.group(1))
    ]


def test_every_file_the_code_cites_exists():
    dead = [
        f"{source.relative_to(ROOT)}: {cited}"
        for source, cited in citations()
        if not ((ROOT / cited).exists() or (source.parent / cited).exists())
    ]
    assert not dead, dead


def test_the_citation_finder_finds_what_it_should():
    found = {cited for _, cited in citations()}
    assert {"PROTOCOL.md", "merger/fold/merge.py", "island/tokenizing.py"} <= found
    assert not any(placeholder(c) for c in found)
    assert placeholder("RUN_DIR/report.md") and not placeholder("PROTOCOL.md")
