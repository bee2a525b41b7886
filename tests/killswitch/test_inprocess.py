"""In-process mode with the real SDK: GuardingSpanProcessor around a BatchSpanProcessor."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import ProxyTracerProvider, SpanContext, SpanKind, TraceFlags

from spanguard.killswitch import AgentKilled, GuardingSpanProcessor
from spanguard.killswitch.processor import DECISION_SPAN_NAME, INSTRUMENTATION_SCOPE
from spanguard.killswitch.signals import current_trace_id
from spanguard.schemas.decision import Decision, validate
from spanguard.schemas.policy import Policy

REFUND = {"query": "refund policy"}
Arguments = Callable[[int], tuple[str, dict[str, Any]]]


def looping(step: int) -> tuple[str, dict[str, Any]]:
    # The demo's flaky-index agent: the same query, only a volatile key changes.
    return "search_docs", {**REFUND, "timestamp": step}


def research(step: int) -> tuple[str, dict[str, Any]]:
    return ("search_web", "fetch_pdf", "summarize")[step % 3], {"q": f"topic {step}"}


def every_fourth_refund(step: int) -> tuple[str, dict[str, Any]]:
    # REFUND at most 3 times in any 10 calls: never a loop, but one if traces were mixed up.
    return ("search_docs", REFUND) if step % 4 == 0 else research(step)


class Fleet:
    """One agent process: a TracerProvider whose spans go through the guard to an exporter."""

    def __init__(self, policy: Policy | None = None, **options: Any) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "support-bot"}))
        self.decisions: list[Decision] = []
        options.setdefault("on_decision", self.decisions.append)
        options.setdefault("tracer_provider", self.provider)
        self.processor = GuardingSpanProcessor(BatchSpanProcessor(self.exporter), policy, **options)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("agent-framework")

    def exported(self) -> list[ReadableSpan]:
        assert self.provider.force_flush()
        return list(self.exporter.get_finished_spans())

    def decision_spans(self) -> list[ReadableSpan]:
        return [s for s in self.exported() if s.name == DECISION_SPAN_NAME]


@dataclass
class Run:
    trace_id: str = ""
    calls: int = 0
    killed: AgentKilled | None = None
    messages: list[tuple[int, str]] = field(default_factory=list)  # (before call #, message)


def tool_attributes(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.arguments": json.dumps(arguments),
    }


CHAT = {
    "gen_ai.operation.name": "chat",
    "gen_ai.usage.input_tokens": 300,
    "gen_ai.usage.output_tokens": 40,
}


def run_agent(fleet: Fleet, arguments: Arguments, calls: int, agent: str = "support") -> Run:
    """An agent loop that asks the killswitch before each tool call, as an adapter would."""
    run = Run()
    root_attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}
    try:
        with fleet.tracer.start_as_current_span(
            f"invoke_agent {agent}", attributes=root_attributes
        ) as root:
            run.trace_id = format(root.get_span_context().trace_id, "032x")
            for step in range(calls):
                message = fleet.processor.check()
                if message is not None:
                    run.messages.append((step + 1, message))
                with fleet.tracer.start_as_current_span(
                    "chat gpt-4o", kind=SpanKind.CLIENT, attributes=CHAT
                ):
                    pass
                tool, args = arguments(step)
                with fleet.tracer.start_as_current_span(
                    f"execute_tool {tool}", attributes=tool_attributes(tool, args)
                ):
                    run.calls += 1
    except AgentKilled as exc:
        run.killed = exc
    return run


async def run_agent_async(fleet: Fleet, arguments: Arguments, calls: int) -> Run:
    """The same loop in asyncio: the current span, hence the trace checked, is per task."""
    run = Run()
    try:
        with fleet.tracer.start_as_current_span("invoke_agent async") as root:
            run.trace_id = format(root.get_span_context().trace_id, "032x")
            for step in range(calls):
                fleet.processor.check()
                await asyncio.sleep(0)  # let the other agents run between check and call
                tool, args = arguments(step)
                with fleet.tracer.start_as_current_span(
                    f"execute_tool {tool}", attributes=tool_attributes(tool, args)
                ):
                    run.calls += 1
                await asyncio.sleep(0)
    except AgentKilled as exc:
        run.killed = exc
    return run


# -- the demo's two agents ---------------------------------------------------------------


def test_looping_agent_is_stopped_before_its_fourth_call_and_research_agent_finishes():
    fleet = Fleet()
    loop = run_agent(fleet, looping, calls=20)
    deep = run_agent(fleet, research, calls=80, agent="research")

    assert loop.calls == 3  # the 3rd identical call ended; the check before the 4th raised
    assert loop.killed is not None
    assert loop.killed.trace_id == loop.trace_id
    assert loop.killed.reason == "search_docs called 3x in last 3 steps"
    assert loop.killed.signal.kind == "kill"
    validate(loop.killed.signal.to_dict(), "kill-signal")

    assert (deep.calls, deep.killed) == (80, None)
    assert [(d.trace_id, d.rule, d.action) for d in fleet.decisions] == [
        (loop.trace_id, "tool_loop", "kill")
    ]
    # The kill outlives the exception: every later check of that trace raises again.
    with pytest.raises(AgentKilled):
        fleet.processor.check(loop.trace_id)
    assert fleet.processor.check(deep.trace_id) is None


def test_decision_span_reaches_the_exporter_under_the_span_that_tripped_it():
    fleet = Fleet()
    loop = run_agent(fleet, looping, calls=20)
    exported = fleet.exported()

    decisions = [s for s in exported if s.name == DECISION_SPAN_NAME]
    assert len(decisions) == 1
    span = decisions[0]
    tool_spans = [s for s in exported if s.name == "execute_tool search_docs"]
    assert len(tool_spans) == 3
    third = tool_spans[2]
    assert format(span.context.trace_id, "032x") == loop.trace_id
    assert span.parent is not None and span.parent.span_id == third.context.span_id
    assert span.instrumentation_scope.name == INSTRUMENTATION_SCOPE
    assert span.resource.attributes["service.name"] == "support-bot"
    decision = fleet.decisions[0]
    attributes = dict(span.attributes)
    assert {key: attributes[key] for key in list(attributes)[:6]} == {
        "spanguard.rule": "tool_loop",
        "spanguard.action": "kill",
        "spanguard.reason": "search_docs called 3x in last 3 steps",
        "spanguard.tool_name": "search_docs",
        "spanguard.args_hash": decision.evidence.args_hash,
        "spanguard.hits": 3,
    }
    assert len(decision.evidence.args_hash) == 16
    assert attributes["spanguard.decision_id"] == decision.decision_id
    assert decision.span_id == format(third.context.span_id, "016x")
    # Every span of the agent was exported as well: 3 chat, 3 tool, the root.
    assert len(exported) == 3 + 3 + 1 + 1


def test_failing_on_decision_callback_never_breaks_span_export(caplog):
    calls: list[Decision] = []

    def broken(decision: Decision) -> None:
        calls.append(decision)
        raise RuntimeError("pager down")

    fleet = Fleet(on_decision=broken)
    with caplog.at_level(logging.ERROR, logger="spanguard.killswitch"):
        loop = run_agent(fleet, looping, calls=20)

    assert len(calls) == 1
    assert loop.calls == 3 and loop.killed is not None  # the kill still arrived
    exported = fleet.exported()
    assert len(exported) == 3 + 3 + 1 + 1  # agent spans and the decision span
    assert sum(s.name == DECISION_SPAN_NAME for s in exported) == 1
    assert fleet.processor.errors == 1
    assert "on_decision callback raised" in caplog.text
    assert "pager down" in caplog.text  # logged with its traceback


def test_a_failing_guard_never_reaches_the_agent_nor_loses_spans(monkeypatch, caplog):
    fleet = Fleet()

    class ExplodingGuard:
        """The processor's guard, failing on every request (the compiled Guard's methods
        cannot be patched one by one)."""

        def __init__(self, guard: Any) -> None:
            self.agent_budgets, self.clock = guard.agent_budgets, guard.clock

        def process(self, request: Any) -> list[Decision]:
            raise ValueError("core bug")

    monkeypatch.setattr(fleet.processor, "guard", ExplodingGuard(fleet.processor.guard))
    with caplog.at_level(logging.ERROR, logger="spanguard.killswitch"):
        loop = run_agent(fleet, looping, calls=6)
    assert (loop.calls, loop.killed) == (6, None)
    assert len(fleet.exported()) == 6 + 6 + 1
    assert "core bug" in caplog.text


def test_marking_the_ended_span_raises_because_an_ended_span_is_read_only():
    class MarkingProcessor(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            span.set_attribute("loop.detected", True)  # type: ignore[attr-defined]

    provider = TracerProvider()
    provider.add_span_processor(MarkingProcessor())
    with pytest.raises(AttributeError, match="set_attribute"):
        provider.get_tracer("t").start_span("execute_tool").end()


# -- downgrade ---------------------------------------------------------------------------


def test_downgrade_hands_the_message_once_then_kills():
    fleet = Fleet(Policy.from_mapping({"defaults": {"action": "downgrade"}}))
    loop = run_agent(fleet, looping, calls=20)

    assert loop.messages == [
        (
            4,
            "You called search_docs 3 times with the same arguments; the tool returns the same"
            " result. Try a different approach or stop and report what you found.",
        )
    ]
    # The window restarted with the downgrade: 3 more identical calls, then the kill.
    assert loop.calls == 6 and loop.killed is not None
    assert [d.action for d in fleet.decisions] == ["downgrade", "kill"]
    assert [s.attributes["spanguard.action"] for s in fleet.decision_spans()] == [
        "downgrade",
        "kill",
    ]


# -- concurrency -------------------------------------------------------------------------


def test_concurrent_agents_in_threads_get_exactly_their_own_kills():
    fleet = Fleet()
    agents = 8
    barrier = threading.Barrier(agents)
    runs: list[Run | None] = [None] * agents

    def agent(index: int) -> None:
        barrier.wait()
        arguments = looping if index % 2 == 0 else every_fourth_refund
        runs[index] = run_agent(fleet, arguments, calls=150, agent=f"agent-{index}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so spans of all traces interleave
    try:
        threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)

    assert all(run is not None for run in runs)
    loopers = [run for i, run in enumerate(runs) if i % 2 == 0]
    others = [run for i, run in enumerate(runs) if i % 2 == 1]
    assert len({run.trace_id for run in runs}) == agents
    for run in loopers:
        assert run.calls == 3
        assert run.killed is not None and run.killed.trace_id == run.trace_id
    for run in others:
        assert (run.calls, run.killed) == (150, None)
    assert sorted(d.trace_id for d in fleet.decisions) == sorted(r.trace_id for r in loopers)
    assert sorted(format(s.context.trace_id, "032x") for s in fleet.decision_spans()) == sorted(
        r.trace_id for r in loopers
    )
    assert fleet.processor.errors == 0
    # One shared core: no update lost between threads (each counted every call it was shown).
    assert fleet.processor.guard.stats.tool_calls == sum(run.calls for run in runs)
    assert len(fleet.processor.guard.states) == 0  # every root ended


def test_asyncio_tasks_each_check_their_own_trace():
    fleet = Fleet()

    async def main() -> list[Run]:
        return list(
            await asyncio.gather(
                run_agent_async(fleet, looping, 20),
                run_agent_async(fleet, every_fourth_refund, 20),
                run_agent_async(fleet, looping, 20),
            )
        )

    first, other, second = asyncio.run(main())
    assert first.calls == 3 and first.killed and first.killed.trace_id == first.trace_id
    assert second.calls == 3 and second.killed and second.killed.trace_id == second.trace_id
    assert (other.calls, other.killed) == (20, None)


# -- per-trace state: bounded ------------------------------------------------------------


def test_state_is_evicted_when_the_root_span_ends():
    fleet = Fleet()
    tracer = fleet.tracer
    with tracer.start_as_current_span("invoke_agent support") as root:
        trace_id = format(root.get_span_context().trace_id, "032x")
        with tracer.start_as_current_span(
            "execute_tool search_docs", attributes=tool_attributes("search_docs", REFUND)
        ):
            pass
        assert trace_id in fleet.processor.guard.states
        # A child span without any GenAI attribute is not the end of the trace.
        with tracer.start_as_current_span("GET /kb"):
            pass
        assert trace_id in fleet.processor.guard.states
    assert trace_id not in fleet.processor.guard.states


def test_idle_traces_expire_after_the_ttl_and_open_traces_are_capped():
    now = [1_000.0]
    fleet = Fleet(ttl_seconds=60, max_traces=3, clock=lambda: now[0])
    tracer = fleet.tracer

    def tool_call_in_new_trace() -> str:
        # A root that stays open (never ends here), with one tool call under it.
        root = tracer.start_span("invoke_agent")
        with tracer.start_as_current_span(
            "execute_tool search_docs",
            context=trace.set_span_in_context(root),
            attributes=tool_attributes("search_docs", REFUND),
        ):
            pass
        return format(root.get_span_context().trace_id, "032x")

    idle = tool_call_in_new_trace()
    now[0] += 61
    fresh = tool_call_in_new_trace()
    assert list(fleet.processor.guard.states) == [fresh]  # the idle one expired

    opened = [tool_call_in_new_trace() for _ in range(4)]
    assert list(fleet.processor.guard.states) == opened[-3:]  # capped, oldest dropped first
    assert idle not in fleet.processor.guard.states


def test_own_decision_spans_are_never_fed_back_to_the_guard():
    inner = RecordingProcessor()
    processor = GuardingSpanProcessor(inner, tracer_provider=TracerProvider())
    trace_id, parent = 0x5EED, SpanContext(0x5EED, 0xA, False, TraceFlags(1))
    for index in range(6):
        # Shaped like a looping tool span, but ours: must reach the exporter, not the core.
        processor.on_end(
            ReadableSpan(
                DECISION_SPAN_NAME,
                context=SpanContext(trace_id, 0x100 + index, False, TraceFlags(1)),
                parent=parent,
                attributes=tool_attributes("search_docs", REFUND),
            )
        )
    assert processor.guard.stats.spans == 0
    assert len(inner.calls) == 6
    assert processor.check(format(trace_id, "032x")) is None


# -- plumbing ------------------------------------------------------------------------------


class RecordingProcessor(SpanProcessor):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.calls.append("on_start")

    def _on_ending(self, span: Any) -> None:
        self.calls.append("_on_ending")

    def on_end(self, span: ReadableSpan) -> None:
        self.calls.append("on_end")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.calls.append(f"force_flush {timeout_millis}")
        return True

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_every_call_is_forwarded_to_the_wrapped_processor():
    inner = RecordingProcessor()
    provider = TracerProvider()
    processor = GuardingSpanProcessor(inner, tracer_provider=provider)
    provider.add_span_processor(processor)
    provider.get_tracer("t").start_span("work").end()
    assert processor.force_flush(1234)
    provider.shutdown()
    assert inner.calls == ["on_start", "_on_ending", "on_end", "force_flush 1234", "shutdown"]


def test_decisions_use_the_global_provider_when_none_is_passed(monkeypatch, caplog):
    fleet = Fleet(tracer_provider=None)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: ProxyTracerProvider())
    with caplog.at_level(logging.WARNING, logger="spanguard.killswitch"):
        unset = run_agent(fleet, looping, calls=20)
    # No provider to make a span with: the kill still works, the gap is said once.
    assert unset.killed is not None
    assert fleet.decision_spans() == []
    assert "not recorded as spans" in caplog.text

    monkeypatch.setattr(trace, "get_tracer_provider", lambda: fleet.provider)
    later = run_agent(fleet, looping, calls=20)
    assert later.killed is not None
    assert [format(s.context.trace_id, "032x") for s in fleet.decision_spans()] == [later.trace_id]


def test_check_reads_the_current_span_and_is_none_outside_any(caplog):
    fleet = Fleet()
    assert current_trace_id() is None
    with caplog.at_level(logging.WARNING, logger="spanguard.killswitch"):
        assert fleet.processor.check() is None
        assert fleet.processor.check() is None
        with fleet.tracer.start_as_current_span("invoke_agent") as root:
            assert current_trace_id() == format(root.get_span_context().trace_id, "032x")
            assert fleet.processor.check() is None
    # Outside any span the check is not guarded: counted each time, warned about once.
    assert fleet.processor.unguarded == 2
    warnings = [r.getMessage() for r in caplog.records if "NOT guarded" in r.getMessage()]
    assert len(warnings) == 1 and "GuardingSpanProcessor.check()" in warnings[0], warnings


# -- the same core, the same results ---------------------------------------------------------


def test_the_processor_decides_exactly_as_the_core_on_full_otlp_requests():
    """The processor encodes a slim copy of each span; the core must not see a difference."""
    from spanguard.detection.guard import Guard
    from tests.support.spans import AgentRecorder, one_request_per_span

    policy = Policy.from_mapping(
        {
            "agents": [
                # A resource attribute and a span attribute the core only reads for matching.
                {"match": {"team": "payments"}, "loop": {"window": 10, "threshold": 3}},
                {"match": {"app.tenant": "acme"}, "action": "downgrade", "token_budget": 2500},
            ]
        }
    )
    payments = AgentRecorder("refunds", "refund-agent", team="payments", region="eu")
    tenant = AgentRecorder("support-bot", "support")
    for step in range(5):
        payments.tool("search_docs", {**REFUND, "nonce": step}, call_id=f"call_{step}")
        payments.span(  # the bare name, no operation name
            "execute_tool",
            {"gen_ai.tool.name": "lookup", "gen_ai.tool.call.arguments": '{"id": 7}'},
        )
        payments.span(  # OpenInference
            "read_page",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "read_page",
                "tool.parameters": '{"url": "string"}',
                "input.value": json.dumps({"url": "https://kb/refunds"}),
                "http.url": "https://kb/refunds",
            },
        )
        payments.span(  # strands: the arguments live in an event
            "execute_tool fetch",
            {"gen_ai.tool.name": "fetch"},
            events=[("gen_ai.tool.message", {"content": json.dumps({"page": 1})})],
        )
        payments.span("GET /health", {"http.request.method": "GET"})
        tenant.span(
            "execute_tool search_docs",
            {**tool_attributes("search_docs", REFUND), "app.tenant": "acme"},
        )
        tenant.chat(400, 200, **{"app.tenant": "acme"})
    # Root spans end last, as in real runs (the processor forgets a trace at its root's end).
    tenant_children = tenant.finished()
    spans = [*payments.finished(), *tenant_children, tenant.finish()]
    spans.append(payments.finish(**{"gen_ai.aggregated_usage.input_tokens": 10}))

    reference = Guard(policy)
    expected = [d for request in one_request_per_span(spans) for d in reference.process(request)]
    got: list[Decision] = []
    processor = GuardingSpanProcessor(
        RecordingProcessor(), policy, got.append, tracer_provider=TracerProvider()
    )
    for span in spans:
        processor.on_end(span)

    def comparable(decision: Decision) -> dict[str, Any]:
        return {k: v for k, v in decision.to_dict().items() if k != "detected_at"}

    assert len(expected) == 3
    assert {(d.agent.service, d.rule, d.action) for d in expected} >= {
        ("refunds", "tool_loop", "kill"),
        ("support-bot", "tool_loop", "downgrade"),
        ("support-bot", "token_budget", "kill"),
    }
    assert [comparable(d) for d in got] == [comparable(d) for d in expected]
    for name in ("tool_calls", "token_events", "missing_arguments", "decisions"):
        assert getattr(processor.guard.stats, name) == getattr(reference.stats, name), name


# -- the conversation scope ---------------------------------------------------------------


def chat_turn(fleet: Fleet, conversation: str, calls: int) -> Run:
    """One turn of a chat app: a trace of its own, the same empty search each time, every
    GenAI span naming the conversation (as OpenInference's `using_session` does)."""
    run = Run()
    try:
        with fleet.tracer.start_as_current_span(
            "invoke_agent support", attributes={"gen_ai.operation.name": "invoke_agent"}
        ) as root:
            run.trace_id = format(root.get_span_context().trace_id, "032x")
            for _ in range(calls):
                fleet.processor.check()
                with fleet.tracer.start_as_current_span(
                    "execute_tool search_docs",
                    attributes={
                        **tool_attributes("search_docs", REFUND),
                        "gen_ai.tool.call.result": "[]",
                        "session.id": conversation,
                    },
                ):
                    run.calls += 1
    except AgentKilled as exc:
        run.killed = exc
    return run


def test_a_repeat_across_turns_of_one_chat_is_stopped_in_process():
    policy = Policy.from_mapping(
        {"defaults": {"conversation": {"enabled": True, "action": "kill"}}}
    )
    fleet = Fleet(policy)
    first = chat_turn(fleet, "chat-1", calls=2)
    other = chat_turn(fleet, "chat-2", calls=2)  # another chat: counts apart
    second = chat_turn(fleet, "chat-1", calls=5)
    assert (first.calls, first.killed, other.calls, other.killed) == (2, None, 2, None)
    # The conversation's 3rd identical call is the second turn's 1st: the check before its
    # 2nd raises.
    assert second.calls == 1 and second.killed is not None
    assert second.killed.trace_id == second.trace_id
    (decision,) = fleet.decisions
    assert (decision.scope_kind, decision.scope.conversation_id, decision.scope.traces) == (
        "conversation",
        "chat-1",
        2,
    )


def test_without_the_scope_each_turn_counts_alone():
    fleet = Fleet()
    # Two calls a turn, one fewer than the threshold (3): only the conversation reaches it.
    runs = [chat_turn(fleet, "chat-1", calls=2) for _ in range(4)]
    assert all(run.killed is None for run in runs) and fleet.decisions == []


def test_a2a_sdks_handler_spans_reach_the_core_as_agent_runs():
    """a2a-sdk's spans carry no attribute: its handler's (`on_message_send`) still reaches the
    core, as a run of the service's agent; its other spans are skipped before encoding."""
    fleet = Fleet()
    tracer = fleet.provider.get_tracer("a2a-python-sdk")
    handler = "a2a.server.request_handlers.default_request_handler_v2.DefaultRequestHandlerV2"

    def answer(depth: int) -> None:  # a request asking the service again, 6 deep
        with tracer.start_as_current_span(f"{handler}.on_message_send"):
            with tracer.start_as_current_span("a2a.server.events.EventQueueSource.close"):
                pass
            if depth > 1:
                answer(depth - 1)

    answer(6)
    [decision] = fleet.decisions
    assert (decision.rule, decision.evidence.depth) == ("delegation_depth", 6)
    assert decision.evidence.agents == ["support-bot"] * 6
    assert fleet.processor.guard.stats.spans == 6
