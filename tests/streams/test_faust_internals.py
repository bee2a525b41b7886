"""The one door to Faust's, mode's and aiokafka's private parts (streams/faust_internals.py).

No other module of the project touches a private member of those libraries: read off the
source with `ast`. A private member is a `_name` (not a dunder) that the installed libraries
define (a method, an attribute they assign, a class attribute) or asyncio's queues do (mode's
queues are asyncio queues). A module may use such a name only on `self`, `cls` or `super()`,
and only when the project defines that name itself (its own method or attribute, which may
happen to share a library's name). Reaching one by a string (`getattr(x, "_name")`) or
importing one (`from faust.streams import _current_event`) counts too. The tests are not
read: they may poke at the libraries to build their cases.

The door refuses to import at versions it was not written for, and those are the pins of
constraints.txt.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from spanguard.streams import faust_internals
from spanguard.streams.faust_internals import WRITTEN_FOR, UntestedLibraryVersions, check_versions
from tests.support.python_source import parse_python

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("faust", "mode", "aiokafka")
DOOR = ROOT / "streams" / "faust_internals.py"
RECEIVERS_OF_OUR_OWN = {"self", "cls"}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> Iterator[str]:
    """The private names a module defines: functions, classes, attributes it assigns (on any
    object) and class or module level names."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id


def library_files() -> Iterator[Path]:
    for name in LIBRARIES:
        module = importlib.import_module(name)  # (Faust's is lazy: no __spec__ to look up)
        assert module.__file__ is not None, name
        yield from sorted(Path(module.__file__).parent.rglob("*.py"))
    assert asyncio.queues.__file__ is not None
    yield Path(asyncio.queues.__file__)


@cache
def library_private_names() -> frozenset[str]:
    names: set[str] = set()
    for path in library_files():
        names.update(n for n in defined_names(parse_python(path)) if private(n))
    return frozenset(names)


def project_files() -> list[Path]:
    """Every module of the installed package (the folders pyproject maps), the benchmarks and
    the scripts."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    folders = [*package_dirs.values(), "bench", "scripts"]
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


@cache
def project_private_names() -> frozenset[str]:
    names: set[str] = set()
    for path in project_files():
        if path != DOOR:
            names.update(n for n in defined_names(parse_python(path)) if private(n))
    return frozenset(names)


def is_our_own_receiver(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RECEIVERS_OF_OUR_OWN
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def touches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) of each touch of a library's private member in a module."""
    theirs, ours = library_private_names(), project_private_names()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and node.attr in theirs:
            if not (is_our_own_receiver(node.value) and node.attr in ours):
                yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr", "delattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
            and node.args[1].value in theirs
        ):
            yield node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            for alias in node.names:
                if private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"


def test_the_libraries_private_names_are_found() -> None:
    # What the door itself touches: if these are not found, the check below finds nothing.
    assert {"_current_event", "_unacked_messages", "_coordinator", "_do_heartbeat"} <= (
        library_private_names()
    )


def test_only_the_door_touches_faust_mode_and_aiokafka_private_members() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in project_files()
        if path != DOOR
        for line, what in touches(parse_python(path))
    ]
    assert not found, (
        "private members of Faust, mode or aiokafka touched outside"
        " streams/faust_internals.py (add a named function there):\n" + "\n".join(found)
    )


def test_the_check_finds_a_touch_outside_the_door() -> None:
    tree = ast.parse(
        "from faust.streams import _current_event\n"
        "def f(app, self):\n"
        "    app.consumer._unacked_messages.clear()\n"
        "    getattr(app.flow_control, '_queues')\n"
        "    self._do_heartbeat()\n"  # the library's, not the project's own
    )
    assert sorted(line for line, _ in touches(tree)) == [1, 3, 4, 5]


def test_the_door_touches_the_libraries_private_members() -> None:
    assert list(touches(parse_python(DOOR)))  # else the check reads the wrong names


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def test_the_door_is_written_for_the_pinned_versions() -> None:
    pins = constraint_pins()
    assert {name: pins.get(name) for name in WRITTEN_FOR} == WRITTEN_FOR


def test_the_installed_versions_pass() -> None:
    check_versions()


def test_another_version_is_refused_naming_both_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = faust_internals.metadata.version

    def version(name: str) -> str:
        return "0.13.1" if name == "aiokafka" else real(name)

    monkeypatch.setattr(faust_internals.metadata, "version", version)
    monkeypatch.delenv("SPANGUARD_ALLOW_UNTESTED_FAUST", raising=False)
    with pytest.raises(UntestedLibraryVersions) as refused:
        check_versions()
    message = str(refused.value)
    assert "aiokafka 0.13.1" in message and f"aiokafka=={WRITTEN_FOR['aiokafka']}" in message
    assert "faust-streaming" not in message.split("but found")[1]  # only what differs
    assert "constraints.txt" in message and "faust_internals.py" in message
    assert "SPANGUARD_ALLOW_UNTESTED_FAUST=1" in message


def test_the_override_starts_anyway_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    def version(name: str) -> str:
        return "0.7.2" if name == "mode-streaming" else WRITTEN_FOR[name]

    check_versions(version, {"SPANGUARD_ALLOW_UNTESTED_FAUST": "1"})
    assert "mode-streaming 0.7.2" in caplog.text and "going on untested" in caplog.text
    with pytest.raises(UntestedLibraryVersions):
        check_versions(version, {"SPANGUARD_ALLOW_UNTESTED_FAUST": "yes"})  # 1 only


def test_a_library_not_installed_is_refused() -> None:
    with pytest.raises(UntestedLibraryVersions, match="mode-streaming not installed"):
        check_versions(lambda name: None if name == "mode-streaming" else WRITTEN_FOR[name], {})


def test_the_worker_does_not_import_at_another_version() -> None:
    # At import, before any private member is read: a fresh interpreter, its lookup patched.
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '0.16.0' if name == 'faust-streaming' else real(name)\n"
        "import spanguard.streams.app\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPANGUARD_ALLOW_UNTESTED_FAUST"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode != 0
    assert "UntestedLibraryVersions" in run.stderr and "faust-streaming 0.16.0" in run.stderr
