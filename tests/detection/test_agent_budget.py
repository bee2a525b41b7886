"""The agent scope over time (spanguard/detection/agent_budget.py): budgets per agent over a
rolling window across all of its traces, in record time, with bounded state; and the same
through the guard on real OTLP spans and in-process through GuardingSpanProcessor."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from spanguard.detection.agent_budget import (
    MAX_BUCKETS,
    AgentBudgetGuard,
    AgentUsage,
    bucket_seconds,
)
from spanguard.detection.explain import explain_records
from spanguard.detection.guard import Guard
from spanguard.killswitch import AgentKilled, GuardingSpanProcessor
from spanguard.schemas.decision import AgentIdentity, Decision, KillSignal, validate
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, encode

T0 = 1_779_998_400  # epoch seconds, on a whole hour
HOUR = 3600


def policy(text: str = "{window: 1h, tokens: 10000, action: kill}") -> Policy:
    return Policy.from_yaml(f"defaults:\n  agent_budget: {text}\n")


def usage(at: float, tokens: int, agent: str | None = "triage", service: str = "support"):
    return AgentUsage(
        service, agent, uuid.uuid4().hex, uuid.uuid4().bytes[:8], int(at * 1e9), tokens, 0
    )


def feed(guard: AgentBudgetGuard, records) -> list[Decision]:
    return [d for d in (guard.observe_usage(r) for r in records) if d is not None]


def test_many_small_traces_cross_the_agents_hourly_budget_once():
    guard = AgentBudgetGuard(policy(), clock=lambda: T0 + 1800)
    # 30 traces of 400 tokens, one a minute: each trace is small, the hour holds 12,000.
    decisions = feed(guard, [usage(T0 + 60 * i, 400) for i in range(30)])
    assert len(decisions) == 1
    [decision] = decisions
    assert (decision.rule, decision.action, decision.scope_kind) == (
        "agent_budget",
        "kill",
        "agent",
    )
    assert decision.agent == AgentIdentity("support", "triage")
    assert (
        decision.spend.tokens == 10_400 and decision.spend.token_budget == 10_000
    )  # the 26th trace
    # The window frees when the first bucket leaves it: T0's minute, an hour later.
    assert decision.scope.until == datetime.fromtimestamp(T0 + HOUR, UTC).isoformat(
        timespec="milliseconds"
    )
    validate(decision.to_dict(), "detection")
    signal = KillSignal.from_decision(decision)
    assert (signal.scope, signal.expires_at) == ("agent", decision.scope.until)
    validate(signal.to_dict(), "kill-signal")
    # Another agent of the same service has a window of its own.
    assert feed(guard, [usage(T0 + 1800, 9000, agent="billing")]) == []
    text = explain_records(decision.trace_id, [decision.to_dict()])
    assert "agent budget 10000 tokens per window, every trace of the agent refused until" in text


def test_spend_spread_wider_than_the_window_never_crosses_and_a_new_crossing_decides_again():
    guard = AgentBudgetGuard(policy(), clock=lambda: T0)
    # 9,000 tokens an hour for five hours: never 10,000 within one hour.
    assert feed(guard, [usage(T0 + 600 * i, 1500) for i in range(30)]) == []
    # Crossed, then again after the window freed: two decisions, distinct ids.
    later = T0 + 10 * HOUR
    first = feed(guard, [usage(later, 6000), usage(later + 60, 6000)])
    again = feed(guard, [usage(later + HOUR + 120, 6000), usage(later + HOUR + 180, 6000)])
    assert len(first) == len(again) == 1
    assert first[0].decision_id != again[0].decision_id


def test_usd_budget_and_flag_and_shadow():
    guard = AgentBudgetGuard(policy("{window: 1d, usd: 5}"), clock=lambda: T0)
    records = [usage(T0 + 600 * i, 100) for i in range(6)]
    for record in records:
        record.cost = 1_000_000_000_000  # $1 in pico-dollars
    [decision] = feed(guard, records)
    assert decision.action == "flag" and decision.scope.until is None  # the default action
    assert (decision.spend.cost_micro_usd, decision.spend.budget_micro_usd) == (
        6_000_000,
        5_000_000,
    )
    assert "spent $6.0000 in the last day" in decision.reason
    shadow = AgentBudgetGuard(
        Policy.from_yaml("defaults:\n  action: flag\n  agent_budget: {tokens: 10, action: kill}\n")
    )
    assert feed(shadow, [usage(T0, 11)])[0].action == "flag"


def test_per_agent_policy_matches_service_and_agent_name():
    guard = AgentBudgetGuard(
        Policy.from_yaml(
            "agents:\n  - match: {service.name: support, gen_ai.agent.name: triage}\n"
            "    agent_budget: {window: 600, tokens: 100, action: kill}\n"
        )
    )
    assert guard.enabled
    assert feed(guard, [usage(T0, 101, agent="billing")]) == []
    [decision] = feed(guard, [usage(T0, 101)])
    assert decision.policy.entry == "agents.0"
    assert decision.scope.until == datetime.fromtimestamp(T0 + 600, UTC).isoformat(
        timespec="milliseconds"
    )


def test_a_clock_that_jumps_costs_the_agents_own_window(caplog):
    guard = AgentBudgetGuard(policy(), clock=lambda: T0)
    feed(guard, [usage(T0 + 1200, 4000)])
    # Back in time within the window: counted into the newest bucket, not lost.
    feed(guard, [usage(T0 + 300, 4000)])
    window = guard.windows[("support", "triage")]
    assert (window.late, window.tokens, len(window.buckets)) == (1, 8000, 1)
    # Far forward (a clock in the next year): the window starts afresh, counted, told once.
    with caplog.at_level(logging.WARNING, "spanguard.core"):
        assert feed(guard, [usage(T0 + 365 * 86400, 100)]) == []
        # ... and back to the real time: afresh again, not pinned under the future bucket.
        assert feed(guard, [usage(T0 + 1300, 100)]) == []
    assert (window.resets, window.tokens) == (2, 100)
    assert len([r for r in caplog.records if "starts afresh" in r.message]) == 1
    # Another agent's window is untouched by this one's clock.
    assert feed(guard, [usage(T0 + 1300, 10_001, agent="other")])


def test_state_is_bounded_in_buckets_and_agents():
    guard = AgentBudgetGuard(policy("{window: 1d, tokens: 1000000000}"), max_agents=50)
    assert bucket_seconds(86400) == 360
    feed(guard, [usage(T0 + 60 * i, 1) for i in range(2 * 1440)])  # a span a minute, two days
    window = guard.windows[("support", "triage")]
    assert len(window.buckets) <= MAX_BUCKETS
    assert window.tokens == sum(bucket[1] for bucket in window.buckets)
    feed(guard, [usage(T0, 1, agent=f"agent-{n}") for n in range(500)])
    assert len(guard.windows) == 50 and guard.forgotten == 451


def chat_request(service: str, agent: str, tokens: int):
    # The agent's name on its resource: the usage spans of a trace end before its
    # invoke_agent span, so a name set only there is not known when they are counted.
    recorder = AgentRecorder(service, agent, **{"gen_ai.agent.name": agent})
    recorder.chat(tokens, 0)
    recorder.finish()
    return recorder.trace_id, encode(recorder.finished())


def test_through_the_guard_many_traces_of_one_agent_cross_its_budget():
    budget = policy("{window: 1h, tokens: 5000, action: kill}")
    guard = Guard(budget, agent_budgets=AgentBudgetGuard(budget))
    assert guard.tracks_tokens
    decisions = []
    for _ in range(6):
        _, request = chat_request("support", "triage", 1000)
        decisions += guard.process(request)
    _, other = chat_request("support", "billing", 1000)
    decisions += guard.process(other)
    assert [(d.rule, d.scope_kind, d.agent.name, d.spend.tokens) for d in decisions] == [
        ("agent_budget", "agent", "triage", 6000)
    ]
    validate(decisions[0].to_dict(), "detection")


def test_in_process_an_agent_kill_stops_a_new_trace_of_that_agent_only():
    budget = policy("{window: 1h, tokens: 1000, action: kill}")
    decisions: list[Decision] = []
    provider = TracerProvider(resource=Resource.create({"service.name": "support"}))
    processor = GuardingSpanProcessor(
        SimpleSpanProcessor(InMemorySpanExporter()),
        budget,
        on_decision=decisions.append,
        tracer_provider=provider,
    )
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("agent-framework")

    chat = {
        "gen_ai.operation.name": "chat",
        "gen_ai.usage.input_tokens": 400,
        "gen_ai.usage.output_tokens": 0,
    }

    def run(agent: str, check: bool = False) -> str:
        root = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}
        # The agent's name on its chat spans, as agent frameworks' own spans carry it.
        named = {**chat, "gen_ai.agent.name": agent}
        with tracer.start_as_current_span(f"invoke_agent {agent}", attributes=root) as span:
            with tracer.start_as_current_span("chat", kind=SpanKind.CLIENT, attributes=named):
                pass
            if check:
                processor.check()  # before the run's next tool call
            return format(span.get_span_context().trace_id, "032x")

    for _ in range(3):  # 1,200 tokens in three traces of 400
        run("triage")
    assert [d.rule for d in decisions] == ["agent_budget"]
    # A new trace of the agent is stopped at its first check; the kill names the agent.
    with pytest.raises(AgentKilled) as caught:
        run("triage", check=True)
    assert caught.value.scope == "agent"
    assert caught.value.signal.agent == AgentIdentity("support", "triage")
    with pytest.raises(AgentKilled):
        processor.check(uuid.uuid4().hex, agent=AgentIdentity("support", "triage"))
    # Another agent of the service goes on (its own window: 400 tokens)...
    run("billing", check=True)
    # ... and so does a trace with no spans read yet: the provider's resource names the
    # service only, which a kill of support/triage does not cover.
    assert processor.check(uuid.uuid4().hex) is None
    processor.shutdown()


def test_spanguard_replay_applies_agent_budgets_across_the_inputs_traces(tmp_path):
    import json
    import subprocess
    import sys

    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("defaults:\n  agent_budget: {window: 1h, tokens: 2500, action: kill}\n")
    inputs = []
    for number in range(4):  # four traces of 1,000 tokens, each far under any trace budget
        _, request = chat_request("support", "triage", 1000)
        path = tmp_path / f"run-{number}.pb"
        path.write_bytes(request.SerializeToString())
        inputs.append(str(path))
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "replay", "--policy", str(policy_file), *inputs],
        capture_output=True,
        timeout=120,
    )
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [(r["rule"], r["scope"], r["tokens"]) for r in records] == [
        ("agent_budget", "agent", 3000)
    ], result.stderr.decode()
    assert "scope_until" in records[0]
