"""The tree-reading tests parse source with the collector paused: a finalizer that parses
too (traceback formatting does, on Python 3.11) must not break the outer parse. And no
function outside bench/ and tests/ is over 80 lines."""

from __future__ import annotations

import ast
import gc
import tomllib
from pathlib import Path

from tests.support.python_source import parse_python

SOURCE = Path(__file__).resolve().parents[1] / "spanguard" / "detection" / "guard.py"


class ParsesWhenCollected:
    def __init__(self) -> None:
        self.cycle = self  # only the collector frees it, at a moment it chooses

    def __del__(self) -> None:
        ast.parse("x = (1 + 2) * 3")


def test_a_finalizer_that_parses_does_not_break_a_parse() -> None:
    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        for _ in range(20):
            garbage = [ParsesWhenCollected() for _ in range(200)]
            del garbage
            tree = parse_python(SOURCE)
            assert any(isinstance(node, ast.ClassDef) for node in tree.body)
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    assert gc.isenabled()


# -- no long functions --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80


def _source_files() -> list[Path]:
    """Every Python file of the project outside bench/ and tests/: the installed folders
    (pyproject's package-dir), scripts/ and the files at the top of the tree."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    folders = sorted({*package_dirs.values(), "scripts"})
    files = [path for folder in folders for path in (ROOT / folder).rglob("*.py")]
    return sorted({*files, *ROOT.glob("*.py")})


def long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method over `limit` lines, from `def` to its end."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_over_80_lines() -> None:
    files = _source_files()
    assert ROOT / "spanguard" / "detection" / "guard.py" in files
    assert ROOT / "scripts" / "realruns" / "extract_tau2.py" in files
    found = [
        f"{path.relative_to(ROOT)}: {name} is {lines} lines"
        for path in files
        for name, lines in long_functions(parse_python(path))
    ]
    assert not found, f"split into helpers (at most {MAX_FUNCTION_LINES} lines):\n" + "\n".join(
        found
    )


def test_the_length_check_sees_a_long_function() -> None:
    """A function of 81 lines is found, one of 80 is not (the check above is not vacuous)."""
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    tree = parse_python(f"def at_limit():\n{body}\nasync def over():\n{body}    return x0\n")
    assert long_functions(tree) == [("over", 81)]
