"""How the source reads, checked on every .py file of the checkout (tests/test_layering.py's list),
where ruff cannot say it (.ci/run runs `ruff check`, lines within 100 columns included, and
`ruff format --check`):

- comments on their own line above the code they explain, not at the end of a code line (tool
  directives such as `# noqa: X` and `# type: ignore` stay where their tool reads them);
- no function or method over 60 lines unless the comment block right above it (above its
  decorators) says why, starting `# Over 60 lines:`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

from tests.test_layering import ROOT, every_python_file

MAX_FUNCTION_LINES = 60
REASON = "# Over 60 lines:"
DIRECTIVE = re.compile(r"#\s*(noqa|type:|pragma|fmt:)")


def end_of_line_comments(text: str) -> list[int]:
    """Rows whose comment follows code on the same line, tool directives aside."""
    lines = text.splitlines()
    return [
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
        and lines[token.start[0] - 1][: token.start[1]].strip()
        and not DIRECTIVE.match(token.string)
    ]


def unexplained_long_functions(text: str) -> list[str]:
    """`name:first row` of each function over 60 lines without a `# Over 60 lines:` comment in the
    block of comment lines right above it."""
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.end_lineno - node.lineno + 1 <= MAX_FUNCTION_LINES:
            continue
        row = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        above = []
        while row >= 1 and lines[row - 1].lstrip().startswith("#"):
            above.append(lines[row - 1].strip())
            row -= 1
        if not any(line.startswith(REASON) for line in above):
            found.append(f"{node.name}:{node.lineno}")
    return found


def offenders(rule) -> dict[str, list]:
    found = {}
    for path in every_python_file():
        if hits := rule(path.read_text()):
            found[str(path.relative_to(ROOT))] = hits
    return found


def test_comments_sit_above_the_code_they_explain():
    assert not offenders(end_of_line_comments)


def test_no_function_is_over_60_lines_without_a_reason_above_it():
    assert not offenders(unexplained_long_functions)


def test_the_rules_catch_what_they_are_for():
    """Guards the guards, on hand-written source."""
    text = "x = 1  # one\n# above\ny = 2\nz = 3  # noqa: E501\nw = '# not a comment'\n"
    assert end_of_line_comments(text) == [1]
    body = "".join(f"    x{n} = {n}\n" for n in range(60))
    long = "def f():\n" + body
    assert len(long.splitlines()) == 61
    assert unexplained_long_functions(long) == ["f:1"]
    assert unexplained_long_functions("def f():\n" + body[: -len("    x59 = 59\n")]) == []
    reasoned = "# Over 60 lines: one table, in its order.\n@decorated\n" + long
    assert unexplained_long_functions(reasoned) == []
    # a reason separated from the function by code does not count
    assert unexplained_long_functions(f"{REASON} x\ny = 1\n" + long) == ["f:3"]
