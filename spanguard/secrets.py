"""Secrets from the environment: the value itself, or a file that holds it (a mounted Secret)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from spanguard.errors import SecretError

__all__ = ["SecretError", "read_secret"]


def read_secret(env: Mapping[str, str], name: str, file_name: str) -> str | None:
    """$name, or the stripped content of the file named by $file_name; None when neither is set."""
    direct = (env.get(name) or "").strip()
    path = (env.get(file_name) or "").strip()
    if direct and path:
        raise SecretError(f"set {name} or {file_name}, not both")
    if not path:
        return direct or None
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SecretError(f"{file_name}: cannot read {path!r}: {exc.strerror}") from None
    if not secret:
        raise SecretError(f"{file_name}: {path!r} is empty")
    return secret
