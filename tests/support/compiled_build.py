"""The compiled core's wheel (`scripts/compiled_core.py build`) for its test: in a run of one
process (`make test`) it builds in the background from the end of collection on (tests/conftest.py),
beside the tests before its own, most of which wait on a broker or a worker and leave a core idle;
the build is mostly one C compiler on one file, so its minute is hidden there. Under xdist, or when
the test runs first, the test's wait starts the build itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, str(ROOT / "scripts" / "compiled_core.py"), "build"]
TEST = "tests/detection/test_compiled_core.py::test_the_compiled_wheel_passes_the_cores_tests"


@dataclass
class Built:
    returncode: int
    stdout: str
    stderr: str


class CompiledBuild:
    """One build per run, in a process group of its own (pip, setup.py and the compiler under
    it), stopped with the run if the test never waited for it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._outputs: tuple[IO[str], IO[str]] | None = None

    def start(self, *, background: bool = False) -> None:
        if self._process is not None:
            return
        # In the background it yields the cores to the tests it runs beside.
        nice = ["nice", "-n", "10"] if background and shutil.which("nice") else []
        # Read in wait(), closed with the run's process.
        stdout = tempfile.TemporaryFile("w+")  # noqa: SIM115
        stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._outputs = (stdout, stderr)
        self._process = subprocess.Popen(
            [*nice, *COMMAND], cwd=ROOT, stdout=stdout, stderr=stderr, start_new_session=True
        )

    def wait(self, timeout: float) -> Built:
        self.start()
        assert self._process is not None and self._outputs is not None
        try:
            returncode = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        stdout, stderr = self._outputs
        stdout.seek(0)
        stderr.seek(0)
        return Built(returncode, stdout.read(), stderr.read())

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


COMPILED_BUILD = CompiledBuild()
