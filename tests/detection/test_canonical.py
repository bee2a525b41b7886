"""Canonical argument hashing: stable across key order and volatile keys, distinct otherwise."""

import hashlib
import json

from spanguard.detection.canonical import args_hash, canonicalize
from spanguard.detection.conventions.decoding import decode_arguments
from spanguard.schemas.policy import DEFAULT_VOLATILE_KEYS

VOLATILE = DEFAULT_VOLATILE_KEYS


def test_key_order_does_not_change_the_hash():
    assert args_hash({"a": 1, "b": {"c": 2, "d": 3}}, VOLATILE) == args_hash(
        {"b": {"d": 3, "c": 2}, "a": 1}, VOLATILE
    )


def test_volatile_keys_are_removed_at_every_depth():
    first = {"query": "refund policy", "timestamp": 1, "opts": {"nonce": "x", "k": 5}}
    second = {"query": "refund policy", "timestamp": 2, "opts": {"nonce": "y", "k": 5}}
    assert args_hash(first, VOLATILE) == args_hash(second, VOLATILE)
    assert canonicalize(first, VOLATILE) == {"query": "refund policy", "opts": {"k": 5}}


def test_volatile_keys_inside_lists_of_objects():
    first = {"items": [{"id": 1, "request_id": "r1"}, {"id": 2, "_ts": 9}]}
    second = {"items": [{"id": 1, "request_id": "r2"}, {"id": 2, "_ts": 10}]}
    assert args_hash(first, VOLATILE) == args_hash(second, VOLATILE)


def test_list_order_and_values_matter():
    assert args_hash({"q": [1, 2]}, VOLATILE) != args_hash({"q": [2, 1]}, VOLATILE)
    assert args_hash({"query": "refund"}, VOLATILE) != args_hash({"query": "refunds"}, VOLATILE)


def test_a_policy_volatile_key_only_strips_when_configured():
    first, second = {"title": "t", "created_at": 1}, {"title": "t", "created_at": 2}
    assert args_hash(first, VOLATILE) != args_hash(second, VOLATILE)
    extended = VOLATILE | {"created_at"}
    assert args_hash(first, extended) == args_hash(second, extended)


def test_hash_is_sixteen_hex_chars_equal_to_plain_sorted_json_sha256():
    arguments = {"query": "refund policy", "page": 1, "timestamp": 5}
    plain_json = json.dumps({"query": "refund policy", "page": 1}, sort_keys=True)
    assert args_hash(arguments, VOLATILE) == hashlib.sha256(plain_json.encode()).hexdigest()[:16]


def test_non_json_arguments_hash_as_the_text_itself():
    assert decode_arguments("refund policy") == "refund policy"
    assert decode_arguments('{"q": 1}') == {"q": 1}
    assert args_hash(decode_arguments("not json"), VOLATILE) == args_hash("not json", VOLATILE)


def test_python_repr_is_parsed_safely_only_when_asked():
    assert decode_arguments("{'query': 'refund', 'k': (1, 2)}", python_repr=True) == {
        "query": "refund",
        "k": [1, 2],
    }
    # Not a literal: never evaluated, kept raw.
    assert (
        decode_arguments("__import__('os').getcwd()", python_repr=True)
        == "__import__('os').getcwd()"
    )
    assert decode_arguments("{'a': 1}") == "{'a': 1}"


def test_strings_are_nfc_normalised_at_every_depth_keys_included():
    composed = {"query": "caf\u00e9", "opts": ["\u00e9t\u00e9"], "cl\u00e9": 1}
    decomposed = {"query": "cafe\u0301", "opts": ["e\u0301te\u0301"], "cle\u0301": 1}
    assert args_hash(composed, VOLATILE) == args_hash(decomposed, VOLATILE)
    assert args_hash("cafe\u0301", VOLATILE) == args_hash("caf\u00e9", VOLATILE)


def test_ascii_hashes_are_the_same_as_before_normalisation():
    """NFC leaves ASCII alone: hashes stored before it (in changelogs) still match."""
    value = {"query": "refund policy", "k": [1, "x"]}
    text = json.dumps(value, sort_keys=True)
    assert args_hash(value, VOLATILE) == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_case_and_whitespace_folding_only_when_asked():
    loud = {"query": "  Refund   POLICY "}
    quiet = {"query": "refund policy"}
    assert args_hash(loud, VOLATILE) != args_hash(quiet, VOLATILE)
    both = frozenset({"case", "whitespace"})
    assert args_hash(loud, VOLATILE, both) == args_hash(quiet, VOLATILE, both)
    assert args_hash(loud, VOLATILE, frozenset({"case"})) != args_hash(quiet, VOLATILE, both)
    # Folding applies to values, never to keys: {"Q": ...} stays another argument.
    assert args_hash({"Q": "x"}, VOLATILE, both) != args_hash({"q": "x"}, VOLATILE, both)
