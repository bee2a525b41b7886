"""no_progress on its own: only one same result that says nothing came back counts."""

from __future__ import annotations

import json

import pytest

from spanguard.detection.canonical import args_hash
from spanguard.detection.guard import Guard
from spanguard.detection.results import EMPTY_RESULT_DIGESTS, classify
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, one_request_per_span


def searches(results: list[str], *, hashed: bool = False) -> AgentRecorder:
    """Different searches, one per result (what an agent rephrasing its query does)."""
    agent = AgentRecorder("support-bot", "support")
    for index, result in enumerate(results):
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "search_docs",
            "gen_ai.tool.call.arguments": json.dumps({"query": f"rephrasing {index}"}),
        }
        if hashed:  # what ArgsHashingSpanProcessor leaves: hashes only
            attributes["spanguard.tool.args_hash"] = args_hash(
                {"query": f"rephrasing {index}"}, frozenset()
            )
            del attributes["gen_ai.tool.call.arguments"]
            attributes["spanguard.tool.result_hash"] = args_hash(json.loads(result), frozenset())
        else:
            attributes["gen_ai.tool.call.result"] = result
        agent.tool("search_docs", attributes=attributes)
    return agent


def decisions(agent: AgentRecorder, policy: Policy | None = None) -> list:
    guard = Guard(policy)
    return [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)]


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {},
        "",
        "   ",
        "[]",
        "No results found.",
        "not found",
        {"_raw": "No results"},
        {"results": [], "total": 0},
        {"result": "[]"},  # Google ADK's wrapper
        [{"text": "[]"}],  # strands' content blocks
        {"content": [], "isError": False},  # MCP, nothing returned
        {"content": [{"type": "text", "text": "boom"}], "isError": True},  # MCP, an error
        {"status": "error", "message": "index unavailable"},
        {"error": "timeout"},
        "Error: connection refused",
    ],
)
def test_what_says_nothing(value):
    assert classify(value) is not None  # a failure, nothing found or no content


@pytest.mark.parametrize(
    "value",
    [
        {"ok": True},
        {"ok": False},
        "Refunds are accepted within 30 days.",
        "2 documents found",
        [{"id": "kb-1"}],
        {"results": [{"id": 1}], "total": 1},
        {"exit_code": 0},
        0,
        True,
        "no results for 'refund', showing 'returns' instead: kb-7",
    ],
)
def test_what_is_content(value):
    assert classify(value) is None  # content


def test_the_empty_index_agent_is_flagged_at_its_fourth_rephrasing():
    [decision] = decisions(searches(["[]"] * 6))
    assert (decision.rule, decision.action, decision.evidence.hits) == ("no_progress", "flag", 4)
    assert "all found nothing" in decision.reason


def test_hashed_results_are_recognised_by_their_hash():
    assert args_hash([], frozenset()) in EMPTY_RESULT_DIGESTS
    [decision] = decisions(searches(["[]"] * 6, hashed=True))
    assert decision.rule == "no_progress"
    assert decisions(searches(['{"ok": true}'] * 6, hashed=True)) == []


@pytest.mark.parametrize(
    "result",
    ['{"ok": true}', '"Saved."', '"Here is what the knowledge base says about refunds."'],
)
def test_one_same_result_with_content_is_not_a_stall(result):
    """Different edits each answered {"ok": true}; different searches, one canned text."""
    assert decisions(searches([result] * 12)) == []


def test_the_policy_can_make_it_kill_or_switch_it_off():
    agent = searches(["[]"] * 9)
    kill = Policy.from_yaml("defaults: {no_progress: {action: kill}}")
    assert [(d.rule, d.action) for d in decisions(agent, kill)] == [("no_progress", "kill")]
    off = Policy.from_yaml("defaults: {no_progress: {action: 'off'}}")
    assert decisions(agent, off) == []
    downgrade = Policy.from_yaml("defaults: {no_progress: {action: downgrade}}")
    assert [d.action for d in decisions(agent, downgrade)] == ["downgrade", "kill"]
