"""The `spanguard` command run as a user runs it: a fresh interpreter, its output captured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_spanguard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`spanguard ARGS...` (python -m spanguard.cli), with its exit code, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def result_of(
    command: list[str], signing_key: str, cwd: Path, environ: Mapping[str, str] | None = None
) -> dict:
    """Run an agent of another language with the worker's `signing_key` (over `environ`, this
    process's environment by default): its exit code must be 0, and its last line of output is
    its result, in JSON."""
    process = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**(os.environ if environ is None else environ), "SPANGUARD_SIGNING_KEY": signing_key},
    )
    assert process.returncode == 0, process.stdout + process.stderr
    return json.loads(process.stdout.strip().splitlines()[-1])
