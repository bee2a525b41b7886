"""Type-check the whole package with mypy, every top-level folder under its import name.

    .venv/bin/python scripts/typecheck.py [mypy arguments]      # (`make typecheck`)

The settings are pyproject.toml's [tool.mypy]. mypy knows nothing of setuptools' package_dir:
given `streams/app.py` it would check a module `streams.app`, and `spanguard.streams` would not
be found. So this lays a tree of links, .mypy_cache/tree/spanguard/, that holds what the
installed package holds (spanguard/'s own entries, and streams/ as streams, schemas/ as
schemas, ...), and mypy reads the package from there (mypy_path, files). Its messages name the
links; they are said here with the repository's own paths, so an editor or a person opens the
file that is edited.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".mypy_cache" / "tree"


def package_dirs() -> dict[str, str]:
    """Sub-package name ("streams") -> its folder in the repository, from pyproject.toml."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        mapping = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    assert mapping.pop("spanguard") == "spanguard", mapping
    return {name.removeprefix("spanguard."): folder for name, folder in mapping.items()}


def lay_tree() -> dict[str, str]:
    """Lay the link tree anew; returns each link's path (relative to ROOT) -> the real one."""
    package = TREE / "spanguard"
    package.mkdir(parents=True, exist_ok=True)
    for entry in package.iterdir():  # links of folders renamed or removed since
        if entry.is_symlink():
            entry.unlink()
    links = {entry.name: f"spanguard/{entry.name}" for entry in (ROOT / "spanguard").iterdir()}
    links.update(package_dirs())
    shown = {}
    for name, folder in sorted(links.items()):
        if name == "__pycache__":
            continue
        # Relative links, so a checkout moved elsewhere still points at its own files.
        (package / name).symlink_to(os.path.relpath(ROOT / folder, package))
        shown[(package / name).relative_to(ROOT).as_posix()] = folder
    return shown


def main(arguments: list[str]) -> int:
    from mypy import api  # the dev extra's mypy, the one that compiles the detection core

    shown = lay_tree()
    os.chdir(ROOT)
    stdout, stderr, status = api.run(arguments)
    pattern = re.compile("|".join(re.escape(link) for link in sorted(shown, key=len, reverse=True)))
    sys.stdout.write(pattern.sub(lambda match: shown[match.group(0)], stdout))
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
