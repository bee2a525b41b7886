"""Decision's typed parts change nothing on the wire: the detection records the tests made
while every evidence, spend, pause and scope field was a field of Decision itself
(tests/fixtures/decisions/records.jsonl: `record`, the record as `to_dict` gave it, in its key
order; `signals`, the kill signals `kill_signals` sent for it, as JSON) decode to decisions that
give the same record, key for key and in the same order, the same detections-topic JSON and
the same kill signals.

The records come from a run of tests/detection, tests/killswitch, tests/alerting, tests/goal,
tests/connectors, tests/streams and tests/schemas (not kafka) before the parts: every decision
made that the detection schema accepts, at most two of each shape (rule, action, scope and
which keys are set).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanguard.schemas.decision import Decision, kill_signals, validate

RECORDS = Path(__file__).parents[1] / "fixtures" / "decisions" / "records.jsonl"


def cases() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines() if line]


def shape(record: dict) -> str:
    scope = record.get("scope") or "trace"
    return f"{record['rule']}-{record['action']}-{scope}-{len(record)}"


@pytest.mark.parametrize("case", cases(), ids=lambda case: shape(json.loads(case["record"])))
def test_an_old_record_decodes_to_a_decision_that_encodes_it_byte_for_byte(case: dict) -> None:
    text = case["record"]
    record = json.loads(text)
    decision = Decision.from_json(text)
    assert json.dumps(decision.to_dict()) == text  # the same keys, values and order
    compact = json.dumps(record, sort_keys=True, separators=(",", ":"))
    assert decision.to_json() == compact  # what the detections topic gets
    assert Decision.from_dict(decision.to_dict()) == decision == Decision.from_json(compact)
    assert [signal.to_json() for signal in kill_signals(decision)] == case["signals"]
    validate(decision.to_dict(), "detection")


def test_the_records_cover_every_part_of_a_decision() -> None:
    """The fixture holds records with each part set: evidence with its window of calls, spend
    priced and unpriced, a pause, a conversation and an agent scope, a manual decision."""
    decisions = [Decision.from_json(case["record"]) for case in cases()]
    assert any(d.evidence.calls and d.evidence.period for d in decisions)  # a cycle
    assert any(d.evidence.calls and d.evidence.threshold for d in decisions)  # a tool_loop
    assert any(d.evidence.confidence is not None for d in decisions)  # goal_unmet
    assert any(d.spend.unpriced_tokens for d in decisions)
    assert any(d.spend.token_budget and d.spend.cost_micro_usd for d in decisions)
    assert any(d.pause is not None for d in decisions)
    assert any(d.scope_kind == "conversation" and d.scope.traces for d in decisions)  # type: ignore[union-attr]
    assert any(d.scope_kind == "agent" and d.scope.until for d in decisions)  # type: ignore[union-attr]
    assert any(d.operator is not None for d in decisions)
    assert any(d.policy.match for d in decisions)


def test_a_record_with_a_key_no_decision_has_is_refused() -> None:
    record = json.loads(cases()[0]["record"])
    with pytest.raises(ValueError, match="not a detection record"):
        Decision.from_json(json.dumps({**record, "evidence": {}}))
