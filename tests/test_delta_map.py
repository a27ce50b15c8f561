"""docs/delta-life.md names real code: every backticked `path.py` followed by a backticked name
(a table row "| `merger/state/core.py` | `MergerCore.offer` | ... |", or the two side by side in
prose) is a file of the checkout that defines that function or class, or that class's method.  Read
with `ast`, nothing imported.  A step table's row must name its function so, and a name that is not
there is reported (the self-check)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "delta-life.md"
# `file.py` then `name` or `Class.method`, side by side or in adjacent table cells
ENTRY = re.compile(r"`([\w./-]+\.py)`\s*(?:\|\s*)?`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")
# a step table's row: | # | `file.py` | ... |
STEP_ROW = re.compile(r"^\|\s*\d+\s*\|\s*`[\w./-]+\.py`\s*\|")
# the page walks both lives: fewer entries means its format changed under this test
MIN_ENTRIES = 60


def entries(text: str) -> list[tuple[int, str, str]]:
    """(line number, file, name) of every file followed by a name."""
    return [
        (number, match.group(1), match.group(2))
        for number, line in enumerate(text.splitlines(), 1)
        for match in ENTRY.finditer(line)
    ]


def malformed_rows(text: str) -> list[str]:
    """Step rows whose file is not followed by one backticked name."""
    return [
        f"line {number}: {line[:100]}"
        for number, line in enumerate(text.splitlines(), 1)
        if STEP_ROW.match(line) and not ENTRY.search(line)
    ]


@functools.cache
def definitions(path: Path) -> frozenset[str]:
    """Module-level functions and classes of a Python file, and `Class.method` for each class's
    methods."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return frozenset(names)


def missing(text: str, root: Path = ROOT) -> list[str]:
    """Each entry whose file does not exist or does not define its name."""
    problems = []
    for number, file, name in entries(text):
        path = root / file
        if not path.is_file():
            problems.append(f"line {number}: {file} does not exist")
        elif name not in definitions(path):
            problems.append(f"line {number}: {file} defines no {name}")
    return problems


def test_the_page_names_its_steps_in_the_strict_format():
    text = PAGE.read_text(encoding="utf-8")
    assert malformed_rows(text) == []
    assert len(entries(text)) >= MIN_ENTRIES


def test_every_named_function_exists_where_the_page_says():
    assert missing(PAGE.read_text(encoding="utf-8")) == []


def test_the_check_reports_a_made_up_name_a_missing_file_and_a_malformed_row():
    text = (
        "| 1 | `merger/state/core.py` | `MergerCore.offer` | real |\n"
        "| 2 | `merger/state/core.py` | `MergerCore.no_such_method` | made up |\n"
        "| 3 | `merger/nowhere.py` | `fold` | no such file |\n"
        "| 4 | `merger/state/core.py` | MergerCore.offer, unquoted | malformed |\n"
        "prose: `island/exchange.py` `rebase` and `island/exchange.py` `NoSuchClass`\n"
    )
    problems = missing(text)
    assert len(problems) == 3, problems
    assert any("defines no MergerCore.no_such_method" in p for p in problems)
    assert any("merger/nowhere.py does not exist" in p for p in problems)
    assert any("defines no NoSuchClass" in p for p in problems)
    assert [p[:7] for p in malformed_rows(text)] == ["line 4:"]
