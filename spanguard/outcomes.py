"""Counted outcomes: each module that counts something names what it counts with an enum.

The model is OpenTelemetry's: a counter's outcomes are a closed set of named values, not strings
typed again wherever they are read. A module that counts (the guard, the span pipeline, paging,
the webhook, the goal verifier, the release reader, the span agent and its health) declares a
`CountedOutcome` enum and reports into a `Tally`; the guard, the pipeline, the release reader
and the health keep plain integer fields instead (cheap on the hot path), named by their enum's
members and read through the same `Counted` interface. The worker's /metrics reads every member of every such enum at
scrape time (streams/metrics.py), and tests/streams/test_metrics.py fails when a member is not
there.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum
from typing import Protocol, TypeVar

__all__ = ["Counted", "CountedOutcome", "Tally"]


class CountedOutcome(Enum):
    """Base of every counted outcome; a member's value (a string) is its name in logs and its
    label on /metrics where one metric holds the whole enum.

    A plain Enum, not a StrEnum: "rejected" of paging and "rejected" of the webhook are two
    outcomes, and a StrEnum's members would be equal as strings (one key in a dict).
    """


# The enum a part counts: GuardStats counts GuardCount members only, a Tally any member.
OutcomeT = TypeVar("OutcomeT", bound=CountedOutcome, contravariant=True)


class Counted(Protocol[OutcomeT]):
    """What counts outcomes: how many times `outcome` happened so far (0 when never)."""

    def count(self, outcome: OutcomeT) -> int: ...


class Tally(Counter[CountedOutcome]):
    """Outcomes counted by member: what an owner reports into and /metrics reads."""

    def add(self, outcome: CountedOutcome, times: int = 1) -> None:
        self[outcome] += times

    def count(self, outcome: CountedOutcome) -> int:
        return self[outcome]
