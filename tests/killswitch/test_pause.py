"""`action: pause` without Kafka: the guard's decision, the signal's contract, the SignalBook's
wait (release, kill, the deadline's fallback), the adapters and what the page and webhook say."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from spanguard.alerting.pagerduty import build_event
from spanguard.alerting.webhook import summary_of
from spanguard.config.settings import PagerSettings
from spanguard.detection.guard import Guard
from spanguard.killswitch.adapters import TraceGate
from spanguard.killswitch.signals import AgentKilled, AgentPaused, SignalBook
from spanguard.schemas.decision import KillSignal, Pause, read_signal, sign, validate
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, encode

PAUSE = Policy.from_yaml("defaults:\n  action: pause\n  pause: {timeout: 2, fallback: kill}\n")
KEY = b"pause-tests-signing-key-0123456789"


def loop_decisions(policy: Policy, calls: int):
    agent = AgentRecorder("nightly-reconciler", "reconciler")
    guard = Guard(policy)
    decisions = []
    for _ in range(calls):
        span = agent.tool("search_docs", {"query": "refund policy"})
        decisions += guard.process(encode([span]))
    return decisions


def pause_signal(seconds: float = 30.0, fallback: str = "kill") -> KillSignal:
    [decision] = loop_decisions(PAUSE, 4)
    until = datetime.now(UTC) + timedelta(seconds=seconds)
    decision = replace(decision, pause=Pause(until.isoformat(timespec="milliseconds"), fallback))
    return KillSignal.from_decision(decision)


def test_the_guard_pauses_once_then_the_same_rule_kills() -> None:
    decisions = loop_decisions(PAUSE, 8)
    assert [d.action for d in decisions] == ["pause", "kill"]
    pause = decisions[0]
    assert pause.pause.fallback == "kill"
    waited = datetime.fromisoformat(pause.pause.until) - datetime.fromisoformat(pause.detected_at)
    assert abs(waited.total_seconds() - 2.0) < 0.01
    validate(pause.to_dict(), "detection")
    signal = KillSignal.from_decision(pause).to_dict()
    validate(signal, "kill-signal")
    assert "pause_until" not in decisions[1].to_dict()  # other records stay as they were


def test_a_token_budget_pauses_once_and_then_stands() -> None:
    policy = Policy.from_yaml("defaults: {action: pause, token_budget: 500}\n")
    agent = AgentRecorder("ticket-bot")
    guard = Guard(policy)
    actions = [d.action for _ in range(4) for d in guard.process(encode([agent.chat(300, 100)]))]
    assert actions == ["pause"]


def test_a_pause_signal_without_its_deadline_is_refused() -> None:
    record = pause_signal().to_dict()
    del record["pause_until"]
    with pytest.raises(Exception, match="pause_until"):
        validate(record, "kill-signal")


def test_a_signed_pause_reads_back_and_a_forged_deadline_does_not() -> None:
    record = sign(pause_signal().to_dict(), KEY)
    keys = {record["key_id"]: KEY}
    assert read_signal(json.dumps(record).encode(), keys).kind == "pause"
    record["pause_until"] = "2099-01-01T00:00:00.000+00:00"  # a longer wait, forged
    with pytest.raises(Exception, match="forged"):
        read_signal(json.dumps(record).encode(), keys)


def test_check_raises_paused_and_wait_returns_on_release() -> None:
    book = SignalBook()
    signal = pause_signal()
    book.deliver(signal)
    with pytest.raises(AgentPaused) as paused:
        book.check(signal.trace_id)
    assert paused.value.fallback == "kill" and "spanguard release" in str(paused.value)
    release = replace(signal, signal_id="1" * 32, kind="release", reason="go on")
    threading.Timer(0.3, book.deliver, (release,)).start()
    started = time.monotonic()
    assert book.wait(signal.trace_id) is None
    assert 0.2 < time.monotonic() - started < 5
    assert book.check(signal.trace_id) is None  # it goes on


def test_wait_raises_killed_when_the_operator_kills() -> None:
    book = SignalBook()
    signal = pause_signal()
    book.deliver(signal)
    kill = replace(signal, signal_id="2" * 32, kind="kill", reason="stop it")
    threading.Timer(0.3, book.deliver, (kill,)).start()
    with pytest.raises(AgentKilled, match="stop it"):
        book.wait(signal.trace_id)


def test_unanswered_the_fallback_applies_at_the_deadline() -> None:
    book = SignalBook()
    killing = pause_signal(seconds=0.5, fallback="kill")
    book.deliver(killing)
    started = time.monotonic()
    with pytest.raises(AgentKilled, match="fallback kills"):
        book.wait(killing.trace_id)
    assert 0.3 < time.monotonic() - started < 5
    with pytest.raises(AgentKilled):  # and it stays killed
        book.check(killing.trace_id)
    going_on = pause_signal(seconds=0.3, fallback="release")
    book.deliver(going_on)
    assert book.wait(going_on.trace_id) is None


def test_wait_with_a_timeout_raises_paused_again() -> None:
    book = SignalBook()
    signal = pause_signal()
    book.deliver(signal)
    with pytest.raises(AgentPaused):
        book.wait(signal.trace_id, timeout=0.2)


def paused_gate(release_id: str) -> tuple[SignalBook, TraceGate, KillSignal]:
    """A book holding a pause, the adapters' gate on its trace, and a release that answers it."""
    book = SignalBook()
    signal = pause_signal()
    book.deliver(signal)
    gate = TraceGate(book, signal.trace_id, None)
    return book, gate, replace(signal, signal_id=release_id, kind="release", reason="go on")


def test_the_adapters_gate_waits_for_the_answer() -> None:
    book, gate, release = paused_gate("3" * 32)
    threading.Timer(0.3, book.deliver, (release,)).start()
    gate.before_tool()  # returns once released


def test_the_page_and_the_webhook_say_the_agent_waits_and_how_to_answer() -> None:
    [decision] = loop_decisions(PAUSE, 4)
    record = decision.to_dict()
    summary = summary_of(record)
    assert "waiting for an answer" in summary
    assert f"spanguard release {decision.trace_id}" in summary
    assert f"spanguard kill {decision.trace_id}" in summary
    assert f"unanswered by {decision.pause.until}, it is killed" in summary
    event = build_event(record, PagerSettings.from_sources({"routing_key": "r" * 32}))
    assert f"spanguard release {decision.trace_id}" in event["payload"]["summary"]
    assert event["payload"]["custom_details"]["pause_fallback"] == "kill"


def test_the_async_gate_waits_off_the_event_loop() -> None:
    import asyncio

    book, gate, release = paused_gate("4" * 32)

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        asyncio.get_running_loop().call_later(0.5, book.deliver, release)
        await gate.before_tool_async()
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 10  # the loop kept running while the agent waited


def test_the_in_process_processor_pauses_and_falls_back_to_a_kill() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanguard.killswitch.processor import GuardingSpanProcessor

    policy = Policy.from_yaml("defaults: {action: pause, pause: {timeout: 0.5, fallback: kill}}")
    processor = GuardingSpanProcessor(
        SimpleSpanProcessor(InMemorySpanExporter()), policy, tracer_provider=TracerProvider()
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("pause-tests")
    with tracer.start_as_current_span("invoke_agent reconciler") as root:
        trace_id = format(root.get_span_context().trace_id, "032x")
        for _ in range(4):
            with tracer.start_as_current_span(
                "execute_tool search_docs",
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "search_docs",
                    "gen_ai.tool.call.arguments": '{"query": "refund policy"}',
                },
            ):
                pass
        with pytest.raises(AgentPaused):
            processor.check()
        with pytest.raises(AgentKilled, match="fallback kills"):
            processor.wait()
    assert processor.signals.is_killed(trace_id)
