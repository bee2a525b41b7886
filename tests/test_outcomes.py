"""Tally and CountedOutcome: outcomes of different owners never share a count."""

from __future__ import annotations

from spanguard.alerting.service import PageOutcome
from spanguard.alerting.webhook import WebhookOutcome
from spanguard.outcomes import Tally


def test_outcomes_of_two_enums_with_one_value_are_counted_apart() -> None:
    tally = Tally()
    tally.add(PageOutcome.REJECTED)
    tally.add(WebhookOutcome.REJECTED, 2)
    assert PageOutcome.REJECTED.value == WebhookOutcome.REJECTED.value == "rejected"
    assert tally.count(PageOutcome.REJECTED) == 1
    assert tally.count(WebhookOutcome.REJECTED) == 2
    assert len({PageOutcome.REJECTED: 1, WebhookOutcome.REJECTED: 2}) == 2


def test_a_tally_reads_zero_for_what_never_happened() -> None:
    tally = Tally()
    assert tally.count(PageOutcome.UNREADABLE) == 0
    assert not tally  # reading adds nothing
