"""Which invocation ends the judge sees: a deterministic fraction of traces."""

from __future__ import annotations

import hashlib
import math

__all__ = ["should_sample"]


def should_sample(trace_id: str, rate: float) -> bool:
    """Whether to judge this trace: a pure function of the trace id, so a redelivered trace gets
    the same answer. The first 8 bytes of sha256(lowercase trace id) as a fraction < rate."""
    if math.isnan(rate) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"sample rate must be within [0, 1], got {rate!r}")
    if rate == 0.0:
        return False
    if rate == 1.0:
        return True
    digest = hashlib.sha256(trace_id.strip().lower().encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < rate
