"""The detection core compiled as the worker image ships it passes the core's own tests.

setup.py compiles the hot path with mypyc when SPANGUARD_COMPILE=1 (the Dockerfile does);
`make install` keeps it pure Python. Compiled code checks its type annotations at run time and
refuses what plain Python lets through (a patched method, a duck-typed argument, an interpreted
subclass of a compiled class), so the same tests run again on the compiled wheel.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from spanguard.detection import core_build
from tests.support.compiled_build import COMPILED_BUILD

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, str(ROOT / "scripts" / "compiled_core.py")]
# The core's tests (replay through the CLI among them), the in-process processor's, and the
# hostile inputs: compiled code is strict about types where plain Python is not. The generator
# tests re-run the instrumented agents and the multi-agent frameworks: not the core.
SUITES = [
    "tests/detection",
    "tests/schemas",
    "tests/killswitch/test_inprocess.py",
    "tests/test_bad_input.py",
    "tests/test_fuzz.py",
]
SKIP = [
    "--deselect",
    "tests/detection/test_instrumentation_fixtures.py::test_the_generator_reproduces_the_fixtures",
    "--deselect",
    "tests/detection/test_multi_agent_fixtures.py::test_the_fixtures_are_what_the_libraries_emit_now",
    "--deselect",
    "tests/detection/test_multi_framework_fixtures.py::test_the_fixtures_are_what_the_libraries_emit_now",
    "--deselect",
    "tests/detection/test_compiled_core.py",
]


def test_the_compiled_wheel_passes_the_cores_tests() -> None:
    # Built from the end of collection on in a run of one process, else from now.
    built = COMPILED_BUILD.wait(timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "extension modules" in built.stdout

    # Spread over the cores: -p compiled_core makes every xdist worker run the compiled core too.
    command = [*SCRIPT, "run", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "compiled_core", "-n", "auto", *SUITES]
    command += ["-m", "not kafka", *SKIP]
    ran = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    tail = ran.stdout[-6000:] + ran.stderr[-3000:]
    assert ran.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


def test_the_editable_install_stays_pure_python() -> None:
    # Compiled modules beside the sources would shadow them: an edit would not take effect.
    assert core_build() == "pure Python"
    assert not list((ROOT / "spanguard").rglob("*.so"))
