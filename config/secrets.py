"""Secrets from the environment: the value itself, or a file that holds it (a mounted Secret).

One reader for every side, so one key file can never mean two keys: the worker, `spanguard
release`, the Kafka client settings and the agents' `KillSwitch` all read through here.

The whitespace rule: whitespace around a secret (spaces, tabs, CR, LF: a file written by `echo`
or `openssl rand -hex 32 > file` ends in a newline) is not part of it; whitespace inside is.
A key file larger than MAX_SECRET_BYTES is refused: a key is a few dozen bytes, and a path
pointing at a device or a log must cost one line of error, not the process's memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from spanguard.errors import SecretError

__all__ = [
    "MAX_SECRET_BYTES",
    "PREVIOUS_SIGNING_KEY",
    "SIGNING_KEY",
    "normalize_secret",
    "read_secret",
    "read_secret_file",
    "signing_keys_from_env",
]

MAX_SECRET_BYTES = 64 * 1024

# The kill signals' key: the worker signs with it, agents verify with it.
SIGNING_KEY = "SPANGUARD_SIGNING_KEY"
# While the key is rotated, agents also accept signals signed with the previous one.
PREVIOUS_SIGNING_KEY = "SPANGUARD_PREVIOUS_SIGNING_KEY"


def normalize_secret(value: str | bytes) -> str | bytes:
    """The secret without surrounding whitespace (the one rule, the same on every side)."""
    return value.strip()


def read_secret_file(path: str, file_name: str) -> str:
    """The stripped content of `path` (named by the variable `file_name` in errors), read at
    most MAX_SECRET_BYTES; an unreadable, empty, oversized or non-UTF-8 file is a SecretError."""
    if "\0" in path:  # open() would raise ValueError, a traceback instead of one line
        raise SecretError(f"{file_name}: {path!r} is not a file path (it holds a NUL byte)")
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"{file_name}: cannot read {path!r}: {exc.strerror}") from None
    if len(raw) > MAX_SECRET_BYTES:
        raise SecretError(
            f"{file_name}: {path!r} holds more than {MAX_SECRET_BYTES} bytes; a secret file holds"
            " one secret"
        )
    try:
        secret = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SecretError(f"{file_name}: {path!r} is not UTF-8 text") from None
    if not secret:
        raise SecretError(f"{file_name}: {path!r} is empty")
    return secret


def read_secret(env: Mapping[str, str], name: str, file_name: str) -> str | None:
    """$name, or the content of the file named by $file_name, stripped; None when neither is
    set."""
    direct = normalize_secret(env.get(name) or "")
    path = (env.get(file_name) or "").strip()
    if direct and path:
        raise SecretError(f"set {name} or {file_name}, not both")
    if not path:
        return str(direct) or None
    return read_secret_file(path, file_name)


def signing_keys_from_env(env: Mapping[str, str] | None = None) -> list[bytes]:
    """The kill signals' keys an agent accepts: SPANGUARD_SIGNING_KEY[_FILE] (the worker's),
    then SPANGUARD_PREVIOUS_SIGNING_KEY[_FILE] during a rotation; [] when none is set."""
    env = os.environ if env is None else env
    keys = []
    for name in (SIGNING_KEY, PREVIOUS_SIGNING_KEY):
        key = read_secret(env, name, name + "_FILE")
        if key is not None:
            keys.append(key.encode())
    return keys
