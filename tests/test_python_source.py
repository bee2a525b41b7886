"""The tree-reading tests parse source with the collector paused: a finalizer that parses
too (traceback formatting does, on Python 3.11) must not break the outer parse."""

from __future__ import annotations

import ast
import gc
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
