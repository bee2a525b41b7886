"""Reading a policy file: `load_policy(path)`, a bounded read of outside input.

The file's bytes go to `Policy.from_yaml` (schemas/policy.py), which parses and checks them:
the schemas parse text and mappings, and reading files is config's business. Whatever the
path names, reading it ends in its bytes or in one PolicyError line naming the file: it is
opened without blocking (a FIFO with no writer would otherwise block here for good), refused
unless it is a regular file, and read no further than one byte past the policy's size bound.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from spanguard.errors import PolicyError
from spanguard.schemas.policy import MAX_POLICY_BYTES, Policy

__all__ = ["load_policy"]


def load_policy(path: str | Path) -> Policy:
    """The policy in the file at `path`, or a PolicyError naming the file and the problem."""
    path = Path(path)
    return Policy.from_yaml(_read_policy_bytes(path), source=str(path))


def _read_policy_bytes(path: Path) -> bytes:
    try:
        # Non-blocking open: a FIFO with no writer would otherwise block here for good.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read policy: {exc.strerror}") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise PolicyError(f"{path}: not a regular file ({_file_kind(mode)}): not a policy")
    with os.fdopen(descriptor, "rb") as handle:
        try:
            return handle.read(MAX_POLICY_BYTES + 1)  # bounded, whatever the file grows to
        except OSError as exc:
            raise PolicyError(f"{path}: cannot read policy: {exc.strerror}") from None


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"
