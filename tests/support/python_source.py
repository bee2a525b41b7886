"""Parse Python source for the tests that read the tree (layers, docs, outcome enums).

`ast.parse` on Python 3.11 keeps one recursion counter per interpreter while it builds the
tree's objects. If the garbage collector runs a finalizer in the middle (an asyncio future
left by an earlier test logs its exception) and that finalizer formats a traceback, the
traceback module calls `ast.parse` itself, resets the shared counter, and the outer parse
fails with "AST constructor recursion depth mismatch". Parsing with the collector paused
keeps foreign finalizers out of the parse. pytest parses every test module it imports (to
rewrite its asserts), so the test session pauses the collector in every `ast.parse`
(`pause_gc_while_parsing`, called by tests/conftest.py).
"""

from __future__ import annotations

import ast
import functools
import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def pause_gc_while_parsing() -> None:
    """Make `ast.parse` run with the collector paused, on the Pythons whose parser shares one
    recursion counter with a nested parse (3.11 and older)."""
    if sys.version_info >= (3, 12) or getattr(ast.parse, "gc_paused", False):
        return
    parse: Callable[..., Any] = ast.parse

    @functools.wraps(parse)
    def parse_with_gc_paused(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return parse(*args, **kwargs)

    parse_with_gc_paused.gc_paused = True  # type: ignore[attr-defined]
    ast.parse = parse_with_gc_paused


def parse_python(source: str | Path, filename: str | None = None) -> ast.Module:
    """The module's tree; `source` is its text or the path of its file."""
    if isinstance(source, Path):
        filename = filename or str(source)
        source = source.read_text()
    with gc_paused():
        return ast.parse(source, filename or "<unknown>")
