"""The gateway guardrail's logic (spanguard.killswitch.gateway) on bad input, without LiteLLM:
what a request names, what passes unguarded, an unreachable kill topic, and LiteLLM's spans
read by the conventions (tests/fixtures/gateway, recorded from the real proxy)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.detection.conventions.adapt import adapt_span
from spanguard.detection.conventions.events import ToolCall
from spanguard.detection.conventions.gateway import gateway_calls
from spanguard.detection.guard import Guard
from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.gateway import (
    GatewayGuard,
    RequestFacts,
    derived_trace_id,
    request_facts,
)
from spanguard.schemas.otlp_view import view_of
from tests.support.spans import tool_contain as contain
from tests.support.waiting import wait_until

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gateway" / "litellm-otel.json"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _data(headers=None, **body):
    return {"proxy_server_request": {"headers": headers or {}}, "metadata": {}, **body}


@pytest.mark.parametrize(
    ("traceparent", "why"),
    [
        (None, "absent"),
        ("00-xyz-00f067aa0ba902b7-01", "malformed"),
        (f"00-{TRACE}-0000000000000000-01", "malformed"),
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", "malformed"),
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", "malformed"),  # W3C: lowercase only
        ("00-" + "a" * 100_000, "malformed"),  # huge: refused by its length, never parsed
        (f"00-{TRACE}-00f067aa0ba902b7-01,00-{TRACE}-00f067aa0ba902b8-01", "repeated"),
    ],
)
def test_a_traceparent_that_names_no_trace_is_no_trace(traceparent, why):
    headers = {} if traceparent is None else {"traceparent": traceparent}
    facts = request_facts(_data(headers))
    assert facts.trace_id is None and facts.no_trace == why


def test_a_valid_traceparent_names_its_trace():
    facts = request_facts(_data({"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}))
    assert facts.trace_id == TRACE and facts.no_trace is None


def test_two_traceparent_headers_the_proxy_read_apart_are_repeated():
    """A dict of headers keeps the last; LiteLLM's spans took the first: they disagree."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext

    other = SpanContext(int("5" * 32, 16), 1, is_remote=True)
    data = _data({"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})
    data["metadata"]["litellm_parent_otel_span"] = NonRecordingSpan(other)
    assert request_facts(data).no_trace == "repeated"


def test_what_a_request_names_its_run_conversation_and_agent_by():
    facts = request_facts(
        _data({"X-Spanguard-Agent": "billing/refunds"}, litellm_session_id="s-1", user="u-1")
    )
    assert facts.conversation_id == "s-1" and facts.run == "s-1"
    assert facts.agent.service == "billing" and facts.agent.name == "refunds"
    headers = {"x-spanguard-run": "r-9", "x-spanguard-conversation": "c-2"}
    facts = request_facts(_data(headers, user="u-1"), key_alias="support-key")
    assert (facts.run, facts.conversation_id, facts.agent.service) == ("r-9", "c-2", "support-key")
    assert request_facts(_data(user="u-1")).agent.service == "u-1"
    # Longer than any id a signal carries: not a name at all.
    huge = request_facts(_data({"x-spanguard-run": "r" * 10_000}))
    assert huge.run is None


def test_the_derived_trace_is_stable_and_a_trace_id():
    assert derived_trace_id("run-1") == derived_trace_id("run-1") != derived_trace_id("run-2")
    assert len(derived_trace_id("run-1")) == 32 and int(derived_trace_id("run-1"), 16)


def _unreachable() -> KillSwitch:
    """A real KillSwitch on a port no broker listens on: its start fails (after its metadata
    wait), as it does when the proxy cannot reach the kill topic."""
    return KillSwitch("127.0.0.1:1", allow_unsigned=True, start=False)


def said_unreadable(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "cannot be read" in r.getMessage()]


def test_an_unreachable_kill_topic_fails_open_by_default_and_says_so_once(caplog):
    caplog.set_level(logging.WARNING, "spanguard.killswitch.gateway")
    guard = GatewayGuard(_unreachable, retry_seconds=60)
    try:
        # The switch's metadata wait, then its error, said: the starter then waits
        # retry_seconds, so the wait is for what it says, not for the starter to end.
        wait_until(lambda: said_unreadable(caplog), 25, "the kill topic said unreadable")
        assert not guard.wait_ready(0)
        facts = RequestFacts(TRACE, None, None, None, None)
        verdicts = [asyncio.run(guard.check(facts)) for _ in range(3)]
        assert all(v.refusal is None for v in verdicts)
        assert guard.unguarded["unreachable"] == 3
        said = said_unreadable(caplog)
        assert len(said) == 1 and "fail_open" in said[0].getMessage()
    finally:
        guard.close()


def test_fail_closed_refuses_while_the_kill_topic_cannot_be_read():
    guard = GatewayGuard(_unreachable, unreachable="fail_closed", retry_seconds=60)
    try:
        verdict = asyncio.run(guard.check(RequestFacts(TRACE, None, None, None, None)))
        assert verdict.refusal is not None and verdict.refusal.status == 503
        assert "fail_closed" in verdict.refusal.body["error"]
    finally:
        guard.close()
    with pytest.raises(ValueError):
        GatewayGuard(_unreachable, unreachable="maybe")


# -- LiteLLM's spans, as the real proxy's otel callback wrote them ---------------------------


def _fixture_spans():
    request = ParseDict(json.loads(FIXTURE.read_text()), ExportTraceServiceRequest())
    return request, [
        (scope_spans.scope.name, span)
        for resource_spans in view_of(request).resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if span.name == "litellm_request"
    ]


def test_litellm_spans_yield_the_tool_calls_their_requests_answer():
    _, spans = _fixture_spans()
    assert [scope for scope, _ in spans] == ["litellm"] * 4
    per_span = [gateway_calls(span) for _, span in spans]
    # The first request answers nothing; each later one the call the previous reply asked for.
    assert [len(calls) for calls in per_span] == [0, 1, 1, 1]
    calls = [call for calls in per_span for call in calls]
    assert {call.tool_name for call in calls} == {"search_docs"}
    assert all(call.arguments == {"query": "refund policy"} for call in calls)
    assert all(call.result == "no results" for call in calls)
    assert len({call.call_id for call in calls}) == 3 and len({c.span_id for c in calls}) == 3
    assert all(call.start_time_unix_nano == 0 for call in calls)
    # adapt_span: the calls, then the span's own usage event.
    events = adapt_span(spans[1][1], scope="litellm")
    assert isinstance(events, tuple) and isinstance(events[0], ToolCall)
    # The same span under another scope is read as before: usage only.
    assert not isinstance(adapt_span(spans[1][1], scope="other"), tuple)


def test_the_guard_kills_the_loop_litellm_spans_show():
    request, _ = _fixture_spans()
    decisions = Guard().process(request)
    assert [(d.rule, d.action, d.trace_id) for d in decisions] == [("tool_loop", "kill", TRACE)]
    assert decisions[0].evidence.tool_name == "search_docs"
    # Delivered again (an exporter retry): nothing new.
    guard = Guard()
    guard.process(request)
    assert guard.process(request) == []


# -- contained tools leave the request ------------------------------------------------------


def _tools(*names: str) -> list[dict]:
    return [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in names
    ]


def test_contained_tools_are_taken_out_of_the_request_unless_every_tool_is(caplog):
    caplog.set_level(logging.WARNING, "spanguard.killswitch.gateway")
    guard = GatewayGuard(_unreachable, retry_seconds=60)
    switch = KillSwitch("127.0.0.1:9", allow_unsigned=True, start=False, ack_topic=None)
    guard.switch = switch
    try:
        data = _data(tools=_tools("search_docs", "web_search"))
        assert guard.remove_contained_tools(data) == []
        switch.signals.deliver(contain("search_docs", "docs-mcp"))
        forced = {"type": "function", "function": {"name": "search_docs"}}
        data = _data(tools=_tools("search_docs", "web_search"), tool_choice=forced)
        assert guard.remove_contained_tools(data) == ["search_docs"]
        assert data["tools"] == _tools("web_search") and "tool_choice" not in data
        legacy = _data(functions=[{"name": "search_docs"}, {"name": "web_search"}])
        assert guard.remove_contained_tools(legacy) == ["search_docs"]
        assert legacy["functions"] == [{"name": "web_search"}]
        assert guard.tools_removed["search_docs"] == 2
        for _ in range(2):
            alone = _data(tools=_tools("search_docs"))
            assert guard.remove_contained_tools(alone) == []
            assert alone["tools"] == _tools("search_docs")  # the model's only tool stays
        assert guard.all_tools_contained == 2
        said = [r for r in caplog.records if "every tool" in r.getMessage()]
        assert len(said) == 1 and "search_docs" in said[0].getMessage()
        huge = _data(tools=[{"type": "function", "function": {"name": "x" * 100_000}}])
        assert guard.remove_contained_tools(huge) == []
    finally:
        guard.close()
        switch.close()
