"""Scoped signals without a broker: where a check finds its agent, what a scoped decision
sends, and that scopes held by the book stay bounded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from spanguard.killswitch.adapters import TraceGate
from spanguard.killswitch.client import KillSwitch, parse_agent
from spanguard.killswitch.signals import AgentKilled, SignalBook, current_agent
from spanguard.schemas.decision import (
    AgentIdentity,
    Decision,
    DecisionScope,
    KillSignal,
    validate,
)

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def agent_kill(service: str = "support", name: str | None = "triage", minutes: int = 30):
    decision = Decision(
        trace_id="a" * 32,
        span_id="b" * 16,
        rule="agent_budget",
        action="kill",
        reason="over budget",
        agent=AgentIdentity(service, name),
        detected_at=NOW.isoformat(timespec="milliseconds"),
        scope=DecisionScope(
            "agent", until=(NOW + timedelta(minutes=minutes)).isoformat(timespec="milliseconds")
        ),
    )
    return KillSignal.from_decision(decision, ttl_seconds=3600)


def test_an_agent_decision_sends_an_agent_kill_lasting_until_its_window_frees():
    signal = agent_kill()
    assert (signal.scope, signal.expires_at) == ("agent", "2026-06-01T12:30:00.000+00:00")
    validate(signal.to_dict(), "kill-signal")
    # A trace's signal stays as it always was: no scope field at all.
    assert "scope" not in KillSignal.from_dict({**signal.to_dict(), "scope": None}).to_dict()


def test_the_agent_comes_from_the_tracer_providers_resource(monkeypatch):
    resource = Resource.create({"service.name": "support", "gen_ai.agent.name": "triage"})
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: TracerProvider(resource=resource))
    assert current_agent() == AgentIdentity("support", "triage")
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    assert current_agent() is None


def test_the_agent_comes_from_the_current_spans_resource_before_the_global_providers(
    monkeypatch,
):
    """An agent on a provider of its own: its spans carry that provider's resource."""
    own = TracerProvider(resource=Resource({"service.name": "support", "gen_ai.agent.name": "x"}))
    global_provider = TracerProvider(resource=Resource({"service.name": "global-service"}))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: global_provider)
    assert current_agent() == AgentIdentity("global-service", None)  # no span: the global one
    with own.get_tracer("test").start_as_current_span("invoke_agent"):
        assert current_agent() == AgentIdentity("support", "x")
        # The provider given comes first; one naming no agent leaves it to the span.
        given = TracerProvider(resource=Resource({"service.name": "given"}))
        assert current_agent(given) == AgentIdentity("given", None)
        assert current_agent(TracerProvider(resource=Resource({}))) == AgentIdentity("support", "x")
    # A provider given that names no agent, and no span: never the global provider's.
    assert current_agent(TracerProvider(resource=Resource({}))) is None
    # A span of a provider whose resource names no agent: the global provider's.
    with TracerProvider(resource=Resource({})).get_tracer("t").start_as_current_span("s"):
        assert current_agent() == AgentIdentity("global-service", None)


def test_a_kill_switch_obeys_the_kill_of_the_agent_its_span_names(monkeypatch):
    """KillSwitch.check() inside an agent's span, no agent nor tracer_provider given: the
    kill of the agent the span's resource names stops it; another agent's span goes on."""
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    switch = KillSwitch(
        "127.0.0.1:9",  # never contacted: the switch is not started
        allow_unsigned=True,
        start=False,
        ack_topic=None,
        clock=lambda: NOW,
    )
    switch.signals.deliver(agent_kill())
    triage = TracerProvider(
        resource=Resource({"service.name": "support", "gen_ai.agent.name": "triage"})
    )
    billing = TracerProvider(
        resource=Resource({"service.name": "support", "gen_ai.agent.name": "billing"})
    )
    try:
        with triage.get_tracer("test").start_as_current_span("invoke_agent triage"):
            assert switch.scope()[1] == AgentIdentity("support", "triage")
            with pytest.raises(AgentKilled) as killed:
                switch.check()
            assert killed.value.signal.scope == "agent"
        with billing.get_tracer("test").start_as_current_span("invoke_agent billing"):
            assert switch.check() is None
    finally:
        switch.close()
    assert switch.unguarded == 0


def test_parse_agent():
    assert parse_agent("support/triage") == AgentIdentity("support", "triage")
    assert parse_agent("support") == AgentIdentity("support", None)
    with pytest.raises(ValueError, match="names no service"):
        parse_agent("/triage")


def test_a_trace_gate_passes_its_scope_to_every_check():
    book = SignalBook(clock=lambda: NOW)
    book.deliver(agent_kill())
    gate = TraceGate(book, trace_id="c" * 32, agent=AgentIdentity("support", "triage"))
    with pytest.raises(AgentKilled):
        gate.check_trace("c" * 32)
    assert TraceGate(book, trace_id="c" * 32).check_trace("c" * 32) is None


def test_scopes_held_are_bounded_and_expired_kills_lift():
    clock = [NOW]
    book = SignalBook(max_traces=3, clock=lambda: clock[0])
    for number in range(10):
        book.deliver(agent_kill(service=f"service-{number}"))
    assert book.tracked_scopes == 3
    with pytest.raises(AgentKilled):
        book.check_scopes(agent=AgentIdentity("service-9", "triage"))
    book.check_scopes(agent=AgentIdentity("service-0", "triage"))  # forgotten: passes
    clock[0] = NOW + timedelta(minutes=30)
    book.check_scopes(agent=AgentIdentity("service-9", "triage"))


def test_an_operators_scoped_kill_and_its_audit_record_keep_their_contracts():
    from spanguard.connectors.manual import manual_decision

    for scope in ({"conversation_id": "conv-1"}, {"agent": AgentIdentity("support", None)}):
        decision = manual_decision(None, "kill", "stop", "alice", **scope)
        validate(decision.to_dict(), "detection")
        signal = KillSignal.from_decision(decision)
        validate(signal.to_dict(), "kill-signal")
        assert signal.stops == decision.scope_kind
    with pytest.raises(ValueError, match="name one of"):
        manual_decision("a" * 32, "kill", "stop", "alice", conversation_id="conv-1")
