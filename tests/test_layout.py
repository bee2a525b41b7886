"""The layout's rules (docs/design.md, "Layout"), read off the source with `ast`.

Imports point one way: schemas <- kernel (spanguard/) <- streams, alerting, killswitch. The
kernel touches no transport (no Kafka, Faust or HTTP client), so the worker, replay, the
in-process processor and the benchmarks run the very same code. `spanguard.errors` imports
nothing of spanguard, so every layer may raise its errors. `spanguard/cli.py` and
`spanguard/demo.py` are entry points: they may import every layer (lazily, per command).
`spanguard.kafka_clients` is the one module of spanguard/ that touches the Kafka libraries: the
worker and the killswitch share it, and the kernel never imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("schemas", "streams", "alerting", "killswitch")  # installed as spanguard.<folder>
ENTRY_POINTS = {"spanguard.cli", "spanguard.demo"}
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


def _modules() -> dict[str, Path]:
    """Import name -> file, for every module of the package."""
    found = {}
    for path in (ROOT / "spanguard").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__")] = path
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join(["spanguard", folder, *(p for p in parts if p != "__init__")])
            found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FOLDERS:
        return parts[1]
    if module == "spanguard.errors":
        return "errors"
    if module == "spanguard.kafka_clients":
        return "clients"
    if module in ENTRY_POINTS:
        return "entry"
    return "kernel"


ALLOWED = {
    "errors": set(),
    "schemas": {"errors", "schemas"},
    "kernel": {"errors", "schemas", "kernel"},
    # The Kafka libraries' side of a connection, shared by the worker and the killswitch.
    "clients": {"errors", "schemas", "kernel", "clients"},
    "alerting": {"errors", "schemas", "kernel", "alerting"},
    "killswitch": {"errors", "schemas", "kernel", "clients", "killswitch"},
    "streams": {"errors", "schemas", "kernel", "clients", "alerting", "streams"},
    "entry": {
        "errors",
        "schemas",
        "kernel",
        "clients",
        "alerting",
        "killswitch",
        "streams",
        "entry",
    },
}


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
            elif layer in ("kernel", "schemas", "errors") and imported.split(".")[0] in TRANSPORTS:
                wrong.append(f"{module} ({layer}) imports the transport {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_import(tmp_path):
    """The check above would catch the kernel importing the worker (it is not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from spanguard.streams.app import create_app\nimport faust\n")
    assert _imports(bad) == {"spanguard.streams.app", "faust"}
    assert _layer("spanguard.streams.app") not in ALLOWED["kernel"]


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_a_mapped_folder_refuses_its_bare_name(folder):
    # From the repository root `import streams` would find ./streams: two copies of each class.
    result = subprocess.run(
        [sys.executable, "-c", f"import {folder}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"import spanguard.{folder}, not {folder}" in result.stderr


def test_every_module_loads_under_one_name():
    from spanguard.detection.guard import Guard
    from spanguard.killswitch.processor import Guard as ProcessorGuard

    assert Guard is ProcessorGuard
    assert "streams" not in sys.modules and "schemas" not in sys.modules
