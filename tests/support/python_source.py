"""Parse Python source for the tests that read the tree (layers, docs, outcome enums).

`ast.parse` on Python 3.11 keeps one recursion counter per interpreter while it builds the
tree's objects. If the garbage collector runs a finalizer in the middle (an asyncio future
left by an earlier test logs its exception) and that finalizer formats a traceback, the
traceback module calls `ast.parse` itself, resets the shared counter, and the outer parse
fails with "AST constructor recursion depth mismatch". Parsing with the collector paused
keeps foreign finalizers out of the parse.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_python(source: str | Path, filename: str | None = None) -> ast.Module:
    """The module's tree; `source` is its text or the path of its file."""
    if isinstance(source, Path):
        filename = filename or str(source)
        source = source.read_text()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename or "<unknown>")
    finally:
        if was_enabled:
            gc.enable()
