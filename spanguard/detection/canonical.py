"""Tool arguments as the loop rule compares them: canonical JSON, volatile keys removed, hashed.

Only the hash is kept in a trace's state (docs/design.md, "Privacy").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["args_hash", "canonicalize"]

_CONTAINERS = (dict, list)
# json.dumps(sort_keys=True) builds a new encoder on every call; one shared encoder (the C
# implementation, same output) saves that on every tool call.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, default=str)


def canonicalize(value: Any, volatile_keys: frozenset[str]) -> Any:
    """`value` without the volatile keys, at every depth: they change, the intent does not."""
    # Scalars are tested inline: most arguments are flat, and a call per value costs more
    # than the whole comparison.
    kind = type(value)
    if kind is dict:
        return {
            key: item if type(item) not in _CONTAINERS else canonicalize(item, volatile_keys)
            for key, item in value.items()
            if key not in volatile_keys
        }
    if kind is list:
        return [
            item if type(item) not in _CONTAINERS else canonicalize(item, volatile_keys)
            for item in value
        ]
    return value


def args_hash(arguments: Any, volatile_keys: frozenset[str]) -> str:
    """sha256 of the canonical JSON (sorted keys, volatile keys removed), first 16 hex chars.

    The JSON text is json.dumps(..., sort_keys=True) with its default separators: any tool
    that hashes arguments that way (the Collector processor in deploy/ too) gets the same hash.
    """
    canonical = _CANONICAL_JSON.encode(canonicalize(arguments, volatile_keys))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
