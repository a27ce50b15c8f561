"""The documents a newcomer reads: every relative link and image resolves inside the repository
(to a file a fresh clone has, and to a heading that exists), README.md stays short, and no document
dates itself by a work period or an issue number."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# and docs/**/*.md
DOCUMENTS = ("README.md", "EXPERIMENTS.md", "BENCHMARKS.md", "PROTOCOL.md", "CHANGELOG.md")
README_MAX_LINES = 200
# A line that dates itself by a period of work (an ordinal and the word for it) or by an issue
# number says when it was written, not what holds.  The word is spelt in two pieces so that this
# file does not match its own pattern.
_PERIOD = "sess" + "ion"
_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
DATED = re.compile(rf"({_ORDINALS}) {_PERIOD}|issue #[0-9]+|\b{_PERIOD}\b", re.IGNORECASE)

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
# http:, https:, mailto:, ...
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents(root: Path = ROOT) -> list[Path]:
    paths = [root / name for name in DOCUMENTS] + sorted((root / "docs").rglob("*.md"))
    return [path for path in paths if path.exists()]


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    found = []
    for number, line in outside_fences(text):
        line = CODE_SPAN.sub("", line)
        found += [(number, target) for target in INLINE_LINK.findall(line)]
        if definition := REFERENCE_DEFINITION.match(line):
            found.append((number, definition.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading gets -1, -2, ... as on
    GitHub."""
    result, counts = set(), {}
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        if heading := HEADING.match(line):
            base = slug(heading.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def shipped_files(root: Path = ROOT) -> set[Path] | None:
    """Files a fresh clone has (tracked, or new and not ignored); None outside a git checkout."""
    try:
        run = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            check=False,
            cwd=root,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if run.returncode != 0:
        return None
    return {
        root / name for name in run.stdout.decode("utf-8", "surrogateescape").split("\0") if name
    }


def broken_links(path: Path, root: Path = ROOT, shipped: set[Path] | None = None) -> list[str]:
    problems = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if not target or EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(root)}:{number}: {target!r}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if resolved != root and root not in resolved.parents:
            problems.append(f"{where} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where} does not exist")
        elif shipped is not None and resolved.is_file() and resolved not in shipped:
            problems.append(f"{where} is not in the repository (ignored by git)")
        elif (
            shipped is not None
            and resolved.is_dir()
            and not any(resolved in f.parents for f in shipped)
        ):
            problems.append(f"{where} is a folder without a file of the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: {resolved.relative_to(root)} has no heading #{anchor}")
    return problems


def test_the_documents_exist():
    names = {path.relative_to(ROOT).as_posix() for path in documents()}
    assert {*DOCUMENTS, "docs/design.md"} <= names


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_image_resolves_in_the_repository(path: Path):
    assert broken_links(path, ROOT, shipped_files()) == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_document_dates_itself_by_a_work_period_or_an_issue_number(path: Path):
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
        for n, line in enumerate(lines, 1)
        if DATED.search(line)
    ] == []


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    )


def test_the_checker_reports_missing_files_escapes_and_headings(tmp_path: Path):
    """A missing file, a path out of the repository, a missing image and a missing heading are
    reported; external links, links in code and an existing heading (a repeated one too) are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Title\n\n## Running it, by hand\n\n## Running it, by hand\n", encoding="utf-8"
    )
    doc = tmp_path / "docs" / "page.md"
    doc.write_text(
        "[a](missing.md) [b](../../outside.md) ![c](../img/none.png)"
        " [d](../README.md#no-such-heading)\n[e](https://example.org)"
        " [f](../README.md#running-it-by-hand)"
        " [g](../README.md#running-it-by-hand-1)\n`[h](code.md)` [i](#) [j]:"
        " ../README.md\n```\n[k](fenced.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(doc, tmp_path)
    assert len(problems) == 4, problems
    assert any("missing.md" in p and "does not exist" in p for p in problems)
    assert any("outside.md" in p and "outside the repository" in p for p in problems)
    assert any("none.png" in p for p in problems)
    assert any("no heading #no-such-heading" in p for p in problems)


def test_the_dating_pattern():
    assert (
        DATED.search(f"in the eighth {_PERIOD}")
        and DATED.search("see issue " + "#7")
        and DATED.search(f"{_PERIOD.title()} 3")
    )
    assert not DATED.search(f"{_PERIOD}s of training") and not DATED.search("an issue number")


def test_no_source_file_dates_itself_by_a_work_period_or_an_issue_number():
    """Code comments explain the code as it is: the ordinal form and issue numbers never appear in
    .py or .toml files (the bare word is fine there: a POSIX session, a pytest session)."""
    dated = re.compile(rf"({_ORDINALS}) {_PERIOD}|issue #[0-9]+", re.IGNORECASE)
    found = [
        f"{path}:{n}: {line.strip()[:120]}"
        for path in shipped_files() or ()
        if path.suffix in (".py", ".toml")
        for n, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), 1)
        if dated.search(line)
    ]
    assert found == []
