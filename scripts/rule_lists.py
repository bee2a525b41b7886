"""Write every list of rule names from the rule registry, so adding a rule edits none by hand.

    .venv/bin/python scripts/rule_lists.py           # rewrite the lists that differ
    .venv/bin/python scripts/rule_lists.py --check   # exit 1 naming them (tests/test_docs.py)

The names are the registry's (`RULES`, spanguard/detection/rules/__init__.py, in its order)
and then `OTHER_RULES` (the agent scope, the goal verifier, an operator). A detection may name
any of them; a kill signal only those whose decisions may stop an agent (`signals`). Each list
below is the text one pattern finds in its file, rewritten in that file's own style: the
README's rule table, the `rule` enums of the detection and kill-signal schemas, `Rule` in
schemas/decision.py, and the rules each killswitch client accepts (a client that does not know
a rule refuses its signals as invalid).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from spanguard.detection.rules import markdown_table, rule_names

ROOT = Path(__file__).resolve().parent.parent
# Java's line width (the client's code style).
JAVA_WIDTH = 100


def _quoted(names: list[str], quote: str, separator: str, suffix: str = "") -> str:
    return separator.join(f"{quote}{name}{quote}{suffix}" for name in names)


def _java_set(names: list[str]) -> str:
    """`Set.of(...)` filled to the width, continuation lines indented by 10."""
    lines = ["      Set.of("]
    for index, name in enumerate(names):
        item = f'"{name}"' + (");" if index == len(names) - 1 else ",")
        line = lines[-1] + ("" if lines[-1].endswith("(") else " ") + item
        if len(line) > JAVA_WIDTH:
            lines.append(" " * 10 + item)
        else:
            lines[-1] = line
    return "\n".join(lines)


# File -> (pattern whose group 1 is the list, the list's text for the names, signals only?)
Render = Callable[[list[str]], str]
LISTS: dict[str, tuple[str, Render, bool]] = {
    "README.md": (
        r"<!-- rules table[^>]*-->\n(.*?)<!-- end of rules table -->",
        lambda _names: markdown_table(),
        False,
    ),
    "schemas/detection.schema.json": (
        r'\n    "rule": \{ "enum": \[([^\]]*)\] \}',
        lambda names: _quoted(names, '"', ", "),
        False,
    ),
    "schemas/decision.py": (
        r"\nRule = Literal\[\n(.*?)\]\n",
        lambda names: "".join(f'    "{name}",\n' for name in names),
        False,
    ),
    "schemas/kill-signal.schema.json": (
        r'\n    "rule": \{ "enum": \[([^\]]*)\] \}',
        lambda names: _quoted(names, '"', ", "),
        True,
    ),
    "clients/typescript/src/signal.js": (
        r"const RULES = new Set\(\[([^\]]*)\]\)",
        lambda names: _quoted(names, "'", ", "),
        True,
    ),
    "clients/typescript/src/index.d.ts": (
        r"readonly rule: ('[^;]*');",
        lambda names: _quoted(names, "'", " | "),
        True,
    ),
    "clients/go/signal.go": (
        r"\brules\s*=\s*map\[string\]bool\{([^}]*)\}",
        lambda names: _quoted(names, '"', ", ", ": true"),
        True,
    ),
    "clients/java/src/main/java/dev/spanguard/killswitch/Signals.java": (
        r"Set<String> RULES =\n( *Set\.of\([^)]*\);)",
        _java_set,
        True,
    ),
}


def rewritten(path: str, text: str) -> str:
    """`text` (the file at `path`) with its list of rules written from the registry."""
    pattern, render, signals = LISTS[path]
    found = list(re.finditer(pattern, text, re.S))
    if len(found) != 1:
        raise SystemExit(f"rule_lists: {path}: the list of rules was found {len(found)} times")
    start, end = found[0].span(1)
    return text[:start] + render(rule_names(signals=signals)) + text[end:]


def stale() -> list[str]:
    """The files whose list differs from the registry's names."""
    return [
        path
        for path in LISTS
        if rewritten(path, (ROOT / path).read_text()) != (ROOT / path).read_text()
    ]


def main() -> None:
    paths = stale()
    if sys.argv[1:] == ["--check"]:
        if paths:
            sys.exit(f"rule lists not the registry's: {', '.join(paths)}: run {__file__}")
        return
    for path in paths:
        file = ROOT / path
        file.write_text(rewritten(path, file.read_text()))
        print(f"rule_lists: wrote {path}")


if __name__ == "__main__":
    main()
