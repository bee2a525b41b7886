"""Build the compiled detection core the shipped way, and run a command against it.

    python scripts/compiled_core.py build              # build/compiled-core: the wheel, unpacked
    python scripts/compiled_core.py run -m bench.bench_core [args]
    python scripts/compiled_core.py run -m pytest tests/detection [args]

`build` makes the wheel as the worker image does (setup.py with SPANGUARD_COMPILE=1, the
project's own mypyc from the dev extra, from a copy of what the image copies) and unpacks it
into build/compiled-core; `run` imports
spanguard from there first, so the command runs the wheel's compiled core and the tree's tests
and benchmarks (under pytest-xdist, `-p compiled_core` does the same in each worker). The
editable install of `make install` stays pure Python: compiled modules built in place would
shadow the sources, and an edit would silently not take effect.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "compiled-core"


def _setup_module():
    spec = importlib.util.spec_from_file_location("spanguard_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() runs only as __main__
    return module


def image_context(into: Path) -> None:
    """What the worker image builds from (.dockerignore: pyproject.toml, README.md, setup.py and
    the package folders), copied into `into`: the build writes its setuptools folders and
    egg-info there, not beside the checkout's, so nothing an earlier build or a concurrent
    `pip wheel .` of the checkout left is packed, and a build can run beside the other tests."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        setuptools = tomllib.load(file)["tool"]["setuptools"]
    folders = {"spanguard", *setuptools["package-dir"].values()}
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy2(ROOT / name, into / name)
    skipped = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so")
    for folder in sorted(folders):
        shutil.copytree(ROOT / folder, into / folder, ignore=skipped)


def build() -> list[str]:
    """The compiled wheel, unpacked into TREE; returns the extension modules it holds."""
    wheels = ROOT / "build" / "compiled-wheel"
    for folder in (TREE, wheels):
        if folder.exists():
            shutil.rmtree(folder)
    environment = {**os.environ, "SPANGUARD_COMPILE": "1"}
    with tempfile.TemporaryDirectory(prefix="spanguard-compiled-") as context:
        image_context(Path(context))
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
        command += ["--no-build-isolation", "--wheel-dir", str(wheels), context]
        done = subprocess.run(command, cwd=context, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        sys.exit(f"compiled_core: the compiled wheel did not build ({done.returncode})")
    (wheel,) = wheels.glob("spanguard-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(TREE)
        built = sorted(name for name in archive.namelist() if name.endswith(".so"))
    expected = {Path(path).with_suffix("").as_posix() for path in _setup_module().COMPILED_MODULES}
    missing = expected - {name.split(".")[0] for name in built}
    if missing:
        sys.exit(f"compiled_core: the wheel lacks compiled {sorted(missing)}")
    print(f"compiled_core: {wheel.name}, {len(built)} extension modules, in build/compiled-core")
    return built


def run(arguments: list[str]) -> None:
    if not any(TREE.glob("spanguard/detection/guard.*.so")):
        sys.exit("compiled_core: nothing built; run `python scripts/compiled_core.py build`")
    if arguments[:1] != ["-m"] or len(arguments) < 2:
        sys.exit("compiled_core: run -m MODULE [ARG ...]")
    sys.path.insert(0, str(ROOT))  # the tests and the benchmarks
    sys.path.insert(0, str(TREE))  # the wheel: spanguard and every folder of it
    # Imported now, they stay in sys.modules whatever the command puts on sys.path later
    # (pytest prepends the repository's root, whose spanguard/ holds the sources).
    from spanguard.detection import core_build, guard

    if core_build() != "compiled":
        sys.exit(f"compiled_core: the core imported from {guard.__file__} is not compiled")
    sys.argv = [arguments[1], *arguments[2:]]
    runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)


def pytest_load_initial_conftests() -> None:
    """`run -m pytest -p compiled_core -n N`: each pytest-xdist worker starts with the sys.path
    of `run`, and this hook imports spanguard there from the wheel before the tests' conftest
    puts the sources first; a worker whose core is not compiled stops the run."""
    from spanguard.detection import core_build, guard

    if core_build() != "compiled":
        raise RuntimeError(
            f"compiled_core: the core imported from {guard.__file__} is not compiled"
        )


def main() -> None:
    if sys.argv[1:2] == ["build"]:
        build()
    elif sys.argv[1:2] == ["run"]:
        run(sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
