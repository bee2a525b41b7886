"""Tool arguments as the loop rule compares them: canonical JSON, volatile keys removed, hashed.

Strings (keys and values, at every depth) are NFC-normalised first: the same query typed as
"é" or as "e" + combining accent is one query. A policy may also fold case and runs of
whitespace per tool (`fold`), for near-identical queries. Only the hash is kept in a trace's
state (docs/design.md, "Privacy").
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any, Final

from mypy_extensions import mypyc_attr

__all__ = ["FOLDINGS", "args_hash", "canonicalize"]

FOLDINGS: Final = frozenset({"case", "whitespace"})
_NO_FOLDING: Final = frozenset[str]()
# Module constants are Final: compiled code reads them directly, not out of the module's dict.
_sha256: Final = hashlib.sha256
_CONTAINERS: Final = (dict, list)
# json.dumps(sort_keys=True) builds a new encoder on every call; one shared encoder (the C
# implementation, same output) saves that on every tool call.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, default=str)
# JSONEncoder.encode still makes a C encoder on every call: `_encode_chunks` is that very C
# encoder made once (json.dumps's separators, sorted keys, str() for what JSON has not), with
# no cycle check (a decoded value has no cycles, and canonicalize bounds the depth).
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_encode_chunks: Final = (
    _c_make_encoder(
        None, str, json.encoder.encode_basestring_ascii, None, ": ", ", ", True, False, True
    )
    if _c_make_encoder is not None
    else None
)


def _canonical_json(value: Any) -> str:
    """json.dumps(value, sort_keys=True, default=str), through the encoder made once."""
    if _encode_chunks is None:  # a Python without the C accelerator
        return _CANONICAL_JSON.encode(value)
    return "".join(_encode_chunks(value, 0))


# Arguments nested deeper than this are canonical as a digest of the deeper part, computed
# without recursion: no depth an agent sends can raise RecursionError here or in the encoder,
# and identical calls still hash identically.
MAX_CANONICAL_DEPTH: Final = 64


def _text(value: str, fold: frozenset[str]) -> str:
    # isascii() is O(1) and ASCII is always NFC: most strings skip the normaliser.
    if not value.isascii():
        value = unicodedata.normalize("NFC", value)
    if fold:
        if "case" in fold:
            value = value.casefold()
        if "whitespace" in fold:
            value = " ".join(value.split())
    return value


@mypyc_attr(native_class=False)  # compiled classes cannot subclass bytes
class _Mark(bytes):
    """Text of the digest's serialisation (brackets, keys, separators), not a value."""


def _nested_digest(value: Any, volatile_keys: frozenset[str], fold: frozenset[str]) -> str:
    """sha256 of a canonical serialisation of `value` (volatile keys dropped, strings
    normalised), walked with an explicit stack: any depth."""
    digest = hashlib.sha256()
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is _Mark:
            digest.update(node)
        elif kind is dict:
            items: list[tuple[str, Any]] = sorted(
                ((_text(str(key), _NO_FOLDING), item) for key, item in node.items()
                 if key not in volatile_keys),
                key=lambda pair: pair[0],
            )  # fmt: skip
            stack.append(_Mark(b"}"))
            for key, item in items[::-1]:  # (reversed() of these trips mypyc's compiler)
                stack.append(_Mark(b","))
                stack.append(item)
                stack.append(_Mark(json.dumps(key).encode() + b":"))
            digest.update(b"{")
        elif kind is list or kind is tuple:
            stack.append(_Mark(b"]"))
            for item in node[::-1]:
                stack.append(_Mark(b","))
                stack.append(item)
            digest.update(b"[")
        else:
            text = _text(node, fold) if kind is str else node
            digest.update(_CANONICAL_JSON.encode(text).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def canonicalize(
    value: Any, volatile_keys: frozenset[str], fold: frozenset[str] = _NO_FOLDING, _depth: int = 0
) -> Any:
    """`value` without the volatile keys, at every depth, its strings NFC (and `fold`) normal;
    below MAX_CANONICAL_DEPTH, a nested container is {"_nested_sha256": its digest}."""
    # Scalars are tested inline: most arguments are flat, and a call per value costs more
    # than the whole comparison.
    kind = type(value)
    if _depth >= MAX_CANONICAL_DEPTH and kind in _CONTAINERS:
        return {"_nested_sha256": _nested_digest(value, volatile_keys, fold)}
    if kind is dict:
        result = {}
        for key, item in value.items():
            if key in volatile_keys:
                continue
            if type(key) is str and not key.isascii():
                key = unicodedata.normalize("NFC", key)
            item_kind = type(item)
            if item_kind is str:
                if fold or not item.isascii():  # an ASCII string is its own NFC form
                    item = _text(item, fold)
            elif item_kind in _CONTAINERS:
                item = canonicalize(item, volatile_keys, fold, _depth + 1)
            result[key] = item
        return result
    if kind is list:
        return [
            _text(item, fold)
            if type(item) is str
            else canonicalize(item, volatile_keys, fold, _depth + 1)
            if type(item) in _CONTAINERS
            else item
            for item in value
        ]
    if kind is str:
        return _text(value, fold)
    return value


def args_hash(
    arguments: Any, volatile_keys: frozenset[str], fold: frozenset[str] = _NO_FOLDING
) -> str:
    """sha256 of the canonical JSON (sorted keys, volatile keys removed), first 16 hex chars.

    The JSON text is json.dumps(..., sort_keys=True) with its default separators, over the
    NFC-normalised value: killswitch.hashing.ArgsHashingSpanProcessor, which writes
    `spanguard.tool.args_hash` in the agent's process, runs this very function.
    """
    canonical = canonicalize(arguments, volatile_keys, fold)
    text = "".join(_encode_chunks(canonical, 0)) if _encode_chunks else _canonical_json(canonical)
    return _sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
