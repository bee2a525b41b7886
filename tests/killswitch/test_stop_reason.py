"""The stop reason, machine-readable: a span event on the agent's current span, the fields of
AgentKilled / AgentPaused, and the exit status of an agent run as a process (killswitch/stop.py).
The real OpenTelemetry SDK with its in-memory exporter."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanguard.killswitch import AgentKilled, SignalBook
from spanguard.killswitch.signals import AgentPaused
from spanguard.killswitch.stop import EXIT_KILLED, find_stop
from tests.killswitch.test_pause import pause_signal
from tests.support.kafka_harness import ROOT
from tests.support.spans import kill_signal


@pytest.fixture
def tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("agent"), exporter
    provider.shutdown()


def _trace(span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def _events(exporter, span_name: str):
    (span,) = [s for s in exporter.get_finished_spans() if s.name == span_name]
    return [(e.name, dict(e.attributes or {})) for e in span.events]


def test_a_kill_is_an_event_on_the_current_span_and_fields_of_agentkilled(tracer):
    tracer, exporter = tracer
    book = SignalBook()
    with tracer.start_as_current_span("invoke_agent"), tracer.start_as_current_span("step") as s:
        signal = kill_signal(_trace(s))
        book.deliver(signal)
        with pytest.raises(AgentKilled) as killed:
            book.check(_trace(s))
        with pytest.raises(AgentKilled):
            book.check(_trace(s))  # checked again on the same span: one event says it
    expected = {
        "spanguard.rule": "tool_loop",
        "spanguard.action": "kill",
        "spanguard.decision_id": signal.signal_id,
        "spanguard.scope": "trace",
        "spanguard.reason": "search_docs called 4x in last 4 steps",
    }
    assert _events(exporter, "step") == [("spanguard.stop", expected)]
    assert _events(exporter, "invoke_agent") == []  # the current span only
    error = killed.value
    assert (error.rule, error.action, error.decision_id, error.scope, error.reason) == (
        "tool_loop",
        "kill",
        signal.signal_id,
        "trace",
        signal.reason,
    )


def test_a_downgrade_is_an_event_when_its_message_is_handed_over(tracer):
    tracer, exporter = tracer
    book = SignalBook()
    with tracer.start_as_current_span("step") as s:
        signal = kill_signal(_trace(s), kind="downgrade", message="stop searching")
        book.deliver(signal)
        assert book.check(_trace(s)) == "stop searching"
        assert book.check(_trace(s)) is None
    ((name, attributes),) = _events(exporter, "step")
    assert name == "spanguard.downgrade"
    assert attributes["spanguard.action"] == "downgrade"
    assert attributes["spanguard.decision_id"] == signal.signal_id


def test_a_pause_is_a_stop_event_once_and_agentpaused_carries_its_fields(tracer):
    tracer, exporter = tracer
    book = SignalBook()
    with tracer.start_as_current_span("step") as s:
        signal = replace(pause_signal(), trace_id=_trace(s))
        book.deliver(signal)
        for _ in range(3):  # a waiting agent re-checks: one event
            with pytest.raises(AgentPaused) as paused:
                book.check(_trace(s))
    ((name, attributes),) = _events(exporter, "step")
    assert (name, attributes["spanguard.action"]) == ("spanguard.stop", "pause")
    error = paused.value
    assert (error.action, error.rule, error.decision_id, error.scope) == (
        "pause",
        str(signal.rule),
        signal.signal_id,
        "trace",
    )


def test_a_check_outside_any_span_records_nothing_and_still_raises():
    book, trace_id = SignalBook(), uuid.uuid4().hex
    book.deliver(kill_signal(trace_id))
    with pytest.raises(AgentKilled):
        book.check(trace_id)


def test_the_langchain_adapter_records_on_the_runs_span_where_none_is_current(tracer):
    """OpenInference never makes its LangChain spans current: the event goes on the run's."""
    pytest.importorskip("langchain_core")
    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

    tracer, exporter = tracer
    book = SignalBook()
    handler = SpanguardCallbackHandler(book)
    span = tracer.start_span("tool search_docs")  # not current, as OpenInference keeps it
    book.deliver(kill_signal(_trace(span)))
    with pytest.raises(AgentKilled):
        handler.check_trace(_trace(span), span=span)
    span.end()
    assert [name for name, _ in _events(exporter, "tool search_docs")] == ["spanguard.stop"]


def test_find_stop_reads_a_frameworks_wrapped_error():
    killed = AgentKilled(kill_signal(uuid.uuid4().hex))
    try:
        try:
            raise killed
        except AgentKilled as cause:
            raise RuntimeError("Error in plugin 'spanguard'") from cause
    except RuntimeError as wrapped:
        assert find_stop(wrapped) is killed
    assert find_stop(ValueError("unrelated")) is None


AGENT = """
import sys, uuid
from spanguard.killswitch import AgentKilled, SignalBook
from spanguard.killswitch.stop import exit_on_stop
from tests.support.spans import kill_signal

book, trace = SignalBook(), uuid.uuid4().hex
book.deliver(kill_signal(trace))
with exit_on_stop():
    if sys.argv[1] == "killed":
        try:
            book.check(trace)
        except AgentKilled as killed:
            raise RuntimeError("Error running tool") from killed  # as a framework wraps it
    elif sys.argv[1] == "failed":
        raise ValueError("a bug of the agent's own")
"""


def _run_agent(how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AGENT, how], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_an_agent_process_stopped_by_the_guard_exits_75_with_one_json_line():
    result = _run_agent("killed")
    assert result.returncode == EXIT_KILLED == 75, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    reason = json.loads(line)
    assert reason["spanguard"] == "stopped" and reason["action"] == "kill"
    assert reason["rule"] == "tool_loop" and len(reason["decision_id"]) == 32
    assert reason["scope"] == "trace" and len(reason["trace_id"]) == 32


def test_other_failures_and_success_keep_their_exit_status():
    assert _run_agent("failed").returncode == 1
    assert _run_agent("fine").returncode == 0


# -- the shared vectors: the same event in Python, TypeScript and Go ---------------------------

VECTORS = json.loads((ROOT / "schemas" / "testdata" / "kill-signal-vectors.json").read_text())


@pytest.mark.parametrize("case", VECTORS["stop_events"], ids=lambda case: case["name"])
def test_the_shared_stop_event_vectors(tracer, case):
    from datetime import datetime

    from spanguard.schemas.decision import keyring, read_signal

    tracer, exporter = tracer
    now = datetime.fromisoformat(VECTORS["now"].replace("Z", "+00:00"))
    book = SignalBook(clock=lambda: now)
    book.deliver(read_signal(case["signal"].encode(), keyring([VECTORS["keys"]["current"]]), now))
    check = case["check"]
    with tracer.start_as_current_span("step"):
        for _ in range(2):  # the same check again adds no second event
            try:
                outcome = (
                    "message"
                    if book.check(check["trace"], conversation_id=check.get("conversation"))
                    else "pass"
                )
            except AgentKilled as killed:
                outcome = "killed"
                attributes = case["event"]["attributes"]
                assert killed.rule == attributes["spanguard.rule"]
                assert killed.decision_id == attributes["spanguard.decision_id"]
                assert killed.scope == attributes["spanguard.scope"]
            if outcome != "pass":
                assert outcome == case["expect"]
    assert _events(exporter, "step") == [(case["event"]["name"], case["event"]["attributes"])]
