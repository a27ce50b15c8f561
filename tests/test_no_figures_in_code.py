"""No measured figure in the library's docstrings and comments: a docstring or a comment says what
the code does and why; what a run measured (a rate, a time, "5-25x slower", a date) belongs in
BENCHMARKS.md or CHANGELOG.md, where it keeps its context and does not go stale in the code.

Only docstrings (a string standing as a statement) and comments are read, never code: a default
such as `lease_s = 3.0` or a string the code uses is no figure.  A unit with no number ("seconds")
is no figure either, nor is a size that defines behaviour ("chunks of at most 1 MiB").  ALLOWED
lists the few figures that are definitions, each with its reason.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# every package of pyproject.toml but the benchmarks and the experiment suites, which measure
NOT_LIBRARY = {"benchmarks", "suites"}
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = sorted(set(PACKAGES.values()) - NOT_LIBRARY)

_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:\s?[-–]\s?\d[\d,]*(?:\.\d+)?)?"
FIGURE = re.compile(
    "|".join(
        (
            # a rate: 1.8 GB/s, 2 Gbit/s, 5.6 steps/s
            rf"{_NUMBER}\s?(?:[kKMGT]i?B|[kKMGT]?bit|bytes|B|steps|tokens|values)/s\b",
            # a time below a second: 40 ms, 0.35 ns a parameter, 12 µs
            rf"{_NUMBER}\s?(?:ms|µs|us|ns)\b",
            # a measured ratio: 5-25x slower, 2x faster, 30 % slower
            rf"{_NUMBER}\s?(?:x|×|%)\s+(?:slower|faster|quicker)\b",
            # a measurement on this machine: "4-7x zlib's on this machine"
            rf"{_NUMBER}[^.;]{{0,80}}\bon this (?:machine|VM)\b",
            # what a run peaked at or took: "peaked at 7.3 GB", "took 3.5 s", "take about 50 s"
            # (the word alone, so that a figure after it is matched too)
            r"\b(?:peak(?:ed|s)?|took|takes?)(?=\s+(?:at\s+)?(?:about\s+)?~?\d)",
            # a date: history
            r"\b20\d\d-\d\d-\d\d\b",
        )
    )
)

# (file, phrase): a figure inside the phrase is allowed; each with the reason it is a definition.
ALLOWED = {
    # the interval the code retries binding at (bus/subscriptions.py's constant)
    ("bus/subscriptions.py", "tries, 50 ms apart"),
    # a worked example of the conversion the function makes (cores to microseconds a period)
    ("cluster/cpuquota.py", "45,000 us per 100,000 us"),
    # the kernel's own bound on a CFS quota, which the code checks against
    ("cluster/cpuquota.py", "under 1 ms per period"),
    # the published seed scenario's links and round trips, as the preset sets them
    ("sim/presets.py", "over 2-5 Gbit/s"),
    ("sim/presets.py", "RTTs 20-70 ms"),
    # the preset's assumed merger speed for a server (a setting of the scenario, not measured here)
    ("sim/presets.py", "a merger folding 10 GB/s"),
}


def documentation(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring (a string standing as a statement) and of every block of
    comments on consecutive lines, whitespace collapsed so that a figure split across lines is
    still one; code is never read."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        # a lambda's body is one expression, not statements
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                texts.append((statement.lineno, statement.value.value))
    block: list[str] = []
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row = token.start[0]
        if block and row != last + 1:
            texts.append((start, "\n".join(block)))
            block = []
        if not block:
            start = row
        block.append(token.string.lstrip("#"))
        last = row
    if block:
        texts.append((start, "\n".join(block)))
    return [(line, " ".join(text.split())) for line, text in texts]


def figures(text: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """The measured figures in `text`, but those inside one of the `allowed` phrases."""
    spans = [
        (found.start(), found.start() + len(phrase))
        for phrase in allowed
        for found in re.finditer(re.escape(phrase), text)
    ]
    return [
        found.group(0)
        for found in FIGURE.finditer(text)
        if not any(lo <= found.start() and found.end() <= hi for lo, hi in spans)
    ]


@functools.cache
def library_documentation() -> dict[str, list[tuple[int, str]]]:
    """Per library module (its path from the checkout's root), `documentation` of it."""
    paths = sorted(
        path
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    )
    return {path.relative_to(ROOT).as_posix(): documentation(path.read_text()) for path in paths}


def test_no_measured_figure_in_docstrings_or_comments():
    found = []
    for name, texts in library_documentation().items():
        allowed = tuple(phrase for file, phrase in ALLOWED if file == name)
        for line, text in texts:
            found += [f"{name}:{line}: {figure!r}" for figure in figures(text, allowed)]
    assert not found, (
        "measured figures belong in BENCHMARKS.md or CHANGELOG.md; say what the code does and why"
        f" instead: {found}"
    )


def test_every_allowed_phrase_is_still_there():
    texts = library_documentation()
    stale = [
        (file, phrase)
        for file, phrase in ALLOWED
        if not any(phrase in text and figures(text) for _, text in texts.get(file, []))
    ]
    assert not stale, stale


def test_the_detector_flags_figures_and_passes_definitions():
    assert figures("took 40 ms against 15 ms") == ["took", "40 ms", "15 ms"]
    assert figures("logs before 2026-12-03 had another map") == ["2026-12-03"]
    assert figures("a generic loop was 5-25x slower") == ["5-25x slower"]
    assert figures("on this project's VM, ~0.7 GB/s") == ["~0.7 GB/s"]
    assert figures("at 350m it peaked at 7.3 GB instead of 14")
    assert figures("4-7x zlib's on this machine")
    assert figures("48 evaluations take about 50 s") == ["take"]
    assert figures("a step against 15 ms", ("against 15 ms",)) == []
    for definition in (
        "chunks of at most 1 MiB",
        "the lease, in seconds",
        "int4 codes, lr 0.7, H = 12, queue_bytes 1 GiB",
        "a ZMTP ping every HEARTBEAT_IVL_MS",
        "8x smaller than float32 at int4",
    ):
        assert figures(definition) == [], definition


def test_only_docstrings_and_comments_are_read():
    source = (
        '"""A module: 40 ms a step."""\n'
        "TIMEOUT_MS = 40\n"
        'UNIT = "40 ms"\n'
        "# 2026-12-03\n"
        "def f():\n"
        '    """Takes 1.8 GB/s."""\n'
        '    return "5x slower"\n'
    )
    found = [figure for _, text in documentation(source) for figure in figures(text)]
    assert sorted(found) == ["1.8 GB/s", "2026-12-03", "40 ms"]
