"""The partition a key goes to, computed the way the OpenTelemetry Collector computes it.

The Collector's kafka exporter (franz-go with a sarama-compatible hasher) puts a message keyed
by trace id on FNV-1a-32(key) mod partitions, the sign of Go's int32 remainder dropped. The
worker's repartition hop sends re-keyed traces to that same partition explicitly, so a trace
whose spans arrive both keyed (from the Collector) and unkeyed (re-keyed here) keeps its state
in one partition. librdkafka's `fnv1a` partitioner is the same function.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["collector_partition", "fnv1a_32"]

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def fnv1a_32(data: bytes) -> int:
    value = _FNV_OFFSET
    for byte in data:
        value = ((value ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return value


# A trace's id is hashed for each of its parts the worker packs and for each pack it decides
# in place: the hash in Python costs many times a cache lookup, and a trace's spans come in
# many records while it runs (docs/performance.md, "Figures behind the code").
@lru_cache(maxsize=65536)
def collector_partition(key: bytes, partitions: int) -> int:
    """sarama's hash partitioner: abs(int32(fnv1a(key)) % n), with Go's truncating remainder."""
    signed = fnv1a_32(key)
    if signed >= 0x80000000:
        signed -= 0x100000000
    return abs(signed) % partitions  # Go's % truncates toward zero: |a % n| == |a| % n
