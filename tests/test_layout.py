"""The layout's rules (docs/design.md, "Layout"), read off the source with `ast`.

Each top-level folder is one layer, installed as `spanguard.<folder>` (`spanguard/` itself is the
kernel), and imports point one way:

    errors <- schemas <- kernel <- config <- connectors <- (streams, alerting, killswitch) <- cli

`spanguard.errors` is the bottom layer, so every layer may raise its errors; the worker
(streams) pages through alerting. The pure layers (errors, schemas, kernel) touch no transport
(no Kafka, Faust or HTTP client), so the worker, replay, the in-process processor and the
benchmarks run the very same code.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.python_source import parse_python

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]
FOLDERS = {name: folder for name, folder in PACKAGE_DIRS.items() if name != "spanguard"}
# Top-level packages that are never installed: they import the project as a user does.
NOT_INSTALLED = {"tests", "bench"}
TRANSPORTS = {
    "aiohttp",
    "aiokafka",
    "confluent_kafka",
    "faust",
    "httpx",
    "httpx2",
    "mode",
    "openai",
    "pagerduty",
    "requests",
    "rocksdict",
    "urllib3",
}
PURE = {"errors", "schemas", "kernel"}
# What the pure layers leave to the CLI: the replay and backtest pages are rendered in cli/.
RENDERING = {"html"}
ALLOWED = {
    "errors": {"errors"},
    "schemas": {"errors", "schemas"},
    "kernel": {"errors", "schemas", "kernel"},
    "config": {"errors", "schemas", "kernel", "config"},
    "connectors": {"errors", "schemas", "kernel", "config", "connectors"},
    "alerting": {"errors", "schemas", "kernel", "config", "connectors", "alerting"},
    "killswitch": {"errors", "schemas", "kernel", "config", "connectors", "killswitch"},
    "streams": {"errors", "schemas", "kernel", "config", "connectors", "alerting", "streams"},
    "cli": {
        "errors",
        "schemas",
        "kernel",
        "config",
        "connectors",
        "alerting",
        "killswitch",
        "streams",
        "cli",
    },
}


def _modules() -> dict[str, Path]:
    """Import name -> file, for every module of the installed package."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parse_python(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _layer(module: str) -> str:
    if module == "spanguard.errors":
        return "errors"
    parts = module.split(".")
    if len(parts) > 1 and ".".join(parts[:2]) in FOLDERS:
        return parts[1]
    return "kernel"


def test_every_folder_is_a_layer():
    assert {_layer(name) for name in FOLDERS} | {"kernel", "errors"} == set(ALLOWED)


def test_imports_point_one_way():
    modules = _modules()
    assert "spanguard.detection.guard" in modules and "spanguard.streams.app" in modules
    wrong = []
    for module, path in sorted(modules.items()):
        layer = _layer(module)
        for imported in _imports(path):
            if imported == "spanguard" or imported.startswith("spanguard."):
                target = _layer(imported)
                if target not in ALLOWED[layer]:
                    wrong.append(f"{module} ({layer}) imports {imported} ({target})")
            elif layer in PURE and imported.split(".")[0] in TRANSPORTS:
                wrong.append(f"{module} ({layer}) imports the transport {imported}")
            elif layer in PURE and imported.split(".")[0] in RENDERING:
                wrong.append(f"{module} ({layer}) renders a page ({imported}): cli/ does")
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_import(tmp_path):
    """The check above would catch the kernel importing the worker (it is not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from spanguard.streams.app import create_app\nimport faust\n")
    assert _imports(bad) == {"spanguard.streams.app", "faust"}
    assert _layer("spanguard.streams.app") not in ALLOWED["kernel"]
    assert _layer("spanguard.connectors.topics") not in ALLOWED["kernel"]
    assert _layer("spanguard.config.settings") not in ALLOWED["kernel"]
    assert _layer("spanguard.cli.main") not in ALLOWED["connectors"]
    assert _layer("spanguard.killswitch.client") not in ALLOWED["connectors"]


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_a_mapped_folder_refuses_its_bare_name(package):
    # From the repository root `import streams` would find ./streams: two copies of each class.
    folder = FOLDERS[package]
    result = subprocess.run(
        [sys.executable, "-c", f"import {folder}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"import {package}, not {folder}" in result.stderr


def test_every_module_loads_under_one_name():
    from spanguard.detection.guard import Guard
    from spanguard.killswitch.processor import Guard as ProcessorGuard

    assert Guard is ProcessorGuard
    assert "streams" not in sys.modules and "schemas" not in sys.modules


def _design_layout_table() -> dict[str, str]:
    """folder -> import name, from the table of docs/design.md's "Layout" section."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = re.search(r"^## Layout\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, 'docs/design.md has no "## Layout" section'
    rows = {}
    for line in section.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("folder", "") or set(cells[0]) <= {"-"}:
            continue
        rows[cells[0].strip("`").rstrip("/")] = cells[1].strip("`")
    return rows


def test_the_design_layout_table_names_exactly_the_folders():
    table = _design_layout_table()
    installed = {folder: package for package, folder in PACKAGE_DIRS.items()}
    assert table == installed
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages - NOT_INSTALLED == set(installed)
    assert packages >= NOT_INSTALLED


def test_the_table_reader_sees_a_missing_row(tmp_path, monkeypatch):
    """A folder dropped from the table is seen (the comparison above is not vacuous)."""
    text = (ROOT / "docs" / "design.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `connectors/`"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(text.replace(row + "\n", ""))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert "connectors" not in _design_layout_table()
    assert "streams" in _design_layout_table()


# -- one import path per name -------------------------------------------------------------------

# The package a user imports by its own name re-exports on purpose: agents write
# `from spanguard.killswitch import SignalBook, AgentKilled` (docs/killswitch-clients.md), and the
# in-process processor loads on first use so an agent that only reads signals needs no OTel SDK.
PUBLIC_FACADES = {"spanguard.killswitch"}


def _bound_at_top(tree: ast.Module) -> set[str]:
    """Names a module defines itself (def, class, assignment), at its top level."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                bound.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return bound


def _used_names(tree: ast.Module) -> set[str]:
    """Every name read in the module, in code or in a string annotation."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            base = node
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name):
                used.add(base.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return used


def _all_names(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [element.value for element in node.value.elts]
    return []


def _re_exports(module: str, source: str) -> list[str]:
    """Names `module` hands on from another spanguard module: listed in `__all__` without being
    defined here, or imported from spanguard and never used; and a module `__getattr__`."""
    tree = parse_python(source)
    imported: dict[str, str] = {}  # local name -> where it comes from
    for node in tree.body:
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.ImportFrom)
                and inner.level == 0
                and (inner.module or "").startswith("spanguard")
            ):
                for alias in inner.names:
                    imported[alias.asname or alias.name] = f"{inner.module}.{alias.name}"
    bound = _bound_at_top(tree)
    found = []
    others = _imported_from_elsewhere(tree)
    for name in _all_names(tree):
        if name in imported or (name not in bound and name not in others):
            where = imported.get(name, "nowhere in the module")
            found.append(f"{module}.__all__ lists {name}, defined in {where}")
    # Reads of a name, less the import statements themselves (they bind, they do not read).
    used = _used_names(
        ast.Module(body=[n for n in tree.body if not _is_import(n)], type_ignores=[])
    )
    for name, origin in sorted(imported.items()):
        if name not in used and name not in _all_names(tree):
            found.append(f"{module} imports {origin} and never uses it")
    if "__getattr__" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}:
        found.append(f"{module} defines names lazily in a module __getattr__")
    return found


def _imported_from_elsewhere(tree: ast.Module) -> set[str]:
    """Names the module imports from outside spanguard (a library's type it returns, say)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("spanguard"):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _is_import(node: ast.stmt) -> bool:
    return isinstance(node, (ast.Import, ast.ImportFrom))


def test_every_name_has_one_import_path():
    found = []
    for module, path in sorted(_modules().items()):
        if module not in PUBLIC_FACADES:
            found += _re_exports(module, path.read_text())
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from spanguard.errors import PolicyError\n__all__ = ['PolicyError']\n",
        "from spanguard.errors import PolicyError\n",
        "def __getattr__(name):\n    raise AttributeError(name)\n",
    ],
)
def test_the_check_sees_a_re_export(source):
    assert _re_exports("spanguard.example", source)


def test_a_name_used_where_it_is_imported_is_no_re_export():
    source = (
        "from spanguard.errors import PolicyError\n__all__ = ['check']\n"
        "def check():\n    raise PolicyError('x')\n"
    )
    assert _re_exports("spanguard.example", source) == []
