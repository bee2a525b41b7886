"""The strict verdict parser (goal/verdicts.py): a judge's reply is a verdict or an error."""

from __future__ import annotations

import re

import pytest

from spanguard.errors import JudgeError
from spanguard.goal.verdicts import Verdict, parse_verdict
from tests.support.goal_runs import GOOD_JSON


@pytest.mark.parametrize(
    "text",
    [
        GOOD_JSON,
        f"  {GOOD_JSON}\n",
        f"```json\n{GOOD_JSON}\n```",
        f"```\n{GOOD_JSON}\n```",
        '{"reason": "It answers the question.", "confidence": 0.8, "satisfied": true}',
    ],
)
def test_parse_verdict_accepts_the_object_alone_or_fenced(text):
    assert parse_verdict(text) == Verdict(True, 0.8, "It answers the question.")


def test_parse_verdict_integer_confidence_bounds():
    assert parse_verdict('{"satisfied": false, "confidence": 1, "reason": "r"}').confidence == 1.0
    assert parse_verdict('{"satisfied": false, "confidence": 0, "reason": "r"}').confidence == 0.0


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("Yes, the agent did what was asked.", "not one JSON object"),
        (f"Here is my verdict: {GOOD_JSON}", "not one JSON object"),
        (f"{GOOD_JSON}\nHope this helps!", "not one JSON object"),
        (f"```json\n{GOOD_JSON}\n```\nHope this helps!", "code fence"),
        (f"```json\n{GOOD_JSON}", "code fence"),
        (f"[{GOOD_JSON}]", "not an object"),
        ("true", "not an object"),
        ('{"satisfied": true, "confidence": 0.8}', "missing ['reason']"),
        ('{"satisfied": true, "confidence": 0.8, "reason": "r", "score": 5}', "unexpected"),
        ('{"satisfied": "true", "confidence": 0.8, "reason": "r"}', "satisfied must be"),
        ('{"satisfied": 1, "confidence": 0.8, "reason": "r"}', "satisfied must be"),
        ('{"satisfied": true, "confidence": 1.5, "reason": "r"}', "within [0, 1]"),
        ('{"satisfied": true, "confidence": -0.1, "reason": "r"}', "within [0, 1]"),
        ('{"satisfied": true, "confidence": "0.8", "reason": "r"}', "must be a number"),
        ('{"satisfied": true, "confidence": true, "reason": "r"}', "must be a number"),
        ('{"satisfied": true, "confidence": NaN, "reason": "r"}', "NaN is not JSON"),
        ('{"satisfied": true, "confidence": 0.8, "reason": ""}', "non-empty string"),
        ('{"satisfied": true, "confidence": 0.8, "reason": ["r"]}', "non-empty string"),
        (
            '{"satisfied": false, "satisfied": true, "confidence": 0.8, "reason": "r"}',
            "duplicate key",
        ),
        ("{" + " " * 9000 + "}", "characters long"),
    ],
)
def test_parse_verdict_rejects_anything_else(text, message):
    with pytest.raises(JudgeError, match=re.escape(message)) as caught:
        parse_verdict(text)
    assert caught.value.kind == "invalid_reply"
