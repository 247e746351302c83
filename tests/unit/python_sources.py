"""Parsing the package's Python files for the tests that read its source (import graph, family isolation)."""

from __future__ import annotations

import ast
from pathlib import Path

#: CPython 3.11's AST-to-object conversion keeps its recursion depth in process-wide state (gh-106905):
#: another thread of the test worker converting an AST at the same moment (a compile left running by an
#: earlier test) makes `ast.parse` raise this SystemError for a file that parses fine alone.
AST_DEPTH_RACE = "AST constructor recursion depth mismatch"


def parse_python(path: Path) -> ast.Module:
    """`ast.parse` of `path`, parsed again (up to 3 times) when it hits `AST_DEPTH_RACE`."""
    source = path.read_text()
    for attempt in range(3):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError as error:
            if AST_DEPTH_RACE not in str(error) or attempt == 2:
                raise
    raise AssertionError("unreachable")
